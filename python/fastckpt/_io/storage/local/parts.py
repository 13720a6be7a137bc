"""One folder of files several processes write at once, and read file by file (``fastckpt.dcp``'s writer and reader):
the local side of :class:`~fastckpt._io.storage.base.PartSave` / :class:`~fastckpt._io.storage.base.PartView`.

A committed part save (``commit=True``) is written into a staging folder beside its target, owned through a lock file
(:mod:`.staging`), that the opener makes and the other processes join by its path; the opener writes the small
files and the manifest last, fsyncs and puts the folder in place in one step (``_core.commit_dir``). With
``commit=False`` the files go straight into the folder (inside a save an outer save commits).

A whole checkpoint several processes write (a sharded save, :class:`LocalSharedSave`) is staged the same way: the
main process opens the staging folder, every process writes its DCP parts into a subfolder of it, and the main
process writes the small files and the manifest, carries over the user's own files and commits it in one step.

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

import json
import os
import shutil
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._format.json_input import load_json
from fastckpt._format.tensors import tensor_sources
from fastckpt._io.files import SavePlan
from fastckpt._io.storage.base import Committed
from fastckpt._io.storage.local.commit import check_target, fsync_dir, write_text
from fastckpt._io.storage.local.integrity import digest_entry, text_entry
from fastckpt._io.storage.local.layout import MANIFEST, manifest_dict, read_manifest
from fastckpt._io.storage.local.staging import OwnedPath, clean_leftovers

__all__ = ["LocalPartSave", "LocalPartView", "LocalSharedSave", "parts_of"]


class LocalPartSave:
    """A save of the folder ``path`` that every process writes its own files into (see the module docs).

    Args:
        path: the folder, as given (``commit=True``: replaced whole and atomically).
        commit: False: write straight into ``path`` (created if missing), commit nothing.
        folder: the staging folder another process opened (:meth:`join`); None: this process opens it.
    """

    def __init__(self, path: str | os.PathLike[str], *, commit: bool, folder: Path | None = None) -> None:
        self.path = Path(path)
        self.location = str(self.path)
        self.commit_here = commit
        self._owner: OwnedPath | None = None
        self._finalizer: Any = None
        if not commit:
            self.folder = Path(os.path.abspath(self.path))
        elif folder is not None:
            self.folder = folder
        else:  # the opener: a staging folder beside the target, removed unless committed
            target = check_target(self.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            clean_leftovers(target.parent)
            owner = OwnedPath(target.parent, target.name)
            owner.path.mkdir()
            self._owner = owner
            self._finalizer = weakref.finalize(self, owner.release)
            self.folder = owner.path
        self.token: Any = {"folder": str(self.folder)} if commit else None

    @classmethod
    def join(cls, path: str | os.PathLike[str], token: Any) -> LocalPartSave:
        """The save another process opened (``token``: its :attr:`token`; None: ``commit=False``)."""
        if token is None:
            return cls(path, commit=False)
        return cls(path, commit=True, folder=Path(token["folder"]))

    def _ready(self) -> None:
        if not self.commit_here:  # every process sees the same folder; a save from cached plans makes it here
            self.folder.mkdir(parents=True, exist_ok=True)

    def write_tensors(self, file: str, tensors: Mapping[str, Any], *, durable: bool = True,
                      threads: int = 0) -> list[tuple[str, list[str], tuple]]:
        """``tensors`` as the one safetensors file ``file`` (parallel positional writes from tensor memory, GIL
        released, crc32c while writing)."""
        self._ready()
        if not tensors:
            return []
        digest = _core.write_files_checked([(str(self.folder / file), tensor_sources(dict(tensors)),
                                             [("format", "pt")])], durable=durable, threads=threads)[0]
        return [(file, list(tensors), digest)]

    def write_texts(self, texts: Mapping[str, bytes], *, durable: bool = True) -> None:
        """Each small file in order (with ``commit=False``, then the folder fsynced: the outer save commits)."""
        self._ready()
        for name, data in texts.items():
            write_text(self.folder / name, data, durable)
        if not self.commit_here and durable:
            fsync_dir(self.folder)

    def commit(self, files: Mapping[str, Mapping[str, Any]], manifest: Mapping[str, Any], *,
               durable: bool = True) -> None:
        """The manifest last, the folder fsynced, then renamed into place in one step (``files`` are listed in
        ``manifest`` already)."""
        write_text(self.folder / MANIFEST, json.dumps(manifest, indent=2), durable)
        if durable:
            fsync_dir(self.folder)
        _core.commit_dir(str(self.folder), str(check_target(self.path)), durable=durable)
        self.abort()  # nothing is left at the staging path now: drops the lock file

    def abort(self) -> None:
        """Remove the staging folder this process opened (idempotent; a joined save owns nothing)."""
        if self._finalizer is not None:
            self._finalizer()  # releases the owner once
            self._finalizer = None
        self._owner = None


class LocalPartView:
    """The files of the folder ``path``, read where they are (nothing to fetch)."""

    fetches = False

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.folder = Path(path)
        self.location = str(self.folder)
        self.fetched: list[str] = []

    def has(self, name: str) -> bool:
        return (self.folder / name).is_file()

    def fetch(self, names: Any) -> None:
        """Nothing to do: every file is in the folder."""

    def records(self) -> dict[str, Any]:
        """The manifest's file records (each entry and size checked as its file is opened: a rank opens a few of
        the N files, see :func:`~fastckpt._io.storage.local.layout.read_manifest`), ``{}`` without one."""
        if not (self.folder / MANIFEST).is_file():
            return {}
        records = read_manifest(self.folder, check_sizes=False, check_entries=False).get("files", {})
        return records if isinstance(records, dict) else {}

    def close(self) -> None:
        """Nothing to release."""


class LocalSharedSave:
    """A whole checkpoint every process writes into (a sharded save; see the module docs): opened by the main
    process (``staging=None``: it makes the staging folder beside ``target``), joined by the others from its
    :attr:`token`. Its :attr:`folder` is the staging folder every process sees."""

    storage_options = None

    def __init__(self, target: Path, *, model_only: bool = False, staging: Path | None = None) -> None:
        self.target = check_target(target)
        self.location = str(self.target)
        self.model_only = model_only
        self._owner: OwnedPath | None = None
        if staging is None:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            clean_leftovers(self.target.parent)
            owner = OwnedPath(self.target.parent, self.target.name)
            owner.path.mkdir()
            self._owner = owner
            staging = owner.path
        self.folder: Path | None = staging

    @property
    def token(self) -> tuple[str, str, bool]:
        """What another process joins the save by: ``(target, staging folder name, model_only)``."""
        assert self.folder is not None
        return str(self.target), self.folder.name, self.model_only

    @classmethod
    def join(cls, token: tuple[str, str, bool]) -> LocalSharedSave:
        """Every other process: the save the main process opened."""
        target = Path(token[0])
        return cls(target, model_only=token[2], staging=target.parent / token[1])

    def part(self, name: str) -> Path:
        """The subfolder part ``name`` (``model``, ``optimizer_1``, ...) is written into."""
        assert self.folder is not None
        return self.folder / name

    def commit(self, plan: SavePlan, sharded: dict[str, Any] | None, *, durable: bool = True, threads: int = 0,
               checksums: dict[str, dict[str, Any]] | None = None) -> Committed:
        """Main process: write ``plan``'s files and the manifest into the staging folder (which holds the parts),
        carry over the user's files of the target, commit it in one step.

        ``sharded``: the manifest's ``"sharded"`` entry (None: the folder holds no DCP parts); ``checksums``: those
        of files already in the staging folder."""
        staging = self.folder
        assert staging is not None
        jobs = [(str(staging / p.name), tensor_sources(p.tensors), p.metadata) for p in plan.parts]
        digests = _core.write_files_checked(jobs, durable=durable, threads=threads, ready=None)
        checksums = {**(checksums or {}), **{p.name: digest_entry(d) for p, d in zip(plan.parts, digests)}}
        for name, text in plan.texts.items():
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            write_text(staging / name, data, durable)
            checksums[name] = text_entry(data)
        files = {p.name: p.stat().st_size for p in staging.iterdir() if p.is_file()}
        counts = plan.counts if sharded is None else {**plan.counts, "sharded": sharded}
        manifest = manifest_dict(plan.mode, files, counts, plan.step, checksums=checksums)
        _carry_user_files(self.target, staging)
        write_text(staging / MANIFEST, json.dumps(manifest, indent=2), durable)
        if durable:
            fsync_dir(staging)
        _core.commit_dir(str(staging), str(self.target), durable=durable)
        return Committed(str(self.target), None, plan.step, self.model_only, self.target)

    def abort(self) -> None:
        """Release the staging folder this process opened: after the commit nothing is left there; otherwise the
        partial folder goes (idempotent; a joined save owns nothing)."""
        if self._owner is not None:
            self._owner.release()
            self._owner = None


def parts_of(folder: Path) -> set[str]:
    """The DCP part subfolders a sharded checkpoint's manifest names (never carried over as user files)."""
    try:
        sharded = load_json((folder / MANIFEST).read_text(), f"{folder / MANIFEST}", object).get("sharded", {})
        return {str(p) for p in sharded.get("parts", [])}
    except (OSError, ValueError, AttributeError):
        return set()


def _carry_user_files(target: Path, staging: Path) -> None:
    """Hard-link into ``staging`` the files the user keeps in ``target``: those its manifest does not list."""
    try:
        listed = set(load_json((target / MANIFEST).read_text(), f"{target / MANIFEST}", object)["files"]) | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        listed = {MANIFEST}
    try:
        entries = list(target.iterdir()) if target.is_dir() else []
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name in listed or (staging / entry.name).exists() or entry.name in parts_of(target):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, staging / entry.name, symlinks=True, copy_function=os.link)
            else:
                os.link(entry, staging / entry.name, follow_symlinks=False)
        except FileNotFoundError:
            continue

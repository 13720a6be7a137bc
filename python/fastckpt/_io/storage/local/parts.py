"""One folder of files several processes write at once, and read file by file (``fastckpt.dcp``'s writer and reader):
the local side of :class:`~fastckpt._io.storage.base.PartSave` / :class:`~fastckpt._io.storage.base.PartView`.

A committed part save (``commit=True``) is written into a staging folder beside its target, owned through a lock file
(:mod:`.staging`), that the opener makes and the other processes join by its path; the opener writes the small
files and the manifest last, fsyncs and puts the folder in place in one step (``_core.commit_dir``). With
``commit=False`` the files go straight into the folder (inside a save an outer save commits).

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._format.tensors import tensor_sources
from fastckpt._io.storage.local.commit import check_target, fsync_dir, write_text
from fastckpt._io.storage.local.layout import MANIFEST, read_manifest
from fastckpt._io.storage.local.staging import OwnedPath, clean_leftovers

__all__ = ["LocalPartSave", "LocalPartView"]


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
        """The manifest's file records (sizes are checked as each file is opened), ``{}`` without one."""
        if not (self.folder / MANIFEST).is_file():
            return {}
        records = read_manifest(self.folder, check_sizes=False).get("files", {})
        return records if isinstance(records, dict) else {}

    def close(self) -> None:
        """Nothing to release."""

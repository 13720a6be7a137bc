"""The local-folder backend of :class:`~fastckpt._io.storage.base.Storage`: a checkpoint is a folder, committed by
renaming a staging folder beside it into place (or inside it: :mod:`.in_place`), the manifest written last.

A :class:`LocalStorage` is either one named checkpoint folder (``output_dir`` / ``input_dir``) or a project folder
whose checkpoints are numbered ``checkpoints/checkpoint_{n}`` and ``model_only/checkpoint_{n}`` (:mod:`.numbering`).
Saving wraps :func:`.commit.write_checkpoint` (staging folder, parallel write, manifest, one rename); opening
resolves the folder a load reads (:func:`.folder.pinned` pins it while it is read).

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastckpt._format.json_input import load_json
from fastckpt._io.storage.base import CheckpointView, Committed
from fastckpt._io.storage.local.commit import Claim, check_target, claim_target, write_checkpoint
from fastckpt._io.storage.local.folder import pinned
from fastckpt._io.storage.local.layout import CHECKPOINTS_DIR, MANIFEST, is_committed, peek_manifest
from fastckpt._io.storage.local.numbering import (
    checkpoint_numbers,
    next_checkpoint_dir,
    remove_checkpoint_dir,
    rotate_checkpoints,
)
from fastckpt._io.storage.local.parts import LocalPartSave, LocalPartView, LocalSharedSave
from fastckpt.errors import MissingStateError

__all__ = ["LocalStorage", "LocalStagedSave", "check_input_dir"]


def check_input_dir(folder: Path) -> Path:
    """``folder`` if it is a folder.

    Raises:
        MissingStateError: nothing is there, or it is a file (the message says which, and for a file names the
            folder that holds it).
    """
    if folder.is_dir():
        return folder
    if folder.exists():
        raise MissingStateError(
            f"{folder}: is a file, not a checkpoint folder; pass the folder that holds it ({folder.parent})"
        )
    raise MissingStateError(f"{folder}: no such checkpoint folder")


def _committed(folder: Path, number: int | None) -> Committed:
    try:
        manifest = load_json((folder / MANIFEST).read_text(encoding="utf-8"), f"{folder / MANIFEST}", object)
    except (OSError, ValueError):
        manifest = {}  # stock accelerate: no manifest, a full checkpoint
    manifest = manifest if isinstance(manifest, dict) else {}
    step = manifest.get("step")
    return Committed(str(folder), number, step if isinstance(step, int) else None,
                     manifest.get("mode") == "model_only", folder)


class LocalStagedSave:
    """A local save opened by :meth:`LocalStorage.begin`: nothing exists at ``target`` until :meth:`commit`, which
    writes the plan into a staging folder and renames it into place in one step (:func:`.commit.write_checkpoint`)."""

    def __init__(self, target: Path, number: int | None, storage: LocalStorage | None = None) -> None:
        self.target = target.absolute()
        self.location = str(self.target)
        self.number = number
        self._storage = storage
        self._write: tuple[Any, dict[str, Any]] | None = None
        self._after_commit: Callable[[Path], Any] | None = None
        self._claim: Claim | None = None

    def claim(self) -> None:
        """Claim the target now, as the commit does before its first byte (:func:`.commit.claim_target`: parent
        folders, staging folder): an async save's call, so a folder that takes no files fails there. Idempotent;
        :meth:`commit` writes into what was claimed, :meth:`abort` releases it.

        Raises:
            DestinationNotWritableError: the target's folder takes no new files (nothing is left behind).
        """
        if self._claim is None:
            self._claim = claim_target(self.target)

    def share(self, link: Callable[[Path | None], Any], after_commit: Callable[[Path], Any]) -> None:
        """``share_unchanged``: ``link(previous)`` marks the files of the plan equal to the storage's
        :meth:`LocalStorage.previous` checkpoint to be hard-linked from it (None: nothing to link), before
        :meth:`write`; ``after_commit(folder)`` runs after the commit (it remembers the written hashes)."""
        previous = None if self._storage is None else self._storage.previous(self)
        link(None if previous is None else Path(previous.location))
        self._after_commit = after_commit

    def renumber(self, number: int) -> None:
        """Save to ``checkpoint_{number}`` instead (an automatic name above the async saves still in flight)."""
        assert self.number is not None and self._claim is None, "renumbered after its claim"
        self.target = self.target.with_name(f"checkpoint_{number}")
        self.location, self.number = str(self.target), number

    def returned(self, result: Any, *, total_limit: int | None = None) -> Any:
        """What the public call returns: ``result`` (the committed folder, or the async save's handle)."""
        return result

    def write(self, plan: Any, *, durable: bool = True, threads: int = 0, **options: Any) -> None:
        """Take ``plan``; its files are written by :meth:`commit` (``options``: ``ready``, ``progress``,
        ``before_commit`` of :func:`.commit.write_checkpoint`)."""
        self._write = (plan, dict(durable=durable, threads=threads, **options))

    def commit(self) -> Committed:
        """Write the plan beside the target and rename it into place (the previous checkpoint there stays intact
        until then). Raises OSError naming the folder; nothing is committed."""
        if self._write is None:
            raise ValueError(f"{self.target}: nothing was written to commit")
        plan, options = self._write
        claim, self._claim = self._claim, None
        write_checkpoint(plan, self.target, claim=claim, **options)
        self._write = None
        if self._after_commit is not None:
            self._after_commit(self.target)
        return _committed(self.target, self.number)

    def abort(self) -> None:
        """Drop the plan and release a claim (its staging folder; the write happens inside :meth:`commit`)."""
        self._write = None
        if self._claim is not None:
            self._claim.release()
            self._claim = None


class LocalStorage:
    """Checkpoints in local folders: one named folder (``folder``), or the numbered ones of a project folder.

    Args:
        folder: a checkpoint folder (``output_dir`` / ``input_dir``), or None for automatic naming.
        project_dir: the project folder for automatic naming; None: the current directory.
    """

    tier = "local"
    #: async saves may stream from the live tensors (see :mod:`fastckpt._io.async_save.modes`)
    snapshot_only: str | None = None

    def __init__(self, folder: str | os.PathLike[str] | None = None,
                 project_dir: str | os.PathLike[str] | None = None) -> None:
        self.folder = None if folder is None else Path(folder)
        self._given = folder  # as given: an empty path is refused by a save (check_target), Path("") would be "."
        self.project = Path(project_dir if project_dir is not None else os.getcwd())
        self.location = str(self.folder if self.folder is not None else self.project)

    @property
    def root(self) -> Path:
        """The folder whose async saves in flight a load waits for (the checkpoint, or the project's
        ``checkpoints/``)."""
        return self.folder if self.folder is not None else self.project / CHECKPOINTS_DIR

    def begin(self, name: str | None = None, *, model_only: bool = False, step: int = 0) -> LocalStagedSave:
        """A save of the named folder, ``name`` inside the project, or the next ``checkpoint_{n}`` of its kind."""
        if name is not None:
            return LocalStagedSave(check_target(self.project / name), None, self)
        if self.folder is not None:
            return LocalStagedSave(check_target(self._given), None, self)
        target = next_checkpoint_dir(self.project, model_only=model_only)
        return LocalStagedSave(target, int(target.name.rsplit("_", 1)[1]), self)

    def check_save(self, *, sharded: bool, async_save: Any, share_unchanged: bool) -> None:
        """Every kind of save is served (sharded ones through DCP, into a folder every process shares)."""

    def previous(self, save: LocalStagedSave) -> Committed | None:
        """The checkpoint ``save`` shares unchanged files with (``share_unchanged``): the newest committed
        ``checkpoint_N`` of the project other than the save's own folder, else that folder when it is a committed
        checkpoint (an overwrite), else None."""
        numbers = checkpoint_numbers(self.project)
        for n in sorted(numbers, reverse=True):
            if numbers[n].absolute() != save.target and (numbers[n] / MANIFEST).is_file():
                return _committed(numbers[n], n)
        target = save.target
        return _committed(target, None) if target.is_dir() and is_committed(target) and (target / MANIFEST).is_file() \
            else None

    def list(self, *, model_only: bool = False, full_only: bool | None = None) -> list[Committed]:
        """The committed checkpoints of one kind (full ones: saved in full unless ``full_only=False``), oldest
        first; a named folder lists itself when committed."""
        if self.folder is not None:
            return [_committed(self.folder, None)] if is_committed(self.folder) else []
        full_only = not model_only if full_only is None else full_only
        numbers = checkpoint_numbers(self.project, model_only=model_only, full_only=full_only)
        return [_committed(numbers[n], n) for n in sorted(numbers)]

    def locate(self, ref: Committed | None = None, *, model_only: bool = False) -> Path:
        """The folder :meth:`open` reads: ``ref``, the named folder, or the newest committed checkpoint.

        Raises:
            MissingStateError: no such folder, a file, or no committed checkpoint of that kind (named).
        """
        if ref is not None:
            return check_input_dir(Path(ref.location))
        if self.folder is not None:
            return check_input_dir(self.folder)
        numbers = checkpoint_numbers(self.project, full_only=not model_only)
        if not numbers:
            what = "full checkpoint" if not model_only and checkpoint_numbers(self.project) else "checkpoint"
            raise MissingStateError(f"{self.project / CHECKPOINTS_DIR}: no committed {what} (no checkpoint_N with "
                                    f"{MANIFEST})")
        return numbers[max(numbers)]

    @contextlib.contextmanager
    def open(self, ref: Committed | None = None, *, model_only: bool = False, verify: bool = True,
             threads: int = 0) -> Iterator[CheckpointView]:
        """The folder :meth:`locate` picks, pinned while the block reads it (:func:`.folder.pinned`: every file from
        one save, each summed against the manifest when ``verify``, checked when the block ends). An error inside,
        when another save replaced the folder meanwhile, becomes CheckpointChangedError: open it again."""
        folder = self.locate(ref, model_only=model_only)
        with pinned(folder, verify=verify, threads=threads, defer=True) as handle:
            yield CheckpointView(location=str(folder), folder=handle, path=folder, manifest=peek_manifest(handle),
                                 tier=self.tier)

    @contextlib.contextmanager
    def open_shared(self, *, model_only: bool = False, timeout: float, what: str) -> Iterator[CheckpointView]:
        """The folder :meth:`locate` picks, unpinned: every process resolves it itself and the sharded load's
        readers open its files (DCP checks each against the manifest)."""
        folder = self.locate(model_only=model_only)
        yield CheckpointView(location=str(folder.absolute()), folder=folder, path=folder, tier=self.tier)

    @contextlib.contextmanager
    def as_local(self, ref: Committed | None = None, *, model_only: bool = False) -> Iterator[CheckpointView]:
        """The folder itself: ``ref``'s, the named path as given (a file or nothing there included: the caller's
        tool reports it), or the newest committed checkpoint of the project (:meth:`locate`)."""
        folder = self.folder if ref is None and self.folder is not None else self.locate(ref, model_only=model_only)
        yield CheckpointView(location=str(folder), folder=folder, path=folder, tier=self.tier)

    def begin_shared(self, name: str | None = None, *, model_only: bool = False, step: int = 0) -> LocalSharedSave:
        """Main process: a save every process writes its parts into (:class:`.parts.LocalSharedSave`): the named
        folder, ``name`` in the project, or the next ``checkpoint_{n}`` of its kind; a staging folder beside it."""
        return LocalSharedSave(self.begin(name, model_only=model_only, step=step).target, model_only=model_only)

    def join_shared(self, token: Any) -> LocalSharedSave:
        """Every other process: the save the main process opened (its staging folder, from ``token``)."""
        return LocalSharedSave.join(token)

    def _part_folder(self) -> Path:
        if self.folder is None:
            raise ValueError(f"{self.project}: a part save or view needs a named folder, not a project")
        return self.folder

    def begin_part(self, *, commit: bool = True) -> LocalPartSave:
        """A save of the named folder every process writes its own files into (:class:`.parts.LocalPartSave`:
        a staging folder beside it, committed by rename; ``commit=False``: straight into it)."""
        return LocalPartSave(self._part_folder(), commit=commit)

    def join_part(self, token: Any) -> LocalPartSave:
        """The part save another process opened (its staging folder, from ``token``)."""
        return LocalPartSave.join(self._part_folder(), token)

    def open_part(self) -> LocalPartView:
        """The named folder's files, read where they are."""
        return LocalPartView(self._part_folder())

    def remove(self, ref: Committed) -> None:
        """Rename the folder to an owned trash name, then delete it (never half-removed under its name)."""
        remove_checkpoint_dir(Path(ref.location))

    def rotate(self, total_limit: int, *, model_only: bool = False) -> list[str]:
        """:func:`.numbering.rotate_checkpoints` of the project (a named folder is never rotated)."""
        if self.folder is not None:
            return []
        return [str(p) for p in rotate_checkpoints(self.project, total_limit, model_only=model_only)]

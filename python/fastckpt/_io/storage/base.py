"""The storage interface: where checkpoints live, behind the same few verbs for every backend.

A location (a local folder, an ``s3://`` URL, a memory-tier folder under ``/dev/shm``, a peer's replica, or a tiered
composition of them) becomes one :class:`Storage` exactly once, at the public call
(:func:`fastckpt._io.storage.resolve`). Everything below the entry points speaks these verbs and never branches on
the scheme:

==========================  ==========================================================================================
verb                        meaning
==========================  ==========================================================================================
``Storage.begin(name)``     open a save: staged and invisible to readers until :meth:`StagedSave.commit`
``StagedSave.write(plan)``  write every planned file from tensor memory into it (parallel, checksummed on the way)
``StagedSave.commit()``     make it visible in one step, the manifest last; or refuse and leave the previous intact
``StagedSave.abort()``      drop a staged save (idempotent; a dead process's staging is removed by the next save)
``Storage.list()``          the committed checkpoints, oldest first (``checkpoint_{n}`` numbering, with the step)
``Storage.open(ref)``       a pinned, validated view: every file of one load comes from the same committed save
``Storage.open_shared()``   the same for a sharded load by a process group: every process reads the same save
``Storage.as_local(ref)``   its files as they are under a local path, for tools that check or show them (verify, CLI)
``Storage.remove(ref)``     remove one committed checkpoint (it stops counting at once; never half-removed)
``Storage.rotate(n)``       remove the oldest committed checkpoints of one kind so that ``n`` remain
==========================  ==========================================================================================

Conventions (what the conformance suite, ``tests/io/test_storage_conformance.py``, checks of every backend): a save
that was not committed is never listed and never opened; a commit either makes the whole save visible or raises and
changes nothing; :meth:`Storage.open` reads the manifest once and hands it down in the :class:`CheckpointView`;
``list`` orders by checkpoint number; ``remove`` of a checkpoint being read leaves that reader's view intact.

May import: layers 0-1 only (the backends import this, never the reverse).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["Committed", "CheckpointView", "StagedSave", "Storage"]


@dataclass(frozen=True)
class Committed:
    """One committed checkpoint of a :class:`Storage`.

    Attributes:
        location: how users and errors name it (a folder path or an ``s3://`` URL), as ``str``.
        number: the ``n`` of ``checkpoint_{n}`` under automatic naming; None for a named location.
        step: the training step its manifest records (``fastckpt.json``'s ``step``), None if it records none.
        model_only: the manifest's mode is ``"model_only"``.
        path: the local folder it is, as ``Path``; None when it is no local folder (an object-store prefix).
    """

    location: str
    number: int | None
    step: int | None = None
    model_only: bool = False
    path: Path | None = None

    @property
    def named(self) -> Path | str:
        """How a public call returns it (``latest_checkpoint``): the local folder as a ``Path``, else the URL."""
        return self.path if self.path is not None else self.location


@dataclass
class CheckpointView:
    """A committed checkpoint opened for one load: pinned (every file comes from this one save) and validated.

    Attributes:
        location: the committed checkpoint's name for users (path or URL).
        folder: a local path every file of the load is opened through (the pinned folder itself, a
            ``/proc/self/fd`` path, or the in-memory copy of fetched objects).
        path: the same folder unpinned (for readers that open files their own way: DCP's), as ``Path``.
        manifest: the parsed ``fastckpt.json`` when the backend read it to open the view (an object store's
            committed manifest), else None: the load plan reads it once through ``folder``.
        tier: which storage tier it came from (``"memory"``, ``"peer"``, ``"local"``, ``"remote"``).
    """

    location: str
    folder: Path
    path: Path
    manifest: Mapping[str, Any] | None = None
    tier: str = "local"
    #: the reads through ``folder`` were already checked against the manifest's crc32c when it was opened (an
    #: object store's fetch): the loader need not sum them again
    checked: bool = False
    #: ``path`` is a copy of the checkpoint's files (an object store's fetch into memory), gone once the view
    #: closes: users and errors are told ``location``, never ``path``
    copy: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def named(self) -> Path | str:
        """How a public call names it (``VerifyReport.folder``): ``path`` when the files are read where they are,
        else ``location`` (the URL of a fetched copy)."""
        return self.location if self.copy else self.path


@runtime_checkable
class StagedSave(Protocol):
    """A save opened by :meth:`Storage.begin`: invisible until :meth:`commit`."""

    location: str

    def write(self, plan: Any, *, durable: bool = True, threads: int = 0, **options: Any) -> None:
        """Write every file of ``plan`` (a :class:`fastckpt._io.files.SavePlan`) from tensor memory, the checksums
        summed on the way. ``options``: backend-specific (``ready``, ``progress``, ``before_commit``). Raises
        OSError (names the file) and leaves nothing committed. A backend whose commit is one crash-safe call over
        the written bytes (the local rename of a staging folder, the object store's manifest-last upload) may take
        the plan here and write it in :meth:`commit`: what readers see is the same."""
        ...

    def commit(self) -> Committed:
        """Make the save visible in one step, the manifest last. Raises (and commits nothing) if it cannot."""
        ...

    def abort(self) -> None:
        """Drop everything this save staged. Idempotent; never touches a committed checkpoint."""
        ...


@runtime_checkable
class Storage(Protocol):
    """Where checkpoints live (one backend per sub-package of :mod:`fastckpt._io.storage`)."""

    #: how errors and logs name it (a path or URL), as ``str``
    location: str
    #: the tier name a :class:`CheckpointView` of it carries
    tier: str

    def begin(self, name: str | None = None, *, model_only: bool = False, step: int = 0) -> StagedSave:
        """Open a staged save: ``name`` a checkpoint inside the storage, or None for the next ``checkpoint_{n}``."""
        ...

    def list(self, *, model_only: bool = False) -> list[Committed]:
        """The committed checkpoints of one kind, oldest (lowest number) first."""
        ...

    def open(self, ref: Committed | None = None, *, model_only: bool = False, verify: bool = True,
             threads: int = 0) -> contextlib.AbstractContextManager[CheckpointView]:
        """A view of ``ref`` for one load (None: the storage's own checkpoint when it names one, else its newest
        full checkpoint, or of either kind with ``model_only``). ``verify``: every byte read through it is checked
        against the manifest's crc32c (IntegrityError names file and tensor). Raises MissingStateError when there
        is nothing committed to open."""
        ...

    def open_shared(self, *, model_only: bool = False, timeout: float,
                    what: str) -> contextlib.AbstractContextManager[CheckpointView]:
        """A view every process of a group reads one sharded load from (each reads the shards its boxes come from):
        the same committed save on every process, or a typed error on every process within ``timeout`` seconds.
        ``what`` names the call in those errors (``"load_state"``). ``extra["remote"]``, when set, fetches parts
        lazily."""
        ...

    def as_local(self, ref: Committed | None = None, *,
                 model_only: bool = False) -> contextlib.AbstractContextManager[CheckpointView]:
        """The files of ``ref`` (None: as :meth:`open` picks, but a named location as given, whatever is there)
        under a local path, ``view.path``, as they are: nothing pinned and no check of the backend's own beyond what
        reaching them takes (an object store's fetch checks every object against the manifest: ``view.copy``).
        For tools that check or show a checkpoint (``verify_checkpoint``, the CLI), which report damage themselves.
        Raises MissingStateError when nothing committed is there to pick (a named local path is handed on even
        when it is a file or absent: the tool names it)."""
        ...

    def remove(self, ref: Committed) -> None:
        """Remove one committed checkpoint; it stops being listed at once and is never left half-removed."""
        ...

    def rotate(self, total_limit: int, *, model_only: bool = False) -> list[str]:
        """Remove the oldest committed checkpoints of one kind so that ``total_limit`` remain (as :meth:`remove`
        does); returns their locations."""
        ...


def newest(storage: Storage, *, model_only: bool = False) -> Committed | None:
    """The newest committed checkpoint of one kind of ``storage``, or None."""
    found = storage.list(model_only=model_only)
    return found[-1] if found else None


@contextlib.contextmanager
def staged(storage: Storage, name: str | None = None, **kwargs: Any) -> Iterator[StagedSave]:
    """``begin`` a save and ``abort`` it if the block raises (a commit inside the block stays)."""
    save = storage.begin(name, **kwargs)
    try:
        yield save
    except BaseException:
        save.abort()
        raise

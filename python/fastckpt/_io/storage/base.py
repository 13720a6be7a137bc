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
``Storage.begin_part()``    open a save of one folder of files that several processes write (fastckpt.dcp's writer)
``Storage.join_part(t)``    the same save on another process, from the opener's ``token``
``Storage.open_part()``     the committed files of one such folder for a reader that opens them one by one
``Storage.begin_shared()``  open a whole checkpoint every process of a group writes its parts into (a sharded save)
``Storage.join_shared(t)``  the same save on another process, from the opener's ``token``
==========================  ==========================================================================================

The last five (:class:`PartStorage`) are what several processes writing one checkpoint speak: ``fastckpt.dcp``'s
``StorageWriter`` / ``StorageReader`` (per process and per file, below what a :class:`StagedSave` offers) and the
sharded save, whose processes each write their DCP parts into a :class:`SharedSave`.

Conventions (what the conformance suite, ``tests/io/test_storage_conformance.py``, checks of every backend): a save
that was not committed is never listed and never opened; a commit either makes the whole save visible or raises and
changes nothing; :meth:`Storage.open` reads the manifest once and hands it down in the :class:`CheckpointView`;
``list`` orders by checkpoint number; ``remove`` of a checkpoint being read leaves that reader's view intact.

May import: layers 0-1 only (the backends import this, never the reverse).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["Committed", "CheckpointView", "PartSave", "PartStorage", "PartView", "SharedSave", "StagedSave", "Storage"]


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
    #: ``parts(name)``: the :class:`PartView` of the part folder ``name`` inside it (``model``, ``optimizer``...)
    #: for a sharded load's DCP readers (an object store's fetches each shard object as a reader asks for it);
    #: None: the part readers open ``path / name`` themselves
    parts: Callable[[str], PartView] | None = None

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

    def share(self, link: Any, after_commit: Any) -> None:
        """``share_unchanged``: call ``link(previous)`` with the folder of the storage's :meth:`Storage.previous`
        checkpoint (None: nothing to link from) before :meth:`write`; run ``after_commit(folder)`` after the
        commit. ValueError where the backend does not serve it."""
        ...

    def returned(self, result: Any, *, total_limit: int | None = None) -> Any:
        """What the public save call returns for ``result`` (the committed folder or URL, or an async save's
        handle): ``result`` itself, or a backend's own handle (a tiered save's upload, which rotates the remote
        tier to ``total_limit`` after its commit)."""
        ...


@runtime_checkable
class Storage(Protocol):
    """Where checkpoints live (one backend per sub-package of :mod:`fastckpt._io.storage`)."""

    #: how errors and logs name it (a path or URL), as ``str``
    location: str
    #: the tier name a :class:`CheckpointView` of it carries
    tier: str
    #: None, or why every async save to it is a snapshot into host memory (``"over s3://"``: the upload then
    #: reads only the copy); such a store is written from host memory only, so device tensors are staged too
    snapshot_only: str | None

    def check_save(self, *, sharded: bool, async_save: Any, share_unchanged: bool) -> None:
        """Raise ValueError, before anything is written, for a kind of save the backend does not serve."""
        ...

    def previous(self, save: Any) -> Committed | None:
        """The committed checkpoint ``save`` (its :meth:`begin`'s) may share unchanged files with
        (``share_unchanged``), or None."""
        ...

    def begin(self, name: str | None = None, *, model_only: bool = False, step: int = 0) -> StagedSave:
        """Open a staged save: ``name`` a checkpoint inside the storage, or None for the next ``checkpoint_{n}``."""
        ...

    def list(self, *, model_only: bool = False, full_only: bool | None = None) -> list[Committed]:
        """The committed checkpoints of one kind, oldest (lowest number) first: the numbered checkpoints
        (``checkpoints/``), or the model-only snapshots with ``model_only``. ``full_only`` (default: not
        ``model_only``): of the numbered ones only those saved in full (what a full load resumes from); False: of
        either mode (what a model-only load picks from, and what automatic numbering counts)."""
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
        ``what`` names the call in those errors (``"load_state"``). ``view.parts``, when set, gives each part's
        :class:`PartView` (fetching its shards as its reader asks)."""
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


@runtime_checkable
class PartSave(Protocol):
    """A save of one folder of files that several processes write at once (``fastckpt.dcp``'s ``StorageWriter``):
    opened by one process (:meth:`PartStorage.begin_part`), joined by the others from its :attr:`token`
    (:meth:`PartStorage.join_part`); each process writes its own tensor files, the opener writes the small files
    and commits. Opened with ``commit=False`` it is a folder inside a save an outer save commits: the files go
    straight there and nothing is committed here."""

    #: how errors name it (a folder path or an ``s3://`` URL)
    location: str
    #: what another process needs to join this save (picklable; travels in DCP's plan), None with ``commit=False``
    token: Any

    def write_tensors(self, file: str, tensors: Mapping[str, Any], *, durable: bool = True,
                      threads: int = 0) -> list[tuple[str, list[str], tuple]]:
        """Write ``tensors`` (``{name: CPU tensor}``, from their memory, crc32c summed on the way) as safetensors
        under the name ``file`` (a backend may split them over several files named after it); returns
        ``[(file name, tensor names in it, the core's digest)]``. Raises OSError naming the file."""
        ...

    def write_texts(self, texts: Mapping[str, bytes], *, durable: bool = True) -> None:
        """Write the small files in order (the last one completes the folder for a reader)."""
        ...

    def commit(self, files: Mapping[str, Mapping[str, Any]], manifest: Mapping[str, Any], *,
               durable: bool = True) -> None:
        """Opener only: make the folder visible in one step, ``manifest`` (listing ``files``: ``{name: {"bytes",
        "crc32c", ...}}``) last; or raise and leave the previous checkpoint as it was."""
        ...

    def abort(self) -> None:
        """Drop what this save staged (idempotent; a dead process's staging goes with the next save)."""
        ...


@runtime_checkable
class PartView(Protocol):
    """The committed files of one folder (a checkpoint, or a part folder inside one) for a reader that opens
    them one by one (``fastckpt.dcp``'s ``StorageReader``), read through :attr:`folder` once :meth:`fetch`
    brought them there."""

    #: how errors name it (a folder path or an ``s3://`` URL)
    location: str
    #: the local path its files are opened through (the folder itself, or the in-memory copy of fetched objects)
    folder: Path
    #: True: each file reaches :attr:`folder` only when fetched (each process fetches what it reads: a shared read
    #: between processes would gain nothing); False: every file is there
    fetches: bool
    #: the names fetched so far, in order (``[]`` for a folder read where it is)
    fetched: list[str]

    def has(self, name: str) -> bool:
        """Whether the folder holds ``name`` (fetched or not)."""
        ...

    def fetch(self, names: Any) -> None:
        """Bring ``names`` into :attr:`folder` (each checked against the manifest's crc32c as it comes in where
        the backend fetches). IntegrityError / OSError name the file."""
        ...

    def records(self) -> dict[str, Any]:
        """The files as the checkpoint's manifest records them (``{name: {"bytes", "crc32c", ...}}``; ``{}``
        without a manifest)."""
        ...

    def close(self) -> None:
        """Release what was fetched (idempotent)."""
        ...


@runtime_checkable
class SharedSave(Protocol):
    """A whole checkpoint every process of a group writes into (a sharded save): opened by the main process
    (:meth:`PartStorage.begin_shared`), joined by the others from its :attr:`token`; each process writes its DCP
    parts at :meth:`part` (a ``fastckpt.dcp`` ``StorageWriter(commit=False)`` there), then the main process commits
    the small files and the manifest last."""

    #: how errors name it (the checkpoint's folder or URL, picked by the opener)
    location: str
    #: what another process joins it by (picklable)
    token: Any
    #: the staging folder every process sees (a local save's), or None when the processes share no folder (an
    #: object store's: a model-only save gathers the full state to the main process instead of assembling it)
    folder: Path | None
    #: the settings a part's writer resolves :meth:`part` with (S3 endpoint, credentials...; None locally)
    storage_options: Mapping[str, Any] | None

    def part(self, name: str) -> Path | str:
        """Where part ``name`` (``model``, ``optimizer_1``...) is written: a folder or a URL prefix in the save."""
        ...

    def commit(self, plan: Any, sharded: dict[str, Any] | None, *, durable: bool = True, threads: int = 0,
               checksums: dict[str, dict[str, Any]] | None = None) -> Committed:
        """Main process: write ``plan``'s files, then the manifest last (``sharded``: its ``"sharded"`` entry,
        whose ``files`` the processes wrote; ``checksums``: of files already staged), and make the save visible in
        one step. Raises (ConcurrentSaveError, OSError...) and commits nothing if it cannot."""
        ...

    def abort(self) -> None:
        """Drop what the opener staged (after a commit: nothing; on a joined process: nothing). Never raises."""
        ...


@runtime_checkable
class PartStorage(Protocol):
    """A :class:`Storage` that serves :class:`PartSave` / :class:`PartView` (local folders and ``s3://``)."""

    location: str

    def begin_part(self, *, commit: bool = True) -> PartSave:
        """Open a save of the storage's named location (see :class:`PartSave`); with ``commit=True`` it is staged
        and invisible until :meth:`PartSave.commit`. Raises ValueError for a location it cannot serve so."""
        ...

    def join_part(self, token: Any) -> PartSave:
        """The save another process opened (its :attr:`PartSave.token`; None: ``commit=False``)."""
        ...

    def open_part(self) -> PartView:
        """The committed files at the storage's named location (the newest committed save of an object store's).
        Raises MissingStateError when nothing is committed there (a folder: its files are checked as read)."""
        ...

    def begin_shared(self, name: str | None = None, *, model_only: bool = False, step: int = 0) -> SharedSave:
        """Main process: open a :class:`SharedSave` of the named checkpoint, ``name`` inside the storage, or its
        next ``checkpoint_{n}`` (as :meth:`Storage.begin` picks). Raises OSError / ValueError, nothing staged."""
        ...

    def join_shared(self, token: Any) -> SharedSave:
        """Every other process: the save the main process opened (its :attr:`SharedSave.token`)."""
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

"""The memory tier: the newest checkpoint of this process in host memory (a folder under ``/dev/shm``, or any
folder the user names), laid out as a project (``{root}/checkpoints/checkpoint_{step}``) so that every reader of
fastckpt reads it, and committed with the same manifest-last rule as a durable save, only without fsyncs.

A :class:`MemoryTier` is a :class:`~fastckpt._io.storage.base.Storage` (it runs the conformance suite,
``tests/io/test_storage_conformance.py``; model-only snapshots go to ``{root}/model_only``, as in a project):
:meth:`MemoryTier.begin` opens a staging
folder owned by this process (a locked ``.checkpoint_{n}.fastckpt-staging-...`` name, removed by the next save if
the process died), :meth:`MemorySave.write` writes the plan into it from tensor memory (the Rust writer, in
parallel, crc32c summed on the way, the manifest last), :meth:`MemorySave.commit` puts it in place in one rename.
Because tmpfs lives as long as the machine, a trainer killed by SIGKILL, the OOM killer or a segfault restarts from
RAM; the folder dies with the machine (that is what :mod:`fastckpt._io.storage.peer` replicas are for).

May import: layers 0-2.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._io.storage.base import CheckpointView, Committed
from fastckpt._io.storage.local.commit import fsync_dir, write_files
from fastckpt._io.storage.local.folder import pinned
from fastckpt._io.storage.local.layout import CHECKPOINTS_DIR, MANIFEST, MODEL_ONLY_DIR, read_manifest
from fastckpt._io.storage.local.numbering import checkpoint_numbers, remove_folders
from fastckpt._io.storage.local.staging import OwnedPath, clean_leftovers
from fastckpt.errors import CheckpointError

__all__ = ["REPLICAS_DIR", "MemorySave", "MemoryTier", "copy_committed", "default_memory_root", "job_id"]

_JOB_ENV = ("FASTCKPT_JOB_ID",)
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def job_id(project_dir: Path) -> str:
    """A name for this job that a restarted process on the same machine computes again: ``FASTCKPT_JOB_ID``, else
    the project folder's name plus the crc32c of its absolute path (a scheduler's job id or torchrun's run id
    changes across a requeue or a new launch; the project does not)."""
    for key in _JOB_ENV:
        value = os.environ.get(key)
        if value and value != "none":
            return _SAFE.sub("_", value)[:64]
    path = str(Path(project_dir).absolute())
    return f"{_SAFE.sub('_', Path(path).name)[:32]}-{_core.crc32c(path.encode()):08x}"


def default_memory_root(project_dir: Path, rank: int) -> Path:
    """``/dev/shm/fastckpt-{job id}/rank{rank}`` (the system's temporary folder where ``/dev/shm`` is missing)."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"fastckpt-{job_id(project_dir)}" / f"rank{rank}"


class MemorySave:
    """A save opened by :meth:`MemoryTier.begin`: a staging folder, invisible until :meth:`commit`."""

    def __init__(self, tier: MemoryTier, step: int, *, model_only: bool = False) -> None:
        self.tier = tier
        self.step = step
        self.model_only = model_only
        folder = tier.root / MODEL_ONLY_DIR if model_only else tier.folder
        self.target = folder / f"checkpoint_{step}"
        self.location = str(self.target)
        folder.mkdir(parents=True, exist_ok=True)
        clean_leftovers(folder)
        self._owner: OwnedPath | None = OwnedPath(folder, self.target.name)
        self._owner.path.mkdir()
        self.files: dict[str, int] = {}

    @property
    def staging(self) -> Path:
        """The staging folder the files go to (before :meth:`commit`)."""
        assert self._owner is not None, "the save was committed or aborted"
        return self._owner.path

    def write(self, plan: Any, *, durable: bool | None = None, threads: int = 0, **options: Any) -> dict[str, int]:
        """Write every file of ``plan`` (a :class:`fastckpt._io.files.SavePlan`) into the staging folder, the
        manifest last; ``options``: ``ready``, ``progress``, ``before_commit`` (see
        :func:`fastckpt._io.storage.local.commit.write_checkpoint`). Returns ``{file name: bytes}``."""
        durable = self.tier.durable if durable is None else durable
        extra = {k: v for k, v in (("project", self.tier.project), ("project_id", self.tier.project_id)) if v}
        self.files = write_files(plan, self.staging, save_id=secrets.token_hex(8), durable=durable, threads=threads,
                                 extra=extra,
                                 ready=options.get("ready"), file_mode=None, progress=options.get("progress"),
                                 before_commit=options.get("before_commit"))
        return self.files

    def copy_from(self, folder: Path) -> dict[str, int]:
        """Fill the staging folder with a copy of the committed checkpoint ``folder`` (its manifest last)."""
        self.files = copy_files(folder, self.staging, durable=self.tier.durable)
        return self.files

    def commit(self) -> Committed:
        """Put the staging folder in place as ``checkpoint_{step}`` in one rename (over an older folder of the same
        step, which goes), then remove the tier's older checkpoints that nobody holds (:meth:`MemoryTier.hold`).

        Raises:
            OSError: the rename failed; the previous checkpoint is intact.
        """
        if not (self.staging / MANIFEST).is_file():
            raise FileNotFoundError(f"{self.staging}: nothing was written (no {MANIFEST}); nothing committed")
        _core.commit_dir(str(self.staging), str(self.target), durable=self.tier.durable)
        assert self._owner is not None
        self._owner.release()
        self._owner = None
        self.tier.prune(keep=self.step, model_only=self.model_only)
        return Committed(self.location, self.step, self.step, self.model_only, self.target)

    def abort(self) -> None:
        """Drop the staging folder (idempotent)."""
        if self._owner is not None:
            self._owner.release()
            self._owner = None

    def share(self, link: Any, after_commit: Any) -> None:
        """Nothing to link from (each memory-tier save is written whole)."""
        link(None)

    def returned(self, result: Any, *, total_limit: int | None = None) -> Any:
        """What a save call returns: ``result`` as given."""
        return result


class MemoryTier:
    """A folder holding the newest committed checkpoint of one process (see the module docs).

    Args:
        root: the tier's folder (created on the first save); checkpoints go to ``{root}/checkpoints``.
        tier: the name restores and warnings give it (``"memory"``; ``"peer"`` for a replica of another rank's).
        durable: fsync what is written (False for tmpfs, where it costs nothing and buys nothing).
        keep: committed checkpoints kept (the newest; older ones go once a newer one is committed).
        project: the identity of the project whose snapshots these are (its resolved folder), recorded in each
            snapshot's manifest (``"project"``) so that a restore of another project skips them; with
            :attr:`project_id` set, the project folder's incarnation too (``"project_id"``: a folder deleted and
            made again at the same path is another project).
    """

    def __init__(self, root: Path, *, tier: str = "memory", durable: bool = False, keep: int = 1,
                 project: str | None = None) -> None:
        self.root = Path(root)
        self.project = project
        self.project_id: str | None = None  # the project folder's incarnation, recorded as "project_id"
        self.folder = self.root / CHECKPOINTS_DIR
        self.location = str(self.root)
        self.tier = tier
        self.durable = durable
        self.keep = keep
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()  # hold / release / prune from the manager's threads
        self._reapers: list[threading.Thread] = []  # background removals of pruned checkpoints

    #: async saves may stream from the live tensors
    snapshot_only: str | None = None

    def check_save(self, *, sharded: bool, async_save: Any, share_unchanged: bool) -> None:
        """Every kind of save is served."""

    def previous(self, save: MemorySave) -> Committed | None:
        """None: the memory tier keeps no files to share (each save is written whole)."""
        return None

    def claim(self) -> MemoryTier:
        """Make this process the tier's only writer: an exclusive ``flock`` on ``.{root name}.owner`` beside
        ``root``, held until :meth:`unclaim` or the process ends (SIGKILL included: the kernel drops it). Another
        manager of this process takes the claim over (a restart inside one interpreter).

        Returns: the tier itself.

        Raises:
            CheckpointError: another process holds it (two runs with one memory folder, e.g. two jobs of one
                project on one machine without ``FASTCKPT_JOB_ID``): names the folder and that process.
        """
        path = self.root.parent / f".{self.root.name}.owner"
        with _claims_lock:
            if path in _claims:
                return self
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise CheckpointError(
                    f"memory tier {self.root}: another process (pid {owner}) is using it; two runs cannot share one "
                    "memory tier: give each run its own memory= folder or FASTCKPT_JOB_ID") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            _claims[path] = fd
        return self

    def unclaim(self) -> None:
        """Give up :meth:`claim` (the owner file is removed; nothing else is touched)."""
        path = self.root.parent / f".{self.root.name}.owner"
        with _claims_lock:
            fd = _claims.pop(path, None)
            if fd is None:
                return
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)

    def begin(self, name: str | None = None, *, model_only: bool = False, step: int = 0) -> MemorySave:
        """Open a staged save of ``step`` (committed as ``checkpoint_{step}``, under ``model_only/`` with
        ``model_only``); ``name`` must be None (the tier names checkpoints by step)."""
        if name is not None:
            raise ValueError("the memory tier names checkpoints by step: pass step=, not name")
        return MemorySave(self, step, model_only=model_only)

    def list(self, *, model_only: bool = False, full_only: bool | None = None) -> list[Committed]:
        """The committed checkpoints of one kind, oldest first (number = step); the tier keeps model-only
        snapshots under ``model_only/`` only, so ``full_only`` changes nothing."""
        found = checkpoint_numbers(self.root, model_only=model_only)
        return [Committed(str(f), n, n, model_only, f) for n, f in sorted(found.items())]

    def _newest(self, ref: Committed | None, model_only: bool) -> Path:
        from fastckpt.errors import MissingStateError

        if ref is None:
            found = self.list(model_only=model_only)
            if not found:
                what = "model-only snapshot" if model_only else "committed checkpoint"
                raise MissingStateError(f"{self.location}: the {self.tier} tier holds no {what}")
            ref = found[-1]
        return Path(ref.location)

    @contextlib.contextmanager
    def open(self, ref: Committed | None = None, *, model_only: bool = False, verify: bool = True,
             threads: int = 0) -> Iterator[CheckpointView]:
        """A pinned view of ``ref`` (None: the newest of its kind); every byte read through it is checked when
        ``verify``.

        Raises:
            MissingStateError: nothing committed. HeaderError: a malformed manifest.
        """
        folder = self._newest(ref, model_only)
        with pinned(folder, verify=verify, threads=threads, defer=True) as handle:
            yield CheckpointView(str(folder), handle, folder, read_manifest(handle), tier=self.tier)

    @contextlib.contextmanager
    def as_local(self, ref: Committed | None = None, *, model_only: bool = False) -> Iterator[CheckpointView]:
        """The folder of ``ref`` (None: the newest of its kind) itself, unpinned and unchecked.

        Raises:
            MissingStateError: nothing committed.
        """
        folder = self._newest(ref, model_only)
        yield CheckpointView(str(folder), folder, folder, tier=self.tier)

    def open_shared(self, *, model_only: bool = False, timeout: float = 0.0,
                    what: str = "") -> contextlib.AbstractContextManager[CheckpointView]:
        """:meth:`open` of the newest: a memory tier belongs to one process, there is nothing to share."""
        return self.open(model_only=model_only)

    def remove(self, ref: Committed) -> None:
        """Remove one committed checkpoint (renamed away first, so it stops counting at once)."""
        remove_folders([Path(ref.location)])

    def rotate(self, total_limit: int, *, model_only: bool = False) -> list[str]:
        """Keep the newest ``total_limit`` committed checkpoints of one kind (and held ones); returns the removed
        locations.

        Raises:
            ValueError: ``total_limit`` < 1.
        """
        if total_limit < 1:
            raise ValueError(f"total_limit must be >= 1, got {total_limit}")
        with self._lock:
            numbers = checkpoint_numbers(self.root, model_only=model_only)
            keep = set(sorted(numbers)[-total_limit:]) | (set() if model_only else set(self._held))
            gone = [f for n, f in numbers.items() if n not in keep]
            remove_folders(gone)
        return [str(f) for f in gone]

    def hold(self, step: int) -> None:
        """Keep ``checkpoint_{step}`` through later commits until :meth:`release` (a copy reads it)."""
        with self._lock:
            self._held[step] = self._held.get(step, 0) + 1

    def release(self, step: int) -> None:
        """Undo one :meth:`hold`; the next commit may remove it."""
        with self._lock:
            if self._held.get(step, 0) <= 1:
                self._held.pop(step, None)
            else:
                self._held[step] -= 1

    def prune(self, *, keep: int | None = None, model_only: bool = False) -> None:
        """Remove committed checkpoints of one kind but the newest ``self.keep`` (and ``keep``, and held ones)."""
        with self._lock:
            numbers = checkpoint_numbers(self.root, model_only=model_only)
            newest = set(sorted(numbers)[-self.keep:]) | ({keep} if keep is not None else set()) | set(self._held)
            self._remove_later([f for n, f in numbers.items() if n not in newest])

    def _remove_later(self, folders: list[Path]) -> None:
        """Rename each folder to an owned trash name now (it stops counting at once), free its pages in a thread
        (the unlinks were a sixth of a manager's save in ``step()``); call with ``self._lock`` held."""
        owners: list[OwnedPath] = []
        try:
            for folder in folders:
                owners.append(OwnedPath(folder.parent, folder.name, "trash"))
                os.rename(folder, owners[-1].path)
        except BaseException:
            _release_all(owners)
            raise
        if owners:  # cut short by the end of the process: a dead owner's trash, which the next save removes
            thread = threading.Thread(target=_release_all, args=(owners,), name="fastckpt-memory-prune", daemon=True)
            thread.start()
            self._reapers = [t for t in self._reapers if t.is_alive()] + [thread]

    def drain(self) -> None:
        """Wait until the checkpoints :meth:`prune` removed are gone from memory."""
        with self._lock:
            reapers, self._reapers = self._reapers, []
        for thread in reapers:
            thread.join()

    def clear(self) -> None:
        """Remove what the tier wrote: its checkpoints and their leftovers in ``{root}/checkpoints``, the replicas it
        holds for other ranks (``{root}/replicas/rank{r}``, tiers of this same layout), then each of these folders
        and ``root`` itself once empty. Nothing else is touched: ``root`` may be a folder the user named
        (``memory="/scratch/me"``) holding files of its own."""
        self.drain()
        replicas = self.root / REPLICAS_DIR
        tiers = [self.root]
        if replicas.is_dir() and not replicas.is_symlink():
            tiers += [p for p in replicas.iterdir() if _RANK.match(p.name) and p.is_dir() and not p.is_symlink()]
        for root in reversed(tiers):
            folder = root / CHECKPOINTS_DIR
            if folder.is_dir() and not folder.is_symlink():
                for entry in folder.iterdir():
                    if _OWN.match(entry.name):
                        _remove_entry(entry)
            _rmdir(folder)
            if root is not self.root:
                _rmdir(root)
        _rmdir(replicas)
        _rmdir(self.root)


#: owner files this process holds (:meth:`MemoryTier.claim`): path -> the locked descriptor
_claims: dict[Path, int] = {}
_claims_lock = threading.Lock()

#: what a tier writes in its ``checkpoints`` folder: ``checkpoint_{n}`` and the staging / trash names around it
_OWN = re.compile(r"^(checkpoint_\d+|\.checkpoint_\d+\.fastckpt-(staging|trash)-\d+-[0-9a-f]{8}.*)$")
#: the replicas a tier holds for other ranks (``fastckpt._io.storage.peer``: ``{root}/replicas/rank{r}``)
REPLICAS_DIR = "replicas"
_RANK = re.compile(r"^rank\d+$")


def _release_all(owners: list[OwnedPath]) -> None:
    for owner in owners:
        with contextlib.suppress(OSError):  # what is left is a dead owner's trash for the next cleanup
            owner.release()


def _rmdir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (files of someone else's), or gone already
        path.rmdir()


def _remove_entry(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def copy_files(src: Path, dst: Path, *, durable: bool) -> dict[str, int]:
    """Copy the files a committed checkpoint's manifest lists from ``src`` into the existing folder ``dst``, the
    manifest last (each fsynced when ``durable``); returns ``{file name: bytes}``."""
    manifest = read_manifest(src)
    names = [n for n in manifest.get("files", {}) if n != MANIFEST]
    sizes: dict[str, int] = {}
    for name in [*names, MANIFEST]:
        sizes[name] = _copy_one(src / name, dst / name, durable)
    if durable:
        fsync_dir(dst)
    return sizes


def _copy_one(src: Path, dst: Path, durable: bool) -> int:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        done = 0
        try:  # copy_file_range: in the kernel, no trip through this process's memory
            while done < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done)
                if n == 0:
                    break
                done += n
        except OSError as exc:  # tmpfs to another file system (EXDEV before Linux 5.19), or not supported
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
        if done != size:
            fin.seek(done)
            fout.seek(done)
            shutil.copyfileobj(fin, fout, 16 << 20)
        if durable:
            fout.flush()
            os.fsync(fout.fileno())
    return size


def copy_committed(src: Path, target: Path, *, durable: bool = True) -> Path:
    """Commit a copy of the committed checkpoint ``src`` at ``target`` (a staging folder beside it, the manifest
    last, fsynced when ``durable``, put in place in one rename): the durable tier made from a memory-tier copy.

    Raises:
        OSError: a file cannot be read or written (names it); nothing is committed at ``target``.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(target.parent)
    with OwnedPath(target.parent, target.name) as owner:
        owner.path.mkdir()
        copy_files(src, owner.path, durable=durable)
        _core.commit_dir(str(owner.path), str(target), durable=durable)
    return target

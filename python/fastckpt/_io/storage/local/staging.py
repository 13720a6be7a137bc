"""Temporary folders beside a checkpoint that carry their owner, and cleanup of what dead saves left behind.

A save builds its checkpoint in a *staging* folder ``.{name}.fastckpt-staging-{pid}-{token}`` beside the target; a
rotation renames a checkpoint it removes to ``.{name}.fastckpt-trash-{pid}-{token}`` first (so a half-removed
checkpoint never looks committed). Each such path has an owner: a lock file ``{path}.lock`` beside it, created
before the path and held with ``flock(LOCK_EX)`` by the owning process until the path is gone. The kernel drops
the lock when the owner dies, however it dies (SIGKILL included), so:

- a path whose lock can be taken belongs to a dead process: :func:`clean_leftovers` removes it (the next save into
  the same parent calls it);
- a path whose lock is held belongs to a live save and is never touched;
- loaders never look at these names (they start with ``.``; ``latest_checkpoint`` matches ``checkpoint_N`` only).

A commit on a file system without ``RENAME_EXCHANGE`` parks the old checkpoint at ``{staging}.old.{pid}`` for a
moment; if its owner died there and the target is missing, the cleanup puts the old checkpoint back.
Leftovers of another user that this process may not remove are left alone (best effort, never an error).

Names stay within ``NAME_MAX`` (255 bytes): a target name longer than 180 bytes appears shortened, with a hash of the
whole name (:func:`short_name`); the lock file records the real target name. A save does not list a parent folder
it listed before and that nobody changed since (its modification time is remembered), so saving next to tens of
thousands of other files costs no listing per save.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import stat
import threading
from pathlib import Path

from fastckpt.errors import DestinationNotWritableError

__all__ = ["OwnedPath", "clean_leftovers", "leftovers", "short_name"]

_MAX_TARGET_BYTES = 180  # + ".fastckpt-staging-{pid}-{token}.old.{pid}.lock" stays under NAME_MAX = 255
_scanned: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) of a parent -> st_mtime_ns after our last look
_scanned_lock = threading.Lock()


def short_name(name: str) -> str:
    """``name``, or for one over 180 bytes (UTF-8) its first bytes + ``~`` + 16 hex digits of its sha256, so every
    temporary name built from it fits ``NAME_MAX``."""
    raw = os.fsencode(name)
    if len(raw) <= _MAX_TARGET_BYTES:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    return os.fsdecode(raw[:_MAX_TARGET_BYTES - 17]).encode("utf-8", "ignore").decode("utf-8", "ignore") + "~" + digest


def remember_scanned(parent: Path) -> None:
    """Record ``parent``'s modification time as seen by this process (after our own changes to it), so the next
    :func:`clean_leftovers` skips listing it unless someone else changed it."""
    try:
        st = os.stat(parent)
    except OSError:
        return
    with _scanned_lock:
        _scanned[(st.st_dev, st.st_ino)] = st.st_mtime_ns

_NAME_RE = re.compile(
    r"^\.(?P<target>.+)\.fastckpt-(?P<kind>staging|trash)-(?P<pid>\d+)-(?P<token>[0-9a-f]{8})"
    r"(?P<parked>\.old\.\d+)?(?P<lock>\.lock)?$"
)


class OwnedPath:
    """A fresh temporary path ``parent/.{target_name}.fastckpt-{kind}-{pid}-{token}`` owned by this process.

    The lock file is created and locked here; the path itself is not created (the caller makes a folder there, or
    renames something to it). :meth:`release` removes whatever is at the path, then the lock.

    Raises:
        DestinationNotWritableError: the lock file cannot be created (read-only or full file system, no permission;
            also the builtin OSError subclass of its errno), naming ``parent/target_name``.
    """

    def __init__(self, parent: Path, target_name: str, kind: str = "staging") -> None:
        if kind not in ("staging", "trash"):
            raise ValueError(f"kind must be 'staging' or 'trash', got {kind!r}")
        while True:
            self.path = parent / f".{short_name(target_name)}.fastckpt-{kind}-{os.getpid()}-{secrets.token_hex(4)}"
            self.lock_path = parent / (self.path.name + ".lock")
            try:
                fd = os.open(self.lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                continue
            except OSError as exc:  # name what the caller writes, not fastckpt's hidden lock file (e.g. /proc/x)
                raise _unwritable(exc, parent, target_name) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.write(fd, f"{os.getpid()}\n".encode() + os.fsencode(target_name) + b"\n")
                # A cleaner may have taken the fresh file for a dead owner's and unlinked it: start again.
                if os.stat(self.lock_path).st_ino != os.fstat(fd).st_ino:
                    raise FileNotFoundError(self.lock_path)
            except (BlockingIOError, FileNotFoundError):
                os.close(fd)
                continue
            except OSError as exc:  # a full disk: name the target
                os.close(fd)
                _unlink(self.lock_path)
                raise _unwritable(exc, parent, target_name) from None
            except BaseException:
                os.close(fd)
                _unlink(self.lock_path)
                raise
            self._fd: int | None = fd
            return

    def release(self) -> None:
        """Remove whatever is at the path (and a parked old tree), then the lock file. Idempotent."""
        if self._fd is None:
            return
        try:
            _remove(self.path)
            _remove(self.path.with_name(f"{self.path.name}.old.{os.getpid()}"))  # the commit's parking name
            _unlink(self.lock_path)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OwnedPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _unwritable(exc: OSError, parent: Path, target_name: str) -> OSError:
    """``exc`` (an OSError creating the owner's lock file in ``parent``) as a
    :class:`~fastckpt.errors.DestinationNotWritableError` of its errno (also its builtin class), naming the path the
    caller writes (``parent/target_name``, the folder the user gave) instead of the hidden lock file."""
    target = parent / target_name
    return DestinationNotWritableError.of(exc.errno, f"cannot write {target}: its folder {parent} does not take new "
                                                     f"files ({exc.strerror or exc})", str(target))


def glob_escape(name: str) -> str:
    """``name`` with glob's special characters escaped."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _writable(path: Path) -> None:
    """Give the folder ``path`` and the folders in it owner write and search permission, so that a tree whose
    folders are read-only (a staging folder that took a 0555 checkpoint's mode) can be removed."""
    for root, dirs, _files in os.walk(path):
        for d in [root, *(os.path.join(root, n) for n in dirs)]:
            try:
                st = os.lstat(d)
                if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o700 != 0o700:
                    os.chmod(d, st.st_mode | 0o700)
            except OSError:
                pass  # not ours: rmtree reports it


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            try:
                shutil.rmtree(path)
            except PermissionError:
                _writable(path)
                shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(parent: Path) -> dict[str, list[str]]:
    """The owned temporary entries in ``parent``: ``{base name: [entry names]}`` (locks and parked trees included)."""
    groups: dict[str, list[str]] = {}
    try:
        names = os.listdir(parent)
    except OSError:
        return groups
    for name in names:
        m = _NAME_RE.match(name)
        if m:
            base = name[: m.start("parked")] if m.group("parked") else name[: m.start("lock")] if m.group("lock") else name
            groups.setdefault(base, []).append(name)
    return groups


def _owner_is_dead(lock: Path, pid: int) -> tuple[bool, int | None]:
    """``(dead, fd)``: whether the owner of ``lock`` is dead, and then the lock's fd, held by us (None when there
    is no lock file: a leftover of a save that kept none, judged by whether process ``pid`` still runs)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return not _pid_alive(pid), None
    except OSError:
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False, None
        return not _pid_alive(pid), None  # no flock on this file system: go by the pid
    return True, fd


def _unchanged_since_scan(parent: Path) -> bool:
    try:
        st = os.stat(parent)
    except OSError:
        return False
    with _scanned_lock:
        return _scanned.get((st.st_dev, st.st_ino)) == st.st_mtime_ns


def _target_name(lock: Path, fallback: str) -> str:
    """The real target name recorded in a lock file (its second line), else ``fallback``."""
    try:
        lines = lock.read_bytes().split(b"\n")
    except OSError:
        return fallback
    return os.fsdecode(lines[1]) if len(lines) > 2 and lines[1] else fallback


def clean_leftovers(parent: Path) -> list[Path]:
    """Remove what dead saves and rotations left in ``parent`` (see the module docs); returns the removed paths.

    Entries of live owners are never touched; entries that cannot be removed (another user's) are skipped. A
    parent this process listed before and that nobody changed since is not listed again.
    """
    removed: list[Path] = []
    if _unchanged_since_scan(parent):
        return removed
    for base, names in leftovers(parent).items():
        m = _NAME_RE.match(base)
        assert m is not None
        dead, fd = _owner_is_dead(parent / (base + ".lock"), int(m.group("pid")))
        if not dead:
            continue
        try:
            target = parent / _target_name(parent / (base + ".lock"), m.group("target"))
            for name in sorted(names, key=lambda n: n.endswith(".lock")):
                path = parent / name
                if name.endswith(".lock"):
                    _unlink(path)
                elif ".old." in name[len(base):] and not os.path.lexists(target):
                    os.rename(path, target)  # a commit without RENAME_EXCHANGE died with the old tree aside
                    continue
                else:
                    _remove(path)
                removed.append(path)
        except OSError:
            pass
        finally:
            if fd is not None:
                os.close(fd)
    return removed

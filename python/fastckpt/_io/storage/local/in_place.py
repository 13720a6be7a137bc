"""Committing a checkpoint inside its own folder, for targets that cannot be replaced whole.

The usual commit (:mod:`fastckpt._io.storage.local.commit`) stages beside the target and renames the staging folder over it. That
cannot work when the target is a mount point (a container volume: ``rename`` fails with EBUSY, and staging on the
parent's file system then fails with EXDEV), when the parent folder is not writable (no staging folder, no lock
file can be made there), and it is slow when the target holds many files of the user's (each is hard-linked over).
:func:`in_place_reason` detects these *before anything is written*; :func:`commit_in_place` then:

1. takes ``{target}/.fastckpt.lock`` (``flock``; concurrent in-place saves to one folder take turns);
2. removes a ``{target}/.fastckpt-staging`` left by a dead save, writes every file into a fresh one (fsynced);
3. removes the old manifest (the folder stops counting as committed; fsynced), renames each new file into place,
   removes the old checkpoint's files the new one does not have, renames the manifest in last, fsyncs the folder.

Crash safety: before step 3 the previous checkpoint is intact; during step 3 the folder has no manifest, so it is
never loaded as a mix (a load says the save did not finish) and the previous checkpoint is lost, as with any
in-place overwrite; after it the new one is complete. Readers racing the renames are caught by the save id every
file carries (:mod:`fastckpt._io.storage.local.folder`). The manifest records ``"commit": "in_place"``, so later saves to the folder
commit in place without looking at the user's files again.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from fastckpt._format.json_input import load_json
from fastckpt._io.storage.local.layout import IN_PLACE_STAGING, MANIFEST
from fastckpt.errors import DestinationNotWritableError

__all__ = ["STAGING_NAME", "LOCK_NAME", "check_in_place", "in_place_reason", "commit_in_place", "is_mount_point"]

STAGING_NAME = IN_PLACE_STAGING
LOCK_NAME = ".fastckpt.lock"


def _mount_points() -> set[str]:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    points = set()
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:  # field 5 is the mount point, with spaces etc. as octal escapes
            points.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    return points


def is_mount_point(folder: Path) -> bool:
    """Whether ``folder`` is a mount point: another file system than its parent, or a bind mount
    (``/proc/self/mountinfo``)."""
    try:
        if os.stat(folder).st_dev != os.stat(folder.parent).st_dev:
            return True
    except OSError:
        return False
    return os.path.realpath(folder) in _mount_points()


def _old_manifest(target: Path) -> dict[str, Any]:
    try:
        data = load_json((target / MANIFEST).read_text(encoding="utf-8"), f"{target / MANIFEST}", object)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def in_place_reason(target: Path) -> str | None:
    """Why ``target`` must be committed inside itself, or None for the usual commit beside it.

    Only an existing folder is ever committed in place: a mount point, a folder whose parent this process cannot
    write, or one whose manifest says it was committed in place before.
    """
    if not target.is_dir():
        return None
    if is_mount_point(target):
        return "it is a mount point"
    if not os.access(target.parent, os.W_OK | os.X_OK):
        return f"its parent {target.parent} is not writable"
    if _old_manifest(target).get("commit") == "in_place":
        return "it was committed in place before"
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_lock(target: Path) -> int:
    """Open (create) ``{target}/.fastckpt.lock``, unlocked.

    Raises:
        DestinationNotWritableError: a read-only or full file system, no permission: naming the folder the caller
            saves to (also the builtin OSError subclass of the errno), not fastckpt's hidden lock file.
    """
    try:
        return os.open(target / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise DestinationNotWritableError.of(exc.errno, f"cannot save into {target}: it does not take new "
                                                        f"files ({exc.strerror or exc})", str(target)) from None


def check_in_place(target: Path) -> None:
    """Raise what :func:`commit_in_place` raises before its first byte when ``target`` takes no files (its lock file
    cannot be made), without taking the lock (which waits for another in-place save); leaves nothing behind.

    Raises:
        DestinationNotWritableError: see :func:`_open_lock`.
    """
    existed = os.path.lexists(target / LOCK_NAME)
    fd = _open_lock(target)
    try:
        if not existed:  # ours: removed as an in-place save's unlock does, holding the lock (never another's)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(target / LOCK_NAME)
    except OSError:
        pass  # another save holds it: it removes it
    finally:
        os.close(fd)


def _lock(target: Path) -> int:
    """Open and ``flock`` ``{target}/.fastckpt.lock`` (waits for another in-place save of the folder)."""
    path = target / LOCK_NAME
    while True:
        fd = _open_lock(target)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:  # not unlinked by the previous holder meanwhile
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _unlock(target: Path, fd: int) -> None:
    try:
        os.unlink(target / LOCK_NAME)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def commit_in_place(target: Path, reason: str, write: Callable[[Path, dict[str, Any]], dict[str, int]], *,
                    durable: bool) -> None:
    """Commit a checkpoint inside ``target`` itself (see the module docs).

    Args:
        write: ``write(staging_folder, manifest_facts) -> {file name: bytes}`` writes every file of the
            checkpoint into the staging folder, the manifest (with those facts) last.

    Raises:
        OSError: a file cannot be written; before the renames began the previous checkpoint is intact and the
            staging folder is removed.
    """
    fd = _lock(target)
    staging = target / STAGING_NAME
    try:
        shutil.rmtree(staging, ignore_errors=True)  # a dead in-place save's (we hold the lock)
        old = _old_manifest(target)
        staging.mkdir()
        try:
            files = write(staging, {"commit": "in_place", "in_place_reason": reason})
            if durable:
                _fsync_dir(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        try:
            os.unlink(target / MANIFEST)
        except FileNotFoundError:
            pass
        if durable:
            _fsync_dir(target)
        for name in files:
            os.replace(staging / name, target / name)
        stale = set(old.get("files", {}) if isinstance(old.get("files"), dict) else {}) - set(files) - {MANIFEST}
        for name in stale:
            if "/" not in name and not name.startswith("."):
                try:
                    os.unlink(target / name)
                except (FileNotFoundError, IsADirectoryError):
                    pass
        os.replace(staging / MANIFEST, target / MANIFEST)
        os.rmdir(staging)
        if durable:
            _fsync_dir(target)
    finally:
        _unlock(target, fd)

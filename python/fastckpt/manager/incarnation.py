"""Which incarnation of a project folder a memory-tier snapshot belongs to.

A project deleted and made again at the same path (``rm -rf run``, then a fresh run with the same ``project_dir``
and job id) finds the old run's snapshots in ``/dev/shm`` under the same job name: the path alone cannot tell
them apart. The first :class:`~fastckpt.CheckpointManager` of a project folder writes a random id into it once
(``{project_dir}/.fastckpt-project-id``, 32 hex digits, created with a hard link so two processes racing agree
on one); every memory-tier snapshot records it (manifest ``"project_id"``, copied with the snapshot into peer
replicas), and a restore skips a snapshot whose id differs, with a warning naming both
(:func:`fastckpt.manager.restore.foreign`). Deleting the folder deletes the id, so the next run gets a new one.

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

from fastckpt.errors import CheckpointError, DestinationNotWritableError

__all__ = ["ID_FILE", "missing_folders", "project_id", "undo_made"]

#: the file holding the project's incarnation id, in the project folder
ID_FILE = ".fastckpt-project-id"
_ID = re.compile(r"^[0-9a-f]{32}$")


def missing_folders(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, innermost first (what a ``mkdir(parents=True)`` makes)."""
    return [p for p in (path, *path.parents) if not p.exists()]


def project_id(project: Path) -> tuple[str, list[Path]]:
    """The incarnation id of ``project`` (the folder made, the id file written, when missing).

    Returns:
        ``(id, made)``: the id (32 hex digits) and what this call created (folders innermost first, then the id
        file; :func:`undo_made` removes them).

    Raises:
        DestinationNotWritableError: the folder or the file cannot be written (names it; also the builtin OSError
            subclass of its errno). CheckpointError: the id file holds something
            else than an id (names it; remove it).
    """
    made = missing_folders(project)
    try:
        project.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # /proc/x, a read-only parent: name the project_dir and the folder that failed
        raise DestinationNotWritableError.of(
            exc.errno, f"cannot make the project folder {project} ({exc.filename or project}: "
                       f"{exc.strerror or exc}); the CheckpointManager's project_dir must be writable",
            str(project)) from None
    path = project / ID_FILE
    if not path.exists():
        tmp = project / f".{ID_FILE}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, (secrets.token_hex(16) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # never over an id another process wrote meanwhile
                made.append(path)
            except FileExistsError:
                pass
        except OSError as exc:  # name the project's file, not the temporary one
            raise DestinationNotWritableError.of(exc.errno, f"cannot write the project id {path} "
                                                            f"({exc.strerror or exc}); the CheckpointManager's "
                                                            "project_dir must be writable", str(path)) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    text = path.read_text(encoding="ascii", errors="replace").strip()
    if not _ID.match(text):
        raise CheckpointError(f"{path}: holds {text[:40]!r}, not a fastckpt project id (32 hex digits); remove the "
                              "file (a new id is written, and memory-tier snapshots of the project are not restored)")
    return text, made


def undo_made(made: list[Path]) -> None:
    """Remove what :func:`project_id` (or another ``mkdir``) made: files, then folders left empty."""
    for p in reversed(sorted(made, key=lambda q: len(q.parts))):
        with contextlib.suppress(OSError):
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
            else:
                p.unlink()

"""The demo's file helpers: durable flush of a folder, dropping its pages from the cache, its size."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

__all__ = ["fsync_tree", "drop_page_cache", "dir_bytes"]


def _files(path: pathlib.Path) -> Iterator[pathlib.Path]:
    return (p for p in sorted(path.rglob("*")) if p.is_file())


def fsync_tree(path: pathlib.Path) -> None:
    """fsync every file under ``path`` and every folder (what a durable save guarantees)."""
    for p in [*_files(path), *(d for d in sorted(path.rglob("*")) if d.is_dir()), path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_page_cache(path: pathlib.Path) -> None:
    """Ask the kernel to forget the (clean, fsynced) pages of every file under ``path``, so a load reads the disk."""
    if not hasattr(os, "posix_fadvise"):
        return
    for p in _files(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dir_bytes(path: pathlib.Path) -> int:
    """Total size in bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in _files(path))

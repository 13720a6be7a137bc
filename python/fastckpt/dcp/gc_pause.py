"""Pausing Python's cyclic garbage collector while the coordinator merges every rank's plan.

At thousands of ranks the coordinator holds millions of small plan objects (``WriteItem``, ``MetadataIndex``,
``ChunkStorageMetadata``), and the automatic collector's full passes over all of them cost as much as the merge
itself (measured: 3.9 s -> 2.2 s of CPU for the global plan and ``finish`` at 4096 synthetic ranks). The merge makes
no reference cycles worth collecting, so :func:`gc_paused` turns the automatic collector off for its duration and
back on after (when it was on, and when no other thread still holds a pause); nothing is collected by hand.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]

_lock = threading.Lock()
_holders = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the automatic garbage collector off (re-entrant and thread-safe)."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()

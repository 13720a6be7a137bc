"""Cancelling an async save before its commit, and Ctrl-C during ``AsyncSave.wait()``.

A Ctrl-C that interrupts ``wait()`` raises ``KeyboardInterrupt`` at once, but the save goes on: its writer thread
is not a daemon, so the interpreter commits it before it exits (a save the user asked for is not thrown away by
one keystroke). The first Ctrl-C says so on stderr and arms a second: a Ctrl-C while that save is still in flight
cancels it (:meth:`CancelToken.cancel`): the writer stops before its commit, nothing is committed and the
previous checkpoint stays; then the Ctrl-C goes on as it would have (``KeyboardInterrupt``).

A save whose commit has begun (manifest written, folder being renamed into place) can no longer be cancelled; it
completes.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastckpt.errors import SaveCancelledError

__all__ = ["CancelToken", "arm_second_interrupt"]


class CancelToken:
    """Whether a save was cancelled; the writer checks it once, just before its commit.

    Args:
        target: the checkpoint folder (for messages).
    """

    def __init__(self, target: Path | str) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._cancelled = False
        self._committing = False

    def cancel(self) -> bool:
        """Cancel the save unless its commit has begun; True when it will commit nothing."""
        with self._lock:
            if not self._committing:
                self._cancelled = True
            return self._cancelled

    def check(self) -> None:
        """Writer thread, right before the commit: raise :class:`SaveCancelledError` if cancelled, else mark the
        commit begun (a later :meth:`cancel` returns False)."""
        with self._lock:
            if self._cancelled:
                raise SaveCancelledError(f"async save to {self.target} was cancelled before its commit: nothing was "
                                         f"committed; the previous checkpoint at {self.target} (if any) is intact")
            self._committing = True

    def before_commit(self, first: Callable[..., Any] | None = None) -> Callable[..., None]:
        """A ``before_commit`` hook for :func:`fastckpt._io.storage.local.commit.write_checkpoint`: ``first(checksums)`` (the
        save's own checks, if any), then :meth:`check`."""
        def hook(checksums: Any = None) -> None:
            if first is not None:
                first(checksums)
            self.check()
        return hook


_armed: list[Any] = []  # handles a second Ctrl-C cancels
_previous: Any = None


def _second_interrupt(signum: int, frame: Any) -> None:
    global _previous
    pending = [h for h in _armed if not h.done()]
    _armed.clear()
    previous, _previous = _previous, None
    signal.signal(signal.SIGINT, previous)
    cancelled = [h for h in pending if h.cancel()]
    if cancelled:
        sys.stderr.write("fastckpt: second Ctrl-C: cancelled the async save(s) to "
                         f"{', '.join(str(h.path) for h in cancelled)}; nothing will be committed\n")
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        raise KeyboardInterrupt


def arm_second_interrupt(handle: Any) -> str:
    """After a Ctrl-C interrupted ``handle.wait()``: make the next Ctrl-C cancel the save (main thread only; the
    handler is removed once it ran). Returns the note to attach to the ``KeyboardInterrupt``."""
    global _previous
    note = (f"fastckpt: the async save to {handle.path} goes on and is committed before the interpreter exits; "
            "press Ctrl-C again to cancel it (nothing is committed, the previous checkpoint stays)")
    if threading.current_thread() is not threading.main_thread():
        return note
    if signal.getsignal(signal.SIGINT) is not _second_interrupt:
        _previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, _second_interrupt)
    _armed.append(handle)
    sys.stderr.write(note + "\n")
    return note

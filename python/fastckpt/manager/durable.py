"""The durable tier, made in the background from the memory-tier copy (the main process's, or the only one's).

At each save the manager commits the step in the memory tier and hands it here: a thread copies that folder to
``{project_dir}/checkpoints/checkpoint_{step}`` (file copies in the kernel, each fsynced, the manifest last, one
rename: :func:`fastckpt._io.storage.memory.copy_committed`), rotates to ``keep``, and with ``remote=`` uploads
it (the tiered upload of :func:`fastckpt.save_state`'s ``remote=``) before taking the next. A save handed in while
one is copied waits in a one-slot queue; a newer one supersedes it (its memory-tier folder is released). A failure
is kept and raised by the next :meth:`DurableWriter.check` (the manager's next ``step()`` or ``close()``), or
printed on stderr at interpreter exit when nobody asked.

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fastckpt._io.storage.local.layout import CHECKPOINTS_DIR
from fastckpt._io.storage.local.numbering import rotate_checkpoints
from fastckpt._io.storage.memory import MemoryTier, copy_committed

__all__ = ["DurableWriter"]

logger = logging.getLogger("fastckpt")
_unreported: list[DurableWriter] = []


class DurableWriter:
    """Copies memory-tier checkpoints to the durable tier, one at a time, in a thread (see the module docs)."""

    def __init__(self, memory: MemoryTier, project: Path, *, keep: int | None, remote: Any,
                 storage_options: Any) -> None:
        self.memory = memory
        self.project = project
        self.keep = keep
        self.remote = remote
        self.storage_options = storage_options
        self._cond = threading.Condition()
        self._pending: int | None = None  # the step waiting to be copied
        self._running: int | None = None  # the step being copied
        self._thread: threading.Thread | None = None
        self.done: int | None = None  # the newest step committed durably
        self.done_at: float | None = None
        self._error: BaseException | None = None
        self.errors_seen: list[BaseException] = []

    def target(self, step: int) -> Path:
        """The durable folder of ``step``."""
        return self.project / CHECKPOINTS_DIR / f"checkpoint_{step}"

    @property
    def busy(self) -> bool:
        """A copy is running or waiting."""
        with self._cond:
            return self._pending is not None or self._running is not None

    def submit(self, step: int) -> None:
        """Make ``step`` (committed in the memory tier) durable in the background; supersedes a waiting one."""
        with self._cond:
            self.memory.hold(step)
            if self._pending is not None:
                self.memory.release(self._pending)
            self._pending = step
            if self._thread is None:  # not a daemon: a normal exit finishes the copy in flight
                self._thread = threading.Thread(target=self._run, name="fastckpt-durable-tier")
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._pending is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
                step, self._pending = self._pending, None
                self._running = step
            try:
                self._copy(step)
            except BaseException as exc:  # kept for check(); printed at exit if nobody asks
                with self._cond:
                    self._error = exc
                    if self not in _unreported:
                        _unreported.append(self)
            finally:
                self.memory.release(step)
                self.memory.prune()  # the older snapshot it held goes now that a newer one is committed
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _copy(self, step: int) -> None:
        started = time.perf_counter()
        src = self.memory.folder / f"checkpoint_{step}"
        target = copy_committed(src, self.target(step), durable=True)
        if self.keep is not None:
            rotate_checkpoints(self.project, self.keep)
        if self.remote is not None:
            from fastckpt._io.storage.tiered.upload import start_tiered

            start_tiered(target, self.remote, project_root=self.project, model_only=False, total_limit=self.keep,
                         storage_options=self.storage_options).wait()
        with self._cond:
            self.done, self.done_at = step, time.monotonic()
        logger.info("CheckpointManager: step %d durable at %s in %.3f s%s", step, target,
                    time.perf_counter() - started, " (uploaded)" if self.remote is not None else "")

    def wait(self, step: int | None = None) -> int | None:
        """Wait until nothing is copied or waiting (``step`` given: until that step or a newer one is durable,
        or the queue is empty); raises a failure not yet raised. Returns the newest durable step."""
        with self._cond:
            while self._pending is not None or self._running is not None:
                if step is not None and self.done is not None and self.done >= step:
                    break
                self._cond.wait()
        self.check()
        return self.done

    def check(self) -> None:
        """Raise the failure of a background copy not yet raised (once), with a note naming it."""
        with self._cond:
            exc, self._error = self._error, None
            if self in _unreported:
                _unreported.remove(self)
        if exc is not None:
            self.errors_seen.append(exc)
            exc.add_note(f"(raised by the CheckpointManager's background durable save to {self.project}; the "
                         f"newest durable step is {self.done})")
            raise exc


@atexit.register
def _report_at_exit() -> None:
    for writer in list(_unreported):
        exc = writer._error
        if exc is not None:
            print(f"fastckpt: a CheckpointManager background save to {writer.project} failed and nobody waited for "
                  f"it: {type(exc).__name__}: {exc}", file=sys.stderr)

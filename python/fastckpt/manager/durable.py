"""The durable tier, made in the background from the memory-tier copy (the main process's, or the only one's).

At each save the manager commits the step in the memory tier and hands it here: a thread copies that folder to
``{project_dir}/checkpoints/checkpoint_{step}`` (file copies in the kernel, each fsynced, the manifest last, one
rename: :func:`fastckpt._io.storage.memory.copy_committed`), rotates to ``keep`` (only after that commit, so a
failed copy leaves the previous durable checkpoint the latest, and every older one kept), and with ``remote=``
uploads it (the tiered upload of :func:`fastckpt.save_state`'s ``remote=``) before taking the next. A save handed in
while one is copied waits in a one-slot queue; a newer one supersedes it (its memory-tier folder is released). The
first failure is kept as a :class:`~fastckpt.errors.DurableSaveError` (naming the step, the folder and the cause)
and raised by the next :meth:`DurableWriter.check` (the manager's next ``step()`` or ``close()``, which tell the
other processes), or, when nobody asked, reported at interpreter exit with exit status 1
(:mod:`fastckpt._io.async_save.exit_report`, as an unwaited async save is).

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from fastckpt._io.async_save.exit_report import watch
from fastckpt._io.storage.local.layout import CHECKPOINTS_DIR
from fastckpt._io.storage.local.numbering import rotate_checkpoints
from fastckpt._io.storage.memory import MemoryTier, copy_committed
from fastckpt.errors import DurableSaveError

__all__ = ["DurableWriter"]

logger = logging.getLogger("fastckpt")
_unreported: list[DurableWriter] = []  # writers holding a failure no check() raised yet
_unreported_lock = threading.Lock()


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
        self._stage = "copy"  # what the copy in flight is doing: "copy", "rotate" (committed), "upload"
        self._error: DurableSaveError | None = None  # the first failure not raised yet
        self.errors_seen: list[BaseException] = []
        watch(_unreported_failures)

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
                thread = threading.Thread(target=self._run, name="fastckpt-durable-tier")
                try:
                    thread.start()
                except BaseException:  # no thread (resources): nothing waits for a copy that never runs
                    self._pending = None
                    self.memory.release(step)
                    raise
                self._thread = thread
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
                try:
                    self._copy(step)
                finally:
                    self.memory.release(step)
                    self.memory.prune()  # the older snapshot it held goes now that a newer one is committed
            except BaseException as exc:  # kept for check(); reported at exit if nobody asks
                self._fail(step, exc)
            finally:  # whatever failed above: wait() must not wait for this copy any more
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _fail(self, step: int, exc: BaseException) -> None:
        cause = f"({type(exc).__name__}: {exc})"
        where = {"copy": f"save of step {step} to {self.target(step)} failed {cause}; nothing was committed there",
                 "rotate": f"rotation to keep={self.keep} after step {step} failed {cause}; {self.target(step)} is "
                           "committed",
                 "upload": f"upload of step {step} to {self.remote} failed {cause}; the local durable copy "
                           f"{self.target(step)} is committed"}[self._stage]
        error = DurableSaveError(f"CheckpointManager: the background durable {where}, and the newest durable step "
                                 f"is {self.done} (the memory tier still holds step {step})")
        error.__cause__ = exc
        error.step = step  # type: ignore[attr-defined]
        with self._cond:
            if self._error is None:  # the first failure is the one to fix; a later one is logged
                self._error = error
            else:
                logger.error("%s", error)
        with _unreported_lock:
            if self not in _unreported:
                _unreported.append(self)

    def write_now(self, plan: Any, step: int, *, threads: int) -> Path:
        """Write ``step`` durably from ``plan`` itself, in this thread, once the copies in flight are done (the
        memory tier had no room for it): committed, rotated and uploaded as a copy is, or the error raised here.

        Raises:
            OSError: the durable tier cannot be written (nothing committed; the previous checkpoint stays).
        """
        from fastckpt._io.storage.local.commit import write_checkpoint

        self.idle()
        with self._cond:  # nothing else runs: the stage names what failed for a copy submitted later
            self._running = step
        try:
            return self._commit(step, lambda target: write_checkpoint(plan, target, durable=True, threads=threads))
        finally:
            with self._cond:
                self._running = None
                self._cond.notify_all()

    def _copy(self, step: int) -> None:
        src = self.memory.folder / f"checkpoint_{step}"
        self._commit(step, lambda target: copy_committed(src, target, durable=True))

    def _commit(self, step: int, write: Any) -> Path:
        started = time.perf_counter()
        self._stage = "copy"
        target = write(self.target(step))
        self._stage = "rotate"  # only now: a failed copy leaves every older checkpoint in place
        if self.keep is not None:
            rotate_checkpoints(self.project, self.keep)
        self._stage = "upload"
        if self.remote is not None:
            from fastckpt._io.storage.tiered.upload import start_tiered

            start_tiered(target, self.remote, project_root=self.project, model_only=False, total_limit=self.keep,
                         storage_options=self.storage_options).wait()
        with self._cond:
            self.done, self.done_at = step, time.monotonic()
        logger.info("CheckpointManager: step %d durable at %s in %.3f s%s", step, target,
                    time.perf_counter() - started, " (uploaded)" if self.remote is not None else "")
        return target

    def wait(self, step: int | None = None) -> int | None:
        """Wait until nothing is copied or waiting (``step`` given: until that step or a newer one is durable,
        or the queue is empty; then an older step's failure is logged, not raised); raises a failure not yet
        raised. Returns the newest durable step.

        Raises:
            DurableSaveError: a copy failed (the first failure not raised yet).
        """
        with self._cond:
            while self._pending is not None or self._running is not None:
                if step is not None and self.done is not None and self.done >= step:
                    break
                self._cond.wait()
            if (step is not None and self._error is not None and self.done is not None and self.done >= step
                    and self._error.step < self.done):  # type: ignore[attr-defined]
                # an older step's failure, superseded by the durable step waited for: said, not raised
                logger.error("%s; superseded: step %d is durable", self._error, self.done)
                self._error = None
        self.check()
        return self.done

    def idle(self) -> None:
        """Wait until nothing is copied or waiting, raising nothing (the failure stays for :meth:`check`)."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending is None and self._running is None)

    def check(self) -> None:
        """Raise the failure of a background copy not yet raised (once).

        Raises:
            DurableSaveError: names the step, the folder and the cause (``__cause__``).
        """
        with self._cond:
            exc, self._error = self._error, None
        with _unreported_lock:
            if self in _unreported:
                _unreported.remove(self)
        if exc is not None:
            self.errors_seen.append(exc)
            raise exc


def _unreported_failures() -> list[tuple[str, BaseException]]:
    """For the exit report: every failure no check() raised, marked reported."""
    with _unreported_lock:
        writers = list(_unreported)
        _unreported.clear()
    out = []
    for writer in writers:
        with writer._cond:
            exc, writer._error = writer._error, None
        if exc is not None:
            out.append((f"a CheckpointManager background durable save to {writer.project}", exc))
    return out

"""The end of a :class:`~fastckpt.CheckpointManager`'s life and its background failures: waiting for the durable
tier, ``close()`` and the context manager, and a failed durable copy made known to every process.

A durable copy runs on the main process only (:mod:`fastckpt.manager.durable`). When it fails, the main process
finds out at its next ``step()`` and, with several processes, proposes a ``failed`` event on the manager's
:class:`~fastckpt.manager.preemption.EventBoard` for the next step boundary (the store key every process already
reads once per step: no new collective); every process raises :class:`~fastckpt.errors.DurableSaveError` at that
same step, so none is left waiting in a training collective for one that raised. ``close()`` carries the outcome
in one store round led by the main process (a process missing is a ``CollectiveTimeoutError`` within
``timeout``), and keeps the memory tier when its newest step is not durable
(a step restored from memory or a peer and newer than the durable tier is copied there like a save's).

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from fastckpt._io.group.distributed import Session
from fastckpt._io.storage.local.numbering import checkpoint_numbers
from fastckpt.errors import DurableSaveError
from fastckpt.manager.preemption import Preempted

__all__ = ["Ending"]

logger = logging.getLogger("fastckpt")


class Ending:
    """:class:`~fastckpt.CheckpointManager`'s ``wait`` / ``close`` / context manager and its failure reporting
    (a base class: the attributes are the manager's)."""

    durable: Any
    replicator: Any
    memory: Any
    signals: Any
    distributed: bool
    rank: int
    timeout: float
    last_saved: int | None
    _handed: int | None
    project: Any
    _failure: DurableSaveError | None
    _closed: bool
    _memory_default: bool

    def _check_background(self) -> None:
        if self.durable is None:
            return
        try:
            self.durable.check()
        except DurableSaveError as exc:
            if not self.distributed:
                raise
            self._failure = self._failure or exc  # proposed on the board: raised by every rank at one step

    def _raise_failure(self, described: str) -> None:
        """Raise the agreed durable failure: rank 0 its own error, the others one naming it."""
        own, self._failure = self._failure, None
        if own is not None:
            raise own
        raise DurableSaveError(f"{described} (on process 0; raised on process {self.rank} at the same step)")

    def _hand_restored(self, tier: str | None, step: int | None) -> None:
        """After a restore from the memory tier or a peer's replica of a step newer than the newest durable
        checkpoint: hand it to the durable tier (in the background, as a save's copy; ``close()`` waits for it),
        so that a crash before the durable copy of a step never loses that step to the next ``close()``."""
        if self.durable is None or tier not in ("memory", "peer") or step is None:
            return
        if step > max(checkpoint_numbers(self.project, full_only=True), default=-1):
            logger.info("CheckpointManager: step %d, restored from the %s tier, is newer than the durable tier; "
                        "copying it there", step, tier)
            self.durable.submit(step)
            self._handed = step

    def wait(self) -> int | None:
        """Wait until the durable tier (and the replicas) caught up; returns the newest durable step (rank 0;
        None elsewhere). Raises a background failure not yet raised."""
        if self.replicator is not None:
            self.replicator.wait()
        return self.durable.wait() if self.durable is not None else self.last_saved

    def close(self, *, clear_memory: bool = True) -> None:
        """Wait for the durable tier and the replicas, raise a failure not yet raised, and put the previous signal
        handlers back. ``clear_memory``: remove this rank's memory tier (default True: a run that ended leaves
        ``/dev/shm`` empty; a preemption or an exception inside ``with`` keeps it for the restart, and so does a
        newest step whose durable copy failed). With several processes every one must call it (one store round).

        Raises:
            DurableSaveError: a background durable copy failed and was not raised yet, on every process (the
                main process's names the cause). CollectiveTimeoutError: another process did not close within
                ``timeout``.
        """
        if self._closed:
            return
        self._closed = True
        try:  # the handler stays until the durable copy is made: a signal meanwhile is recorded, not fatal
            durable = self._drain()
        except BaseException:
            if self.memory is not None:  # kept: it holds the newest step, which the durable tier lacks
                self.memory.unclaim()
            raise
        finally:
            self.signals.uninstall()
        if self.memory is not None:
            self.memory.unclaim()
            if not durable and clear_memory:
                logger.warning("CheckpointManager.close(): step %s is not durable (its copy failed); the memory tier "
                               "%s keeps it for restore()", self.last_saved, self.memory.root)
            if clear_memory and durable:
                self.memory.clear()
                if self._memory_default:  # /dev/shm/fastckpt-{job}, once no rank's folder is left in it
                    with contextlib.suppress(OSError):
                        self.memory.root.parent.rmdir()

    def _drain(self) -> bool:
        """:meth:`wait`, and with several processes tell every one whether the durable tier failed (one store
        round led by the main process: a missing process is a ``CollectiveTimeoutError`` within ``timeout``).
        Returns whether the newest saved step is durable (else the memory tiers hold the only copy of it)."""
        failure: DurableSaveError | None = None
        try:
            self.wait()
        except DurableSaveError as exc:
            failure = exc
        failure = self._failure or failure
        self._failure = None

        def outcome() -> tuple[str | None, bool]:
            newest = self.last_saved if self.last_saved is not None else self._handed
            durable = self.durable is None or self.durable.done == newest
            return (None if failure is None else str(failure)), durable

        if self.distributed and self.memory is not None:
            described, durable = Session("CheckpointManager.close", self.timeout).on_main(
                outcome, step="durable tier outcome")
            if failure is None and described is not None:
                raise DurableSaveError(f"{described} (on process 0; raised on process {self.rank} at close())")
        else:
            durable = outcome()[1]
        if failure is not None:
            raise failure
        return durable

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, Preempted):
            return
        if exc_type is not None:  # a crash: keep the memory tier for the restart, do not mask the error
            self._closed = True
            self.signals.uninstall()
            return
        self.close(clear_memory=True)

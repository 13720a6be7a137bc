"""Preemption: a signal handler that only records, and the agreement of every process on the step to save at.

The handler (:class:`SignalRecorder`) does nothing but note the signal and the time (a handler that saved would
run in the middle of a step, with the model half updated); the save happens at the next
:meth:`~fastckpt.CheckpointManager.step` boundary, after ``optimizer.step()``, where the state is consistent.
A second signal while that save runs is recorded too and changes nothing.

With several processes every one must save **the same step**. :class:`EventBoard` agrees on it through the process
group's key-value store, without a collective per step: each process reads one key per step
(``fastckpt/manager/{name}/event/{k}``, a ``check``). A process that saw a signal at its step boundary ``n``
proposes "preempt at ``n + 1``" with a ``compare_set`` on that key (the first proposal wins; every other process,
at most one step apart from it because the gradient all-reduce keeps data-parallel ranks in lockstep, reads it at
step ``n`` or ``n + 1`` and saves there). Time-based saves (``every_seconds``, ``continuous``) are proposed the same
way by the main process. With one process the board is local.

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

__all__ = ["EventBoard", "Preempted", "SignalRecorder"]


class Preempted(SystemExit):
    """Raised by :meth:`fastckpt.CheckpointManager.step` after a preemption signal, once the step reached is
    committed in the durable tier. A ``SystemExit``: uncaught, the process exits with ``code`` (0 unless the
    manager's ``preemption_exit_code`` says otherwise) without a traceback, so schedulers see a clean exit.

    Attributes:
        step: the step that was saved (int).
        signum: the signal that asked for it (int).
        path: the durable checkpoint folder (``pathlib.Path``).
    """

    def __init__(self, code: int, *, step: int, signum: int, path: Any) -> None:
        super().__init__(code)
        self.step = step
        self.signum = signum
        self.path = path

    def __str__(self) -> str:
        return (f"preempted by signal {self.signum}: step {self.step} saved to {self.path}; exiting with code "
                f"{self.code}")


class SignalRecorder:
    """Installs a handler for ``signals`` that records the first signal's number and time (``time.monotonic``)
    and counts the rest; :meth:`uninstall` puts the previous handlers back. Only the main thread can install
    handlers: elsewhere nothing is installed (:attr:`installed` is False) and :meth:`trigger` still works."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = tuple(int(s) for s in signals)
        self.signum: int | None = None
        self.at: float | None = None
        self.count = 0
        self._previous: dict[int, Any] = {}
        self.installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        self.installed = True

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            try:
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, TypeError):  # not the main thread any more (interpreter shutdown)
                pass
        self._previous.clear()
        self.installed = False

    def _handle(self, signum: int, frame: Any) -> None:  # only records: async-signal-safe in Python's sense
        self.trigger(signum)

    def trigger(self, signum: int = signal.SIGTERM) -> None:
        """Record a preemption as if ``signum`` had arrived (from a callback, or a scheduler's notice API)."""
        self.count += 1
        if self.signum is None:
            self.signum = int(signum)
            self.at = time.monotonic()

    @property
    def pending(self) -> bool:
        return self.signum is not None


class EventBoard:
    """The agreed sequence of forced saves (preemption, time-based) of one manager on every process.

    Events are numbered; event ``k`` is ``"{step} {kind}"`` under ``{prefix}/event/{k}``. :meth:`poll` (once per
    step boundary) reads the next event if it exists; :meth:`propose` creates it if nobody did yet and returns the
    one that won. ``store`` None: one process, the board is local.
    """

    def __init__(self, store: Any, prefix: str) -> None:
        self.store = store
        self.prefix = prefix
        self.k = 0
        self.current: tuple[int, str] | None = None
        self.reads = 0

    def _key(self) -> str:
        return f"{self.prefix}/event/{self.k}"

    def poll(self) -> tuple[int, str] | None:
        """The event not yet consumed (``(step, kind)``), reading the store once when none is known."""
        if self.current is None and self.store is not None:
            self.reads += 1
            key = self._key()
            if self.store.check([key]):
                self.current = _parse(self.store.get(key))
        return self.current

    def propose(self, step: int, kind: str) -> tuple[int, str]:
        """Propose event ``(step, kind)`` unless one is pending; returns the pending (winning) event."""
        if self.current is not None:
            return self.current
        if self.store is None:
            self.current = (step, kind)
        else:
            self.current = _parse(self.store.compare_set(self._key(), "", f"{step} {kind}"))
        return self.current

    def consume(self) -> None:
        """The pending event was acted on: the next one is ``k + 1``."""
        self.current = None
        self.k += 1


def _parse(raw: bytes) -> tuple[int, str]:
    step, kind = raw.decode().split(" ", 1)
    return int(step), kind

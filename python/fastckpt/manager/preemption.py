"""Preemption: a signal handler that only records, and the agreement of every process on the step to save at.

The handler (:class:`SignalRecorder`) does nothing but note the signal and the time (a handler that saved would
run in the middle of a step, with the model half updated); the save happens at the next
:meth:`~fastckpt.CheckpointManager.step` boundary, after ``optimizer.step()``, where the state is consistent.
A second signal while that save runs is recorded too and changes nothing, and so is one arriving after it, while
the process exits (:meth:`SignalRecorder.keep_until_exit`).

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

import atexit
import os
import signal
import threading
import time
import weakref
from typing import Any

__all__ = ["EventBoard", "Preempted", "SignalRecorder", "release_kept"]


class Preempted(SystemExit):
    """Raised by :meth:`fastckpt.CheckpointManager.step` after a preemption signal, once the step reached is
    committed in the durable tier. A ``SystemExit``: uncaught, the process exits with ``code`` (0 unless the
    manager's ``preemption_exit_code`` says otherwise) without a traceback, so schedulers see a clean exit.

    The preemption signals stay caught (recorded, so ignored) after it is raised, until the process exits: a second
    SIGTERM while the process exits (torchrun and SLURM often send one more) does not turn exit code 0 into death by
    the signal. A process that catches ``Preempted`` and goes on (a notebook, a sweep running the next trial) keeps
    ignoring them until it makes a new :class:`~fastckpt.CheckpointManager` or calls
    :func:`fastckpt.release_kept`, which puts back the handlers found before the manager (``SIG_DFL``: SIGTERM ends
    the process again).

    Example:
        >>> try:
        ...     train(mgr)                    # mgr.step(n) raises Preempted after a SIGTERM
        ... except fastckpt.Preempted as exc:
        ...     print(exc.path)               # the durable checkpoint of exc.step
        ...     fastckpt.release_kept()       # SIGTERM ends this process again

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
    """Records the first preemption signal's number and time (``time.monotonic``) and counts the rest, once
    :meth:`install` ed; :meth:`uninstall` takes it off. Only the main thread can install handlers: elsewhere
    nothing is installed (:attr:`installed` is False) and :meth:`trigger` still works.

    One process-wide handler (:func:`_dispatch`) serves every installed recorder, so managers chain: the handler
    found before the first one (``SIG_DFL``, the user's own) is put back when the last one is uninstalled, whatever
    the order; a manager collected without ``close()`` is uninstalled by its finalizer, and one collected where no
    handler can be set (another thread) is dropped by the handler itself at the next signal, which then gets the
    treatment it would have had without fastckpt (the previous handler runs; ``SIG_DFL``: the process ends by
    the signal)."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = tuple(int(s) for s in signals)
        self.signum: int | None = None
        self.at: float | None = None
        self.count = 0
        self.installed = False
        self.kept = False  # keep_until_exit(): uninstall() leaves it installed

    def keep_until_exit(self) -> None:
        """A preemption is being handled: stay installed (recording, so ignoring, further signals) until the
        process exits, whatever ends the manager (``close()``, garbage collection), so that a second signal while
        the process exits with the :class:`Preempted` code does not end it by the signal (:func:`release_kept`
        ends that, as does the next manager made)."""
        global _exit_hook
        with _lock:
            self.kept = True
            _kept.append(self)
            if not _exit_hook:
                _exit_hook = True
                atexit.register(_ignore_kept_at_exit)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        release_kept()  # a new manager: the process went on after a Preempted it caught
        with _lock:
            for s in self.signals:
                if signal.getsignal(s) is not _dispatch:
                    _outer[s] = signal.signal(s, _dispatch)
                _live.setdefault(s, []).append(weakref.ref(self))
            self.installed = bool(self.signals)

    def uninstall(self) -> None:
        """Stop recording; the last recorder of a signal puts back the handler found before the first one (left
        to :func:`_dispatch` off the main thread, or when another handler replaced fastckpt's since); a recorder
        kept until exit (:meth:`keep_until_exit`) stays."""
        with _lock:
            if self.kept:
                return
            self.installed = False
            main = threading.current_thread() is threading.main_thread()
            for s in self.signals:
                refs = _live.get(s, [])
                refs[:] = [r for r in refs if r() is not None and r() is not self and r().installed]
                if refs or not main or signal.getsignal(s) is not _dispatch:
                    continue
                try:
                    signal.signal(s, _usable(_outer.pop(s, signal.SIG_DFL)))
                except (ValueError, TypeError):  # interpreter shutdown
                    pass

    def trigger(self, signum: int = signal.SIGTERM) -> None:
        """Record a preemption as if ``signum`` had arrived (from a callback, or a scheduler's notice API)."""
        self.count += 1
        if self.signum is None:
            self.signum = int(signum)
            self.at = time.monotonic()

    @property
    def pending(self) -> bool:
        return self.signum is not None


_lock = threading.RLock()
_outer: dict[int, Any] = {}  # per signal: the handler found when the first recorder was installed
_live: dict[int, list[weakref.ref[SignalRecorder]]] = {}  # per signal: the installed recorders, oldest first
_kept: list[SignalRecorder] = []  # recorders of a preemption being handled: alive and installed until exit
_exit_hook = False  # _ignore_kept_at_exit registered with atexit


def _ignore_kept_at_exit() -> None:
    """At exit, the kept signals are ignored (``SIG_IGN``) rather than recorded: the interpreter's finalization
    puts ``SIG_DFL`` back in place of every Python handler after the ``atexit`` functions ran, so a SIGTERM in that
    last window (torchrun, SLURM and Kubernetes repeat theirs) would end the process by the signal (status 143)
    instead of the :class:`Preempted` code. An ignored handler is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        return
    with _lock:
        for s in {s for recorder in _kept for s in recorder.signals}:
            try:
                signal.signal(s, signal.SIG_IGN)
            except (ValueError, OSError):
                pass


def release_kept() -> None:
    """Uninstall the preemption handlers kept after a :class:`Preempted` (:meth:`SignalRecorder.keep_until_exit`):
    for a process that caught it and goes on. The handlers found before the first manager are put back (the
    default: SIGTERM ends the process). A new :class:`~fastckpt.CheckpointManager` does it too; without a kept
    handler it does nothing.

    Example:
        >>> fastckpt.release_kept()
    """
    with _lock:
        kept = list(_kept)
        _kept.clear()
        for recorder in kept:
            recorder.kept = False
            recorder.uninstall()


def _usable(handler: Any) -> Any:
    return signal.SIG_DFL if handler is None else handler  # None: installed from C; the default is the honest one


def _dispatch(signum: int, frame: Any) -> None:
    """The process's handler while a recorder is installed: every live recorder records the signal (it only
    records: async-signal-safe in Python's sense); with none left (their managers collected off the main thread),
    the handler found before the first one is put back and gets the signal."""
    with _lock:
        live = [r for ref in _live.get(signum, ()) if (r := ref()) is not None and r.installed]
        if not live:
            _live.pop(signum, None)
            outer = _usable(_outer.pop(signum, signal.SIG_DFL))
            signal.signal(signum, outer)
    if live:
        for recorder in live:
            recorder.trigger(signum)
    elif callable(outer):
        outer(signum, frame)
    elif outer == signal.SIG_DFL:
        os.kill(os.getpid(), signum)  # the default action, as if fastckpt had never caught it


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

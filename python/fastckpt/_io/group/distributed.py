"""The few collectives a multi-process save or load needs, with a timeout: none of them waits forever.

They go through the process group's key-value store (``TCPStore``), not through gloo or NCCL collectives, so a
process that died or never called the same function makes the others raise
:class:`~fastckpt.errors.CollectiveTimeoutError` within ``timeout`` seconds, naming the operation, the step and the
processes that did not arrive (a common mistake: calling ``save_state`` on the main process only).

A :class:`Session` is one operation (one save or one load) on every process; its steps are numbered in call order
and each step's keys are ``fastckpt/{operation}/{step}/{rank}``, so every process must make the same calls:

- :meth:`Session.gather`: every rank's small object on rank 0 (RNG states, errors, arguments).
- :meth:`Session.broadcast`: rank 0's object on every rank.
- :meth:`Session.on_main`: run a function on rank 0 only; its outcome, broadcast, is the barrier that ends a save.
- :meth:`Session.agree`: if any rank failed, every rank raises before any object changes.

While a rank waits, or works on something the others wait for (rank 0 writing the checkpoint), it bumps its
``alive`` key with the step it is at, so a long write is waited for, and a dead or absent process is noticed within
``timeout`` by the process that waits for it. A rank that gives up marks the operation
abandoned; the others (and a rank that arrives late) raise at once instead of waiting out their own timeout.
:func:`timeout_group` gives a gloo group whose collectives time out too (for torch.distributed.checkpoint).

With one process (or without an initialised process group) each is the plain local operation.
"""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from fastckpt._io.group.store_wait import KeyWait, borrow_connection, give_back_connection
from fastckpt.errors import CheckpointError, CollectiveTimeoutError

__all__ = ["DEFAULT_TIMEOUT", "is_distributed", "alone", "process_rank", "Session", "timeout_group", "check_timeout",
           "gather_to_main", "broadcast_from_main", "on_main", "agree", "side_group", "broadcast_outcome",
           "describe"]

#: seconds a process waits for the others at any step of a save or load (the ``timeout`` keyword's default)
DEFAULT_TIMEOUT = 300.0
T = TypeVar("T")
_operations = 0  # sessions started by this process: the same sequence on every rank
_stale_keys: list[str] = []  # rank 0's broadcast keys, deleted once every rank has joined a later session
_groups: dict[float, Any] = {}
#: what a process that gave up sets the keys it still waited for to (no pickle starts with it)
_GIVEN_UP = b"fastckpt: given up"


_local = threading.local()  # ``solo``: this thread runs an operation of the main process alone


def is_distributed() -> bool:
    """Whether a process group of more than one process is initialised (False inside :func:`alone`)."""
    if getattr(_local, "solo", False):
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class alone:  # noqa: N801 - used as a context manager, like contextlib's
    """A context in which this thread runs one operation as if it were the only process: no step of it waits
    for the others (the main process saving alone, see :mod:`fastckpt._io.group.participation`)."""

    def __enter__(self) -> alone:
        self._before = getattr(_local, "solo", False)
        _local.solo = True
        return self

    def __exit__(self, *exc: object) -> None:
        _local.solo = self._before


def process_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def check_timeout(timeout: Any) -> float:
    """``timeout`` as float seconds.

    Raises:
        ValueError: not a positive number of seconds.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def timeout_group(timeout: float) -> Any:
    """A gloo process group over every rank whose collectives raise after ``timeout`` seconds (cached per timeout).

    Every rank must call it at the same point (as with ``dist.new_group``); callers do so after a
    :class:`Session` step that every rank reached.
    """
    if timeout not in _groups:
        _groups[timeout] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    return _groups[timeout]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def describe(exc: BaseException | None) -> str | None:
    """``"TypeName: message"`` of ``exc``, or None: what :func:`broadcast_outcome` sends."""
    return None if exc is None else _describe(exc)


_SIDE_GROUP: Any = None


def side_group() -> Any:
    """A gloo process group of every rank for the outcome of async saves, which writer threads broadcast while
    the main threads train on the default group. Made on first use, by every rank at the same call (a collective);
    None with one process."""
    global _SIDE_GROUP
    if not is_distributed():
        return None
    if _SIDE_GROUP is None:
        _SIDE_GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=DEFAULT_TIMEOUT))
    return _SIDE_GROUP


def broadcast_outcome(message: str | None, group: Any) -> str | None:
    """Rank 0's ``message`` (None: success) on every rank, over ``group`` (from :func:`side_group`)."""
    if group is None:
        return message
    box = [message if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Session:
    """One save or load on every process (see the module docs).

    Args:
        what: the operation, as messages name it (``"save_state to /ckpt"``).
        timeout: seconds to wait for the other processes at each step (heartbeats extend it while one works).
    """

    def __init__(self, what: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.what = what
        self.timeout = check_timeout(timeout)
        self.active = is_distributed()
        self.rank = dist.get_rank() if self.active else 0
        self.world = dist.get_world_size() if self.active else 1
        self._step = 0
        if self.active:
            global _operations
            _operations += 1
            self.op = _operations
            self.store = dist.distributed_c10d._get_default_store()
            self._abandoned = f"fastckpt/{self.op}/abandoned"

    # -- store primitives ------------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as exc:  # the store's server went away (the process hosting it died)
            raise CheckpointError(f"{self.what}: lost the process group's store ({_describe(exc)}); "
                                  "another process probably died") from None

    def _alive_key(self, rank: int) -> str:
        return f"fastckpt/{self.op}/alive/{rank}"

    def beat(self, count: int, *, store: Any = None) -> None:
        """Tell the others this process is alive and at its current step (see :meth:`_wait`); ``store``: the
        connection to use (a thread other than the session's own passes one of its own, see
        :func:`~fastckpt._io.group.store_wait.borrow_connection`)."""
        (self.store if store is None else store).set(self._alive_key(self.rank), f"{self._step} {count}")

    def _wait(self, keys: list[str], ranks: list[int], step: str) -> None:
        """Wait until every key exists; raise CollectiveTimeoutError after ``timeout`` s without progress.

        The keys are checked with a short backoff (:class:`~fastckpt._io.group.store_wait.KeyWait`, within ~20 ms of the
        last one being set); every ``period`` between, this process bumps its heartbeat, raises
        if the operation was abandoned, and looks at the heartbeats of the processes it waits for. Progress: a
        process waited for that is alive and not past this step (it bumps its ``alive`` key while it waits or
        works) extends the deadline, so only a process that died or never came makes the wait fail.
        """
        if self._call(lambda: self.store.check(keys)):
            return
        period = max(0.2, min(self.timeout / 10, 5.0))
        waiting = self._call(lambda: KeyWait(self.store, keys))
        try:
            self._wait_for(waiting, keys, ranks, step, period)
        except BaseException as exc:  # gave up: the missing keys are set to read as given up (for later arrivals)
            if not isinstance(exc, CollectiveTimeoutError):
                self.abandon(f"process {self.rank} stopped waiting at step '{step}' ({_describe(exc)})")
            try:
                waiting.release(_GIVEN_UP)
            except Exception:  # the store is gone: the others find out by themselves
                pass
            raise

    def _wait_for(self, waiting: KeyWait, keys: list[str], ranks: list[int], step: str, period: float) -> None:
        deadline = time.monotonic() + self.timeout
        seen: dict[int, bytes] = {}
        beats = 0
        while not self._call(lambda: waiting.arrived(period)):
            if self._call(lambda: self.store.check([self._abandoned])):
                reason = self._call(lambda: self.store.get(self._abandoned)).decode()
                raise CollectiveTimeoutError(f"{self.what}: given up ({reason})")
            now = time.monotonic()
            beats += 1
            self._call(lambda beats=beats: self.beat(beats))
            for r in ranks:
                key = self._alive_key(r)
                if not self._call(lambda key=key: self.store.check([key])):
                    continue
                value = self._call(lambda key=key: self.store.get(key))
                if value != seen.get(r) and int(value.split()[0]) <= self._step:
                    if r in seen:
                        deadline = now + self.timeout
                    seen[r] = value
            if now > deadline:
                missing = [r for r, k in zip(ranks, keys) if not self._call(lambda k=k: self.store.check([k]))]
                reason = (f"process {self.rank} waited {self.timeout:g} s at step '{step}' for process(es) "
                          f"{missing}, which did not arrive (died, or did not call it with the same arguments)")
                self.abandon(reason)
                raise CollectiveTimeoutError(
                    f"{self.what}: {reason}; every process must call it, with the same arguments")

    def abandon(self, reason: str) -> None:
        """Tell the other processes this operation is given up (they raise at their next wait)."""
        if self.active:
            try:  # the first reason stays: it names the process that did not come
                if self.store.add(self._abandoned + "/count", 1) == 1:
                    self.store.set(self._abandoned, reason)
            except Exception:  # the store is gone too: the others find out by themselves
                pass

    def _key(self, step: int, rank: int | str) -> str:
        return f"fastckpt/{self.op}/{step}/{rank}"

    def _check_not_abandoned(self) -> None:
        if self._call(lambda: self.store.check([self._abandoned])):
            reason = self._call(lambda: self.store.get(self._abandoned)).decode()
            raise CollectiveTimeoutError(f"{self.what}: given up before this process arrived ({reason})")

    # -- collectives -----------------------------------------------------------------------------------------
    def gather(self, obj: Any, *, step: str = "gather") -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (a list in rank order); None on the other ranks."""
        if not self.active:
            return [obj]
        self._step += 1
        n = self._step
        if self.rank != 0:
            self._check_not_abandoned()
            self._call(lambda: self.store.set(self._key(n, self.rank), pickle.dumps(obj)))
            return None
        keys = [self._key(n, r) for r in range(1, self.world)]
        self._wait(keys, list(range(1, self.world)), step)
        out = [obj] + [pickle.loads(self._call(lambda k=k: self.store.get(k))) for k in keys]
        for k in keys:
            self._call(lambda k=k: self.store.delete_key(k))
        while _stale_keys:  # every rank has joined this later step, so each read those keys
            key = _stale_keys.pop()
            self._call(lambda key=key: self.store.delete_key(key))
        return out

    def broadcast(self, obj: Any = None, *, step: str = "broadcast") -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        self._step += 1
        key = self._key(self._step, 0)
        if self.rank == 0:
            self._call(lambda: self.store.set(key, pickle.dumps(obj)))
            _stale_keys.append(key)
            return obj
        self._wait([key], [0], step)
        value = self._call(lambda: self.store.get(key))
        if value == _GIVEN_UP:  # another process gave up waiting for this key and released its waiter with it
            self._check_not_abandoned()
            raise CollectiveTimeoutError(f"{self.what}: given up at step '{step}'")
        return pickle.loads(value)

    def working(self) -> _Heartbeat:
        """A context in which this rank bumps the heartbeat, so the others keep waiting while it works."""
        return _Heartbeat(self)

    def on_main(self, fn: Callable[[], T], *, step: str = "main process") -> T:
        """Run ``fn`` on rank 0; every rank returns its result, or raises when it failed.

        Rank 0 re-raises its own exception; the other ranks raise :class:`~fastckpt.errors.CheckpointError`
        naming it.
        """
        if not self.active:
            return fn()
        result: Any = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                with self.working():
                    result = fn()
            except Exception as exc:  # reported to every rank below, then re-raised here
                error = exc
        outcome = self.broadcast((result, None if error is None else _describe(error)), step=step)
        if error is not None:
            raise error
        if outcome[1] is not None:
            raise CheckpointError(f"{self.what} failed on process 0: {outcome[1]}")
        return outcome[0]

    def agree(self, error: BaseException | None, *, step: str = "agree",
              votes: list[bool] | None = None) -> list[bool] | None:
        """Raise on every rank if any rank's ``error`` is set (the own exception where it happened).

        ``votes``: yes / no answers of this rank (the same number on every rank), carried by the same round;
        returns, on every rank, each answer and-ed over all ranks (None when no votes were given).
        """
        if not self.active:
            if error is not None:
                raise error
            return votes
        reports = self.gather((None if error is None else _describe(error), votes), step=step)
        failed = None
        combined = votes
        if reports is not None:
            failed = next(((r, msg) for r, (msg, _) in enumerate(reports) if msg is not None), None)
            if votes is not None:
                combined = [all(v is not None and len(v) == len(votes) and v[i] for _, v in reports)
                            for i in range(len(votes))]
        failed, combined = self.broadcast((failed, combined), step=step)
        if error is not None:
            raise error
        if failed is not None:
            rank, msg = failed
            raise CheckpointError(f"{self.what} failed on process {rank}: {msg}; nothing was changed on any process")
        return combined


class _Heartbeat:
    """Bumps this process's ``fastckpt/{operation}/alive/{rank}`` key from a thread while it works."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self, connection: Any) -> None:
        s = self.session
        period = max(0.2, min(s.timeout / 10, 5.0))
        count = 0
        try:
            while not self._stop.is_set():
                count += 1
                try:
                    s.beat(-count, store=connection)
                except Exception:
                    return
                self._stop.wait(period)
        finally:
            if connection is not s.store:
                give_back_connection(s.store, connection)

    def __enter__(self) -> _Heartbeat:
        if self.session.active:
            # its own connection: the session's thread keeps using the store meanwhile (see borrow_connection);
            # a store that cannot be cloned (HashStore, FileStore: thread-safe) is shared
            connection = borrow_connection(self.session.store) or self.session.store
            self._thread = threading.Thread(target=self._run, args=(connection,), name="fastckpt-heartbeat",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# -- one-step helpers (each is a session of its own; every rank must call the same sequence) ------------------
def gather_to_main(obj: Any, *, what: str = "gathering to the main process",
                   timeout: float = DEFAULT_TIMEOUT) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (a list in rank order); None on the other ranks."""
    session = Session(what, timeout)
    out = session.gather(obj)
    session.broadcast(None)  # the others wait here until rank 0 has them all
    return out


def broadcast_from_main(obj: Any, *, what: str = "broadcasting from the main process",
                        timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Rank 0's ``obj`` on every rank."""
    return Session(what, timeout).broadcast(obj)


def on_main(fn: Callable[[], T], *, what: str, timeout: float = DEFAULT_TIMEOUT) -> T:
    """Run ``fn`` on rank 0 after every rank arrived; every rank returns its result, or raises when it failed."""
    session = Session(what, timeout)
    session.gather(None, step="arrive")
    return session.on_main(fn)


def agree(error: BaseException | None, *, what: str, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Raise on every rank if any rank's ``error`` is set (the own exception where it happened)."""
    Session(what, timeout).agree(error)

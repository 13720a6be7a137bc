"""Waiting for keys of the process group's key-value store without polling.

:class:`KeyWait` blocks in ``store.wait(keys)`` and returns the moment the last key is set (no sleeps between
checks, which on oversubscribed cores cost tens of milliseconds per step). The blocking wait runs in a thread of its
own, on a connection of its own (``store.clone()``), so that the waiting process can meanwhile do the periodic work
:mod:`fastckpt._io.distributed` needs (heartbeats, noticing a dead or abandoning process): a ``TCPStore`` client
holds its connection's lock for the whole of a ``wait``, which would block every other request of the process.
The clones are kept for the next wait (a pool per store, held weakly: it goes with the store), since opening
a connection costs a round trip to the store's server and, now and then, seconds of the client's connect backoff.
A store that cannot be cloned is waited on in slices from the calling thread instead.

``poll=True`` (what :class:`fastckpt._io.distributed.Session` uses): the calling thread ``check``s the keys with a
short backoff (1-20 ms) instead, with no thread and no ``wait`` that can run out: a 2-4 process FSDP2 test aborted
now and then (``malloc(): unaligned tcache chunk detected``, every thread's stack outside fastckpt's code) right after
blocking waits on cloned connections had run out in its timeout scenario. The backoff costs up to ~20 ms per step
on an oversubscribed machine; correctness first.
"""

from __future__ import annotations

import threading
import time
import weakref
from datetime import timedelta
from typing import Any

__all__ = ["KeyWait", "borrow_connection", "give_back_connection", "is_wait_timeout"]

_idle: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()  # store -> its unused clones
_idle_lock = threading.Lock()


def borrow_connection(store: Any) -> Any:
    """An idle clone of ``store``, or a new one; None where the store cannot be cloned.

    A thread other than the one that uses ``store`` talks to the store through a connection of its own: a
    ``TCPStore`` client is one object per connection, and some torch versions update its per-operation counters
    outside the connection's lock (``clientCounters_``), so two threads on one client can corrupt the heap. Give it
    back with :func:`give_back_connection` once the thread is done with it.
    """
    with _idle_lock:
        try:
            free = _idle.get(store)
        except TypeError:  # a store that cannot be weakly referenced: no pool
            free = None
        if free:
            return free.pop()
    try:
        return store.clone()
    except Exception:
        return None


def give_back_connection(store: Any, connection: Any) -> None:
    """Return a connection from :func:`borrow_connection` to the pool of ``store``'s idle clones."""
    with _idle_lock:
        try:
            _idle.setdefault(store, []).append(connection)
        except TypeError:
            pass


def is_wait_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a store's ``wait`` running out of time (``DistStoreError`` of TCPStore / HashStore,
    ``RuntimeError("Wait timeout")`` of FileStore), not a lost connection."""
    return isinstance(exc, RuntimeError) and "wait timeout" in str(exc).lower()


class KeyWait:
    """Every key of ``keys`` awaited on ``store``; :meth:`arrived` says whether they all exist yet.

    Args:
        store: the process group's store (``TCPStore``, usually under a ``PrefixStore``).
        keys: the keys to wait for.
        timeout: seconds one blocking ``wait`` of the thread lasts before it is restarted (the caller decides
            when to give up; a long one keeps the store's timeout warnings rare).
    """

    def __init__(self, store: Any, keys: list[str], timeout: float, *, poll: bool = False) -> None:
        self._store = store
        self._keys = keys
        self._timeout = timedelta(seconds=timeout)
        self._done = threading.Event()
        self._arrived = False
        self._error: BaseException | None = None
        self._poll = poll
        # None: the calling thread checks (poll) or waits in slices on the store itself (see arrived)
        self._connection = None if poll else borrow_connection(store)
        if self._connection is not None:
            self._start()

    def _start(self) -> None:
        self._done.clear()
        threading.Thread(target=self._run, name="fastckpt-store-wait", daemon=True).start()

    def _run(self) -> None:
        try:
            self._connection.wait(self._keys, self._timeout)
            self._arrived = True
            give_back_connection(self._store, self._connection)
        except Exception as exc:  # a timeout is restarted by arrived(); anything else is the caller's error
            if not is_wait_timeout(exc):
                self._error = exc
        finally:
            self._done.set()

    def release(self, value: bytes, seconds: float) -> None:
        """Set every awaited key that is still missing to ``value``, so the waiting thread returns (a thread left
        blocked in the store's C++ client aborts the process when the interpreter exits); wait at most ``seconds``
        for it. For a caller that gave up: whoever reads those keys must recognise ``value``."""
        for key in self._keys:
            if not self._store.check([key]):
                self._store.set(key, value)
        if self._connection is not None:
            self._done.wait(seconds)

    def arrived(self, seconds: float) -> bool:
        """Whether every key exists, waiting at most ``seconds`` for it (returns as soon as the last one is set).

        Raises:
            Exception: the store's own error when its connection failed (its server went away).
        """
        if self._poll:
            return self._poll_for(seconds)
        if self._connection is None:
            try:
                self._store.wait(self._keys, timedelta(seconds=seconds))
                return True
            except Exception as exc:
                if is_wait_timeout(exc):
                    return False
                raise
        if not self._done.wait(seconds):
            return False
        if self._error is not None:
            raise self._error
        if self._arrived:
            return True
        self._start()  # the thread's own wait ran out while the caller still waits: wait again
        return False

    def _poll_for(self, seconds: float) -> bool:
        """``check`` the keys from the calling thread, 1 ms apart at first, backing off to 20 ms, for at most
        ``seconds``: no waiting thread and no ``wait`` that runs out in the store's C++ client (a torchrun test
        aborted with heap corruption right after such timed-out waits on cloned connections)."""
        deadline = time.monotonic() + seconds
        pause = 0.001
        while True:
            if self._store.check(self._keys):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.02)

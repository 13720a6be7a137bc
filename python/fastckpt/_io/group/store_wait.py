"""Waiting for keys of the process group's key-value store, and store connections for other threads.

:class:`KeyWait` ``check``s the awaited keys from the calling thread with a short backoff (1 ms, doubling to
20 ms), so a step returns within milliseconds of the last key being set, while the caller does the periodic work
:mod:`fastckpt._io.group.distributed` needs between checks (heartbeats, noticing a dead or abandoning process). It starts
no thread and issues no ``store.wait`` that can run out: blocking waits on cloned connections in waiting threads
(an earlier design) were followed, now and then, by a heap corruption in a 2-4 process FSDP2 test
(``malloc(): unaligned tcache chunk detected``, in its timeout scenario). The backoff costs up to ~20 ms per step
on an oversubscribed machine.

A thread other than the one using the store (the heartbeat) talks to it through a connection of its own,
:func:`borrow_connection` (``store.clone()``, pooled per store, held weakly: it goes with the store).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

__all__ = ["KeyWait", "borrow_connection", "give_back_connection"]

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


class KeyWait:
    """Every key of ``keys`` awaited on ``store``; :meth:`arrived` says whether they all exist yet.

    Args:
        store: the process group's store (``TCPStore``, usually under a ``PrefixStore``).
        keys: the keys to wait for.
    """

    def __init__(self, store: Any, keys: list[str]) -> None:
        self._store = store
        self._keys = keys

    def release(self, value: bytes) -> None:
        """Set every awaited key that is still missing to ``value``: for a caller that gave up, so the processes
        waiting for those keys return (whoever reads them must recognise ``value``)."""
        for key in self._keys:
            if not self._store.check([key]):
                self._store.set(key, value)

    def arrived(self, seconds: float) -> bool:
        """Whether every key exists, checking for at most ``seconds`` (returns within ~20 ms of the last one).

        Raises:
            Exception: the store's own error when its connection failed (its server went away).
        """
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

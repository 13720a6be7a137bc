"""The store waits and connections of :mod:`fastckpt._io.group.store_wait`, on a real ``TCPStore``: a wait ends when the
last key is set and starts no thread, a released wait sets the missing keys to the given value, a lost server is an
error, and the heartbeat thread talks to the store through a pooled connection of its own."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from fastckpt._io.group.store_wait import KeyWait


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    yield dist.PrefixStore("test", server)


def test_arrives_when_the_last_key_is_set_and_starts_no_thread(store):
    before = threading.active_count()
    wait = KeyWait(store, ["a", "b"])
    store.set("a", "1")
    assert not wait.arrived(0.05)
    assert threading.active_count() == before
    store.set("b", "2")
    assert wait.arrived(5)
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]


def test_a_released_wait_sets_only_the_missing_keys(store):
    store.set("here", "1")
    wait = KeyWait(store, ["here", "gone"])
    wait.release(b"given up")
    assert store.multi_get(["here", "gone"]) == [b"1", b"given up"]
    assert wait.arrived(0.01)


def test_a_lost_server_is_an_error():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=5))
    wait = KeyWait(client, ["never"])
    del server
    with pytest.raises(RuntimeError):  # torch's DistStoreError / DistNetworkError
        while not wait.arrived(1.0):
            pass


class _ThreadRecorder:
    """A store that records which threads call it (and delegates to a real one); its clones record into their own
    list."""

    def __init__(self, store):
        self._store = store
        self.threads: set[str] = set()
        self.clones: list[_ThreadRecorder] = []

    def clone(self):
        twin = _ThreadRecorder(self._store.clone())
        self.clones.append(twin)
        return twin

    def __getattr__(self, name):
        self.threads.add(threading.current_thread().name)
        return getattr(self._store, name)


def test_the_heartbeat_thread_beats_on_a_connection_of_its_own(store, monkeypatch):
    # torch's TCPStore client updates per-operation counters outside its connection lock in some versions: two
    # threads on one client object corrupted the heap (malloc(): unaligned tcache chunk detected, in CI)
    from fastckpt._io.group import distributed

    recorder = _ThreadRecorder(store)
    session = distributed.Session.__new__(distributed.Session)
    session.what, session.timeout, session.active, session.rank, session.world = "test", 2.0, True, 0, 1
    session._step, session.op, session.store = 0, 1, recorder
    beat = threading.Event()
    real_beat = distributed.Session.beat

    def beat_once(self, count, *, store=None):
        real_beat(self, count, store=store)
        beat.set()

    monkeypatch.setattr(distributed.Session, "beat", beat_once)
    with session.working():
        assert beat.wait(20)
    assert recorder.threads == set(), "the session's own client was used from the heartbeat thread"
    assert [c.threads for c in recorder.clones] == [{"fastckpt-heartbeat"}]
    assert store.get("fastckpt/1/alive/0") == b"0 -1"
    # the clone went back to the pool: the next heartbeat (or store wait) reuses it
    assert distributed.borrow_connection(recorder) is recorder.clones[0]

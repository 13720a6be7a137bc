"""Waiting for store keys without polling (:mod:`fastckpt._io.store_wait`), on a real ``TCPStore``: the wait
ends when the last key is set, a wait whose own timeout runs out is restarted, the other requests of the process
are not blocked behind it, a lost server is an error, and a store that cannot be cloned is waited on in slices."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from fastckpt._io.store_wait import KeyWait, is_wait_timeout


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    yield dist.PrefixStore("test", server)


def test_arrives_when_the_last_key_is_set(store):
    wait = KeyWait(store, ["a", "b"], 30)
    store.set("a", "1")
    assert not wait.arrived(0.05)
    store.set("b", "2")
    assert wait.arrived(30)
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]


def test_other_requests_go_through_while_it_waits(store):
    wait = KeyWait(store, ["never"], 30)
    done = threading.Event()

    def other() -> None:  # with one shared connection this would block behind the wait for its 30 s
        store.set("x", "1")
        store.get("x")
        done.set()

    threading.Thread(target=other, daemon=True).start()
    assert done.wait(20)
    assert not wait.arrived(0.01)


def test_a_wait_that_runs_out_is_restarted(store):
    wait = KeyWait(store, ["late"], 0.05)
    assert not wait.arrived(1.0)  # the thread's 50 ms wait ran out: restarted
    assert not wait.arrived(0.01)
    store.set("late", "1")
    assert wait.arrived(30)


def test_a_connection_is_reused_after_a_wait(store):
    store.set("k", "1")
    first = KeyWait(store, ["k"], 30)
    assert first.arrived(30)
    second = KeyWait(store, ["k"], 30)
    assert second.arrived(30)
    assert second._connection is first._connection


class _NoClone:
    """A store without ``clone`` (as some custom stores are)."""

    def __init__(self, store):
        self._store = store

    def clone(self):
        raise NotImplementedError

    def wait(self, keys, timeout):
        return self._store.wait(keys, timeout)


def test_a_store_without_clone_is_waited_on_in_slices(store):
    wait = KeyWait(_NoClone(store), ["s"], 30)
    assert wait._connection is None
    assert not wait.arrived(0.05)
    store.set("s", "1")
    assert wait.arrived(0.05)


def test_a_lost_server_is_an_error_not_a_timeout():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=30))
    wait = KeyWait(client, ["gone"], 30)
    del server  # the server stops: the blocked wait fails
    with pytest.raises(Exception) as info:
        while not wait.arrived(1.0):
            pass
    assert not is_wait_timeout(info.value)


def test_timeouts_are_told_from_other_errors(store):
    with pytest.raises(Exception) as info:
        store.wait(["nothing"], timedelta(seconds=0.01))
    assert is_wait_timeout(info.value)
    assert not is_wait_timeout(RuntimeError("Connection reset by peer"))
    assert not is_wait_timeout(ValueError("wait timeout"))


def test_release_sets_the_missing_keys_and_ends_the_thread(store):
    store.set("have", "1")
    wait = KeyWait(store, ["have", "missing"], 30)
    wait.release(b"given up", 30)
    assert wait._done.is_set() and wait.arrived(0.01)
    assert store.multi_get(["have", "missing"]) == [b"1", b"given up"]


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
    from fastckpt._io import distributed

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


def test_a_polling_wait_starts_no_thread_and_sees_the_last_key(store):
    before = threading.active_count()
    wait = KeyWait(store, ["p", "q"], 30, poll=True)
    assert wait._connection is None and threading.active_count() == before
    store.set("p", "1")
    assert not wait.arrived(0.05)
    store.set("q", "2")
    assert wait.arrived(5)

"""The coordinator's garbage-collector pause (fastckpt/dcp/gc_pause.py): off during the block, back on after, the
block's objects moved to the oldest generation unexamined, a program's own frozen objects left frozen."""

from __future__ import annotations

import gc

from fastckpt.dcp.gc_pause import gc_paused


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_the_pause_ends_with_its_objects_in_the_oldest_generation_still_collectable():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # re-entrant: the inner exit leaves it off
            pass
        assert not gc.isenabled()
        made = [_Node() for _ in range(1000)]
    assert gc.isenabled()
    assert gc.get_count()[0] < 1000  # no young collection over the block's objects is pending
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert all(id(n) in oldest for n in made)
    assert gc.get_freeze_count() == 0
    gc.collect()  # a full collection still frees the cycles once they are garbage
    del made
    assert gc.collect() >= 1000


def test_a_programs_frozen_objects_stay_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            _Node()
        # not released by an unfreeze (0), not grown by a freeze of the block's objects; frozen objects that
        # reference counting freed meanwhile (other threads of a long test run) may make it smaller
        assert 0 < gc.get_freeze_count() <= frozen
        assert gc.isenabled()
    finally:
        gc.unfreeze()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()

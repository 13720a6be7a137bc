"""Boxes of a stored chunk as byte runs (the resharding read of fastckpt.dcp): gathered through the runs, every
box equals numpy's slice of the same array, byte for byte, for any shape, box and item size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt._format.dcp_boxes import box_runs


@st.composite
def boxes(draw):
    nd = draw(st.integers(0, 4))
    sizes = [draw(st.integers(0, 5)) for _ in range(nd)]
    offsets = [draw(st.integers(0, s)) for s in sizes]
    lengths = [draw(st.integers(0, s - o)) for s, o in zip(sizes, offsets)]
    return sizes, offsets, lengths, draw(st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=300, deadline=None)
@given(boxes())
def test_runs_gather_the_numpy_slice(box):
    sizes, offsets, lengths, itemsize = box
    arr = np.arange(int(np.prod(sizes)) * itemsize, dtype=np.uint32).astype(np.uint8).reshape(*sizes, itemsize)
    raw = arr.tobytes()
    starts, run = box_runs(sizes, offsets, lengths, itemsize)
    got = b"".join(raw[s:s + run] for s in starts.tolist())
    want = arr[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].tobytes()
    assert got == want


def test_whole_chunk_is_one_run_and_a_column_is_one_run_per_row():
    starts, run = box_runs([4, 6], [0, 0], [4, 6], 4)
    assert starts.tolist() == [0] and run == 96
    starts, run = box_runs([4, 6], [1, 2], [2, 3], 4)
    assert starts.tolist() == [32, 56] and run == 12


def test_a_box_outside_the_chunk_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        box_runs([4, 6], [3, 0], [2, 6], 4)

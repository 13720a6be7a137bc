"""The chunk-cover check of ``dcp_metadata.json`` (every rank runs it on N chunks per tensor at N ranks): its sweep
refuses exactly the chunk lists that a pairwise comparison of every two boxes finds overlapping."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from fastckpt._format.dcp_metadata import _check_cover
from fastckpt.errors import HeaderError


def _overlap_pairwise(chunks: list[tuple[list[int], list[int]]]) -> bool:
    boxes = [c for c in chunks if math.prod(c[1])]
    return any(all(a < b + m and b < a + n for a, n, b, m in zip(o1, s1, o2, s2))
               for i, (o1, s1) in enumerate(boxes) for o2, s2 in boxes[i + 1:])


@st.composite
def chunk_lists(draw):
    nd = draw(st.integers(1, 3))
    size = [draw(st.integers(1, 6)) for _ in range(nd)]
    chunks = []
    for _ in range(draw(st.integers(1, 8))):
        offsets = [draw(st.integers(0, s - 1)) for s in size]
        sizes = [draw(st.integers(0, s - o)) for s, o in zip(size, offsets)]
        chunks.append((offsets, sizes))
    return size, chunks


def _metadata(chunks):
    return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]


@settings(max_examples=400, deadline=None)
@given(chunk_lists())
def test_sweep_refuses_exactly_the_overlapping_lists(case):
    size, chunks = case
    volume = sum(math.prod(s) for _, s in chunks)
    if volume != math.prod(size):  # the volume check comes first
        with pytest.raises(HeaderError, match="elements"):
            _check_cover("t", size, _metadata(chunks))
        return
    if _overlap_pairwise(chunks):
        with pytest.raises(HeaderError, match="overlap"):
            _check_cover("t", size, _metadata(chunks))
    else:
        _check_cover("t", size, _metadata(chunks))


def test_a_long_chunk_overlapping_a_later_one_is_found():
    # [0:4, 0:1] meets [3:4, 0:2] although [1:3, 1:2] sorts between them; volumes add up (4 + 2 + 2 = 8 = 4 x 2)
    chunks = [([0, 0], [4, 1]), ([1, 1], [2, 1]), ([3, 0], [1, 2])]
    with pytest.raises(HeaderError, match=r"chunks at \[0, 0\] and \[3, 0\] overlap"):
        _check_cover("t", [4, 2], _metadata(chunks))


def test_row_and_column_shards_tile():
    rows = [([4 * r, 0], [4, 8]) for r in range(64)]
    _check_cover("t", [256, 8], _metadata(rows))
    cols = [([0, c], [16, 1]) for c in range(8)]
    _check_cover("t", [16, 8], _metadata(cols))

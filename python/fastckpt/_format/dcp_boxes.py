"""Boxes of a stored chunk as byte runs: what a resharded load or a consolidation reads and writes.

A chunk is stored C-contiguous (row-major) with ``sizes`` elements per dimension. A box ``[offsets, offsets +
lengths)`` of it is a set of equal-length contiguous byte runs: the innermost dimensions the box covers fully are
merged into each run, the outer ones enumerate the runs (in row-major order, so run ``i`` lands at ``i * run_bytes``
in a C-contiguous buffer of the box's shape).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["box_runs", "contiguous_strides"]


def contiguous_strides(sizes: Sequence[int]) -> list[int]:
    """Row-major strides in elements of a tensor of ``sizes``."""
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * int(sizes[i + 1])
    return strides


def box_runs(sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
             itemsize: int) -> tuple[np.ndarray, int]:
    """The byte runs of a box of a C-contiguous array.

    Args:
        sizes: the stored array's shape (elements).
        offsets: where the box starts in each dimension (elements).
        lengths: the box's shape (elements).
        itemsize: bytes per element.

    Returns:
        ``(starts, run_bytes)``: the byte offset of each run in the stored array (int64, row-major order of the
        box) and the length of every run in bytes. An empty box gives no runs.

    Raises:
        ValueError: the box does not fit in ``sizes``.
    """
    nd = len(sizes)
    if len(offsets) != nd or len(lengths) != nd:
        raise ValueError(f"a box of {len(offsets)}/{len(lengths)} dimensions in an array of {nd}")
    if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, sizes)):
        raise ValueError(f"the box at {list(offsets)} of shape {list(lengths)} does not fit in {list(sizes)}")
    if nd == 0:
        return np.zeros(1, dtype=np.int64), itemsize
    if math.prod(lengths) == 0:
        return np.zeros(0, dtype=np.int64), 0
    k = nd - 1
    while k > 0 and lengths[k] == sizes[k]:
        k -= 1
    strides = contiguous_strides(sizes)
    run = int(lengths[k]) * strides[k] * itemsize
    starts = np.array([sum(int(o) * s for o, s in zip(offsets, strides))], dtype=np.int64)
    for j in range(k):
        starts = (starts[:, None] + np.arange(int(lengths[j]), dtype=np.int64) * strides[j]).reshape(-1)
    return starts * itemsize, run

"""Fixtures of the pytest-benchmark suite: one workload's :class:`~benches._contenders.Bench` for the session.

The suite times each contender on its own (``pytest benches --benchmark-enable``); the side-by-side table with
alternated rounds, per-round ratios and ``RESULTS.md`` comes from ``python benches/run.py`` (see README.md).

Environment:
    FASTCKPT_BENCH_WORKLOAD: one of ``benches._workloads.WORKLOADS`` (default ``gpt-256MB``).
    FASTCKPT_BENCH_DIR: folder on the disk under test (default: pytest's temporary folder).
    FASTCKPT_BENCH_ROUNDS: timed rounds per contender (default 5).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
from collections.abc import Iterator

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benches._contenders import Bench, prepare_sources  # noqa: E402
from benches._workloads import WORKLOADS, build_state, model_bytes, state_bytes  # noqa: E402

WORKLOAD = os.environ.get("FASTCKPT_BENCH_WORKLOAD", "gpt-256MB")
ROUNDS = int(os.environ.get("FASTCKPT_BENCH_ROUNDS", "5"))


@pytest.fixture(scope="session")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    """The workload's live state, a stepped target state, the prepared source checkpoints, a pre-faulted scratch
    buffer; the folder is removed at the end."""
    if WORKLOAD not in WORKLOADS:
        raise pytest.UsageError(f"FASTCKPT_BENCH_WORKLOAD={WORKLOAD!r}; known: {list(WORKLOADS)}")
    workload = WORKLOADS[WORKLOAD]
    root = os.environ.get("FASTCKPT_BENCH_DIR")
    folder = pathlib.Path(root) / f"fastckpt-bench-{os.getpid()}" if root else tmp_path_factory.mktemp("bench")
    state = build_state(workload, seed=0)
    nbytes = state_bytes(state)
    scratch = torch.empty(min(nbytes, 1 << 30), dtype=torch.uint8)
    scratch.fill_(1)
    b = Bench(workload, state, build_state(workload, seed=1), folder, nbytes, model_bytes(state), scratch=scratch)
    prepare_sources(b)
    yield b
    shutil.rmtree(folder, ignore_errors=True)

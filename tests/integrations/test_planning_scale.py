"""The coordinator's planning work grows at most linearly with the world size (accelerate#4099: planning that
took hours at 2816 ranks): DCP's global plan, the fastckpt.dcp writer's merge and fastckpt's manifest, run on the
synthetic per-rank plans of benches/planning_scale.py, counted in function calls (deterministic), not in seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benches.planning_scale import measure  # noqa: E402


@pytest.fixture(scope="module")
def work():
    return {n: measure(n, 2) for n in (64, 128, 256)}


@pytest.mark.parametrize("step", ["global plan", "writer", "manifest", "coordinator total",
                                  "rank metadata parse, full metadata"])
def test_doubling_the_ranks_at_most_doubles_the_coordinators_work(work, step):
    for n in (64, 128):
        small, large = work[n][step][0], work[2 * n][step][0]
        assert large <= 2.2 * small, (step, n, small, large)


def test_a_ranks_index_read_and_load_plan_do_not_grow_with_the_ranks(work):
    # issue 28: one rank's load side through dcp_index.bin is independent of N (calls per doubling <= 1.1x)
    for n in (64, 128):
        small, large = work[n]["rank index read + load plan"][0], work[2 * n]["rank index read + load plan"][0]
        assert large <= 1.1 * small, (n, small, large)


def test_a_cached_plan_costs_less_than_planning(work):
    for n, steps in work.items():
        assert steps["global plan, cached"][0] * 5 < steps["global plan"][0], n

"""pytest-benchmark: every contender of ``benches/_contenders.py`` on one workload, each timed on its own.

Run ``pytest benches --benchmark-enable`` (``FASTCKPT_BENCH_WORKLOAD=gpt-1GB`` for another size). Each round runs
the contender's untimed setup first (fresh output folder, page cache dropped or warmed). ``extra_info`` holds the
bytes moved and the median ``done`` time (durable for saves) next to pytest-benchmark's own (``returned``) times.
Without ``--benchmark-enable`` (the default ``addopts``), each contender runs once as a smoke test.

For the side-by-side table with alternated rounds and per-round ratios, run ``python benches/run.py``.
"""

from __future__ import annotations

import os
import statistics

import pytest

from benches._contenders import contenders
from benches._workloads import WORKLOADS

WORKLOAD = os.environ.get("FASTCKPT_BENCH_WORKLOAD", "gpt-256MB")
ROUNDS = int(os.environ.get("FASTCKPT_BENCH_ROUNDS", "5"))

CONTENDERS = contenders(WORKLOADS[WORKLOAD])


@pytest.mark.parametrize("contender", CONTENDERS, ids=[c.label for c in CONTENDERS])
def test_contender(benchmark, bench, contender):
    benchmark.group = f"{WORKLOAD} {contender.op}"
    done: list[float] = []

    def setup():
        if contender.setup:
            contender.setup(bench)

    def run():
        timing = contender.run(bench)
        done.append(timing.done)
        if contender.teardown:
            contender.teardown(bench)

    if contender.name == "fastckpt save_state async":  # the host buffer pool is allocated once, not timed
        contender.setup(bench)
        run()
        done.clear()
    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    nbytes = bench.model_bytes if contender.moves == "model" else bench.full_bytes
    benchmark.extra_info.update(bytes=nbytes, done_median_s=statistics.median(done), cache=contender.cache)

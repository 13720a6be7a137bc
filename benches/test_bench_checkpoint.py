"""fastckpt.save_state / load_state against accelerate's Accelerator.save_state / load_state on a ~1 GB state.

Durable against durable: fastckpt saves with ``durable=True``; accelerate's round includes an fsync of every file
it wrote and of its folder. Loads start from a cold page cache (the checkpoint's pages are dropped before each
round). Each benchmark reports bytes, GB/s and the fraction of the raw disk speed in ``extra_info``.

Run: ``pytest benches --benchmark-enable`` (see benches/README.md).
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil

import pytest

import fastckpt
from fastckpt.demo import dir_bytes, drop_page_cache, fsync_tree

ROUNDS = int(os.environ.get("FASTCKPT_BENCH_ROUNDS", "5"))

accelerate = pytest.importorskip("accelerate")
logging.getLogger("accelerate").setLevel(logging.ERROR)


def _fastckpt_save(state, path: pathlib.Path, model_only: bool) -> None:
    fastckpt.save_state(
        state.model, state.optimizer, state.scheduler, output_dir=path, model_only=model_only, durable=True
    )


@pytest.fixture(scope="module")
def accelerator(training_state):
    acc = accelerate.Accelerator(cpu=True)
    acc.prepare(training_state.model, training_state.optimizer, training_state.scheduler)
    return acc


def _accelerate_save(accelerator, path: pathlib.Path) -> None:
    accelerator.save_state(str(path))
    fsync_tree(path)


@pytest.fixture(scope="module")
def saved(training_state, accelerator, bench_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """One checkpoint of each kind, the sources of the load benchmarks."""
    paths = {kind: bench_dir / "saved" / kind for kind in ("full", "model_only", "accelerate")}
    _fastckpt_save(training_state, paths["full"], model_only=False)
    _fastckpt_save(training_state, paths["model_only"], model_only=True)
    _accelerate_save(accelerator, paths["accelerate"])
    return paths


def _bench_save(benchmark, report, save, path: pathlib.Path, raw_disk: dict[str, float]) -> None:
    def setup():
        shutil.rmtree(path, ignore_errors=True)

    benchmark.pedantic(save, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    report(benchmark, dir_bytes(path), raw_disk["write_gbps"])


@pytest.mark.benchmark(group="save")
@pytest.mark.parametrize("model_only", [False, True], ids=["full", "model_only"])
def test_save_fastckpt(benchmark, report, training_state, bench_dir, raw_disk, model_only):
    path = bench_dir / f"save_fastckpt_{model_only}"
    _bench_save(benchmark, report, lambda: _fastckpt_save(training_state, path, model_only), path, raw_disk)


@pytest.mark.benchmark(group="save")
def test_save_accelerate(benchmark, report, accelerator, bench_dir, raw_disk):
    path = bench_dir / "save_accelerate"
    _bench_save(benchmark, report, lambda: _accelerate_save(accelerator, path), path, raw_disk)


def _bench_load(benchmark, report, load, path: pathlib.Path, raw_disk: dict[str, float]) -> None:
    benchmark.pedantic(load, setup=lambda: drop_page_cache(path), rounds=ROUNDS, iterations=1, warmup_rounds=0)
    report(benchmark, dir_bytes(path), raw_disk["read_gbps"])


@pytest.mark.benchmark(group="load")
@pytest.mark.parametrize("model_only", [False, True], ids=["full", "model_only"])
def test_load_fastckpt(benchmark, report, fresh_state, saved, raw_disk, model_only):
    path = saved["model_only" if model_only else "full"]
    objects = (fresh_state.model, fresh_state.optimizer, fresh_state.scheduler)[: 1 if model_only else 3]

    def load():
        fastckpt.load_state(*objects, input_dir=path, model_only=model_only)

    _bench_load(benchmark, report, load, path, raw_disk)


@pytest.mark.benchmark(group="load")
def test_load_accelerate(benchmark, report, fresh_state, saved, raw_disk):
    acc = accelerate.Accelerator(cpu=True)
    acc.prepare(fresh_state.model, fresh_state.optimizer, fresh_state.scheduler)
    _bench_load(benchmark, report, lambda: acc.load_state(str(saved["accelerate"])), saved["accelerate"], raw_disk)

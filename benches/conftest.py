"""Fixtures of the checkpoint benchmarks: a ~1 GB training state, a folder on the disk under test, and the disk's
raw write/read speed measured in the same run (every result is also reported as a fraction of it).

Environment:
    FASTCKPT_BENCH_DIR: folder to write checkpoints in (default: pytest's temporary folder).
    FASTCKPT_BENCH_LAYERS: number of 2048 x 2048 Linear layers (default 20: 83,927,040 fp32 parameters, a
        335.7 MB model and a 1.007 GB full state with AdamW's two moments).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time

import pytest
import torch

from fastckpt.demo import drop_page_cache

WIDTH = 2048


@dataclasses.dataclass
class TrainingState:
    """A model, its AdamW (moments populated by one step) and a warm-up scheduler."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def make_state(layers: int, seed: int = 0) -> TrainingState:
    """``layers`` Linear(2048, 2048) layers in a Sequential, AdamW after one step, LinearLR warm-up."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=10)
    return TrainingState(model, optimizer, scheduler)


def train_one_step(state: TrainingState) -> None:
    state.model(torch.randn(4, WIDTH)).square().mean().backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()


@pytest.fixture(scope="session")
def training_state() -> TrainingState:
    state = make_state(int(os.environ.get("FASTCKPT_BENCH_LAYERS", "20")))
    train_one_step(state)
    return state


@pytest.fixture(scope="session")
def fresh_state(training_state: TrainingState) -> TrainingState:
    """The same shapes, another seed: the target of the load benchmarks."""
    return make_state(len(training_state.model), seed=1)


@pytest.fixture(scope="session")
def bench_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = os.environ.get("FASTCKPT_BENCH_DIR")
    if root:
        path = pathlib.Path(root) / f"fastckpt-bench-{os.getpid()}"
        path.mkdir(parents=True)
        return path
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="session")
def raw_disk(bench_dir: pathlib.Path, training_state: TrainingState) -> dict[str, float]:
    """GB/s of one sequential write of the model's bytes (64 MiB writes, then fsync) and of reading them back
    from a cold page cache: the ceiling the checkpoint writers are measured against."""
    data = torch.cat([p.detach().reshape(-1) for p in training_state.model.parameters()]).view(torch.uint8).numpy()
    view = memoryview(data)
    folder = bench_dir / "raw"
    folder.mkdir()
    path = folder / "raw.bin"
    chunk = 64 << 20
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for offset in range(0, len(view), chunk):
            f.write(view[offset : offset + chunk])
        os.fsync(f.fileno())
    write_s = time.perf_counter() - start
    drop_page_cache(folder)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view[: min(chunk, len(view))]):
            pass
    read_s = time.perf_counter() - start
    path.unlink()
    return {"write_gbps": len(view) / 1e9 / write_s, "read_gbps": len(view) / 1e9 / read_s}


_RESULTS: list[tuple[str, str, int, float, float]] = []  # (group, name, bytes, median s, raw GB/s)


def _report(benchmark, nbytes: int, raw_gbps: float) -> None:
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["raw_disk_gbps"] = round(raw_gbps, 3)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        median = stats.stats.median
        gbps = nbytes / 1e9 / median
        benchmark.extra_info["gbps"] = round(gbps, 3)
        benchmark.extra_info["fraction_of_raw_disk"] = round(gbps / raw_gbps, 3)
        _RESULTS.append((benchmark.group or "", benchmark.name, nbytes, median, raw_gbps))


def pytest_terminal_summary(terminalreporter) -> None:
    """After pytest-benchmark's tables: throughput per benchmark, against the raw disk and against accelerate."""
    if not _RESULTS:
        return
    terminalreporter.section("checkpoint throughput (median round; GB = 1e9 bytes)")
    header = f"{'benchmark':<32} {'MB':>9} {'median s':>9} {'GB/s':>6} {'of raw disk':>11} {'vs accelerate':>13}"
    terminalreporter.write_line(header)
    for group, name, nbytes, median, raw_gbps in sorted(_RESULTS):
        baseline = next((m for g, n, _, m, _ in _RESULTS if g == group and "accelerate" in n), None)
        speedup = f"{baseline / median:.2f}x" if baseline else "n/a"
        gbps = nbytes / 1e9 / median
        terminalreporter.write_line(
            f"{name:<32} {nbytes / 1e6:>9,.1f} {median:>9.3f} {gbps:>6.2f} {gbps / raw_gbps:>10.0%} {speedup:>13}"
        )


@pytest.fixture
def report():
    """``report(benchmark, nbytes, raw_gbps)``: put bytes, GB/s (from the median round) and the fraction of the
    raw disk speed into the benchmark's extra_info (saved with --benchmark-json / --benchmark-autosave)."""
    return _report

"""Fixtures of the checkpoint benchmarks: a ~1 GB training state, a folder on the disk under test, and the disk's
raw write/read speed measured in the same run (every result is also reported as a fraction of it).

Environment:
    FASTCKPT_BENCH_DIR: folder to write checkpoints in (default: pytest's temporary folder).
    FASTCKPT_BENCH_ROUNDS: timed rounds per benchmark (default 5; the median is reported).
    FASTCKPT_BENCH_LAYERS: number of 2048 x 2048 Linear layers (default 20: 83,927,040 fp32 parameters, a
        335.7 MB model and a 1.007 GB full state with AdamW's two moments).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import statistics
import time
from collections.abc import Iterator

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
def bench_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pathlib.Path]:
    """A fresh folder for the session's checkpoints (about 5 GB at the default size), removed at the end."""
    root = os.environ.get("FASTCKPT_BENCH_DIR")
    path = pathlib.Path(root) / f"fastckpt-bench-{os.getpid()}" if root else tmp_path_factory.mktemp("bench")
    path.mkdir(parents=True, exist_ok=True)
    _BENCH_DIR.append(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def raw_disk(bench_dir: pathlib.Path, training_state) -> dict[str, float]:
    """GB/s of the disk itself: sequential 64 MiB writes of the model's bytes, three times over (about the size
    of the full state), then fsync; and reading the file back from a cold page cache. Median of 3 rounds each:
    the ceiling the checkpoint writers are measured against."""
    data = torch.cat([p.detach().reshape(-1) for p in training_state.model.parameters()]).view(torch.uint8).numpy()
    view = memoryview(data)
    folder = bench_dir / "raw"
    folder.mkdir()
    path = folder / "raw.bin"
    chunk, repeats = 64 << 20, 3
    nbytes = repeats * len(view)
    scratch = bytearray(chunk)
    write_s, read_s = [], []
    for _ in range(3):
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for _ in range(repeats):
                f.writelines(view[offset : offset + chunk] for offset in range(0, len(view), chunk))
            os.fsync(f.fileno())
        write_s.append(time.perf_counter() - start)
        drop_page_cache(folder)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(scratch):
                pass
        read_s.append(time.perf_counter() - start)
        path.unlink()
    _RAW_DISK.update(
        write_gbps=nbytes / 1e9 / statistics.median(write_s), read_gbps=nbytes / 1e9 / statistics.median(read_s)
    )
    return _RAW_DISK


_RESULTS: list[tuple[str, str, int, float, float]] = []  # (group, name, bytes, median s, raw GB/s)
_RAW_DISK: dict[str, float] = {}
_BENCH_DIR: list[pathlib.Path] = []


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


def _table() -> list[str]:
    """The results as a Markdown table: one row per benchmark, grouped (load, then save)."""
    lines = [
        "| benchmark | MB | median s | GB/s | vs raw disk | vs accelerate |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for group, name, nbytes, median, raw_gbps in sorted(_RESULTS):
        baseline = next((m for g, n, _, m, _ in _RESULTS if g == group and "accelerate" in n), None)
        speedup = f"{baseline / median:.2f}x" if baseline else "n/a"
        gbps = nbytes / 1e9 / median
        lines.append(
            f"| {name} | {nbytes / 1e6:,.1f} | {median:.3f} | {gbps:.2f} | {gbps / raw_gbps:.2f}x | {speedup} |"
        )
    return lines


def pytest_terminal_summary(terminalreporter) -> None:
    """After pytest-benchmark's tables: throughput per benchmark against the raw disk and against accelerate,
    printed and written to benches/RESULTS.md (only when the benchmarks ran, i.e. with --benchmark-enable)."""
    if not _RESULTS:
        return
    import accelerate

    raw = _RAW_DISK
    where = _BENCH_DIR[0] if _BENCH_DIR else "?"
    setup = f"{time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPUs; torch {torch.__version__}, accelerate "
    setup += f"{accelerate.__version__}; checkpoints in {where}."
    disk = f"Raw disk (64 MiB sequential writes + fsync / cold reads): write {raw.get('write_gbps', 0):.2f} GB/s, "
    disk += f"read {raw.get('read_gbps', 0):.2f} GB/s. Median of each benchmark's rounds; GB = 1e9 bytes; saves "
    disk += "durable (fastckpt durable=True, accelerate + fsync); loads from a cold page cache."
    text = ["# fastckpt benchmark results", "", setup, disk, "", *_table()]
    terminalreporter.section("checkpoint throughput")
    for line in text[2:]:
        terminalreporter.write_line(line)
    path = pathlib.Path(__file__).with_name("RESULTS.md")
    path.write_text("\n".join(text) + "\n")
    terminalreporter.write_line(f"written to {path}")


@pytest.fixture
def report():
    """``report(benchmark, nbytes, raw_gbps)``: put bytes, GB/s (from the median round) and the fraction of the
    raw disk speed into the benchmark's extra_info (saved with --benchmark-json / --benchmark-autosave)."""
    return _report

"""Turning rounds of measurements into the side-by-side table, the per-round ratios and the issue's targets.

Ratios are taken *within* a round (each contender against the baseline measured next to it), then the median over
rounds is reported, so a disk that is twice as fast in one minute as in the next cancels out.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable

from benches._measure import Timing

__all__ = ["Row", "Result", "summarize", "table", "round_table", "targets"]

RAW = {"save": "raw write", "load": "raw read"}
ACCELERATE = {"save": "accelerate save_state", "load": "accelerate load_state"}
MEMCPY = "memcpy of the state"


@dataclasses.dataclass
class Row:
    """One contender's timings over the rounds of one workload."""

    workload: str
    name: str
    op: str
    cache: str
    nbytes: int
    state_bytes: int
    timings: list[Timing] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.cache})" if self.cache else self.name


@dataclasses.dataclass
class Result:
    """Medians of one row, and its per-round ratios (None where the baseline was not measured)."""

    row: Row
    returned: float
    done: float
    gbps: float
    vs_raw: list[float]  # per round: this row's GB/s (done) / the raw baseline's GB/s (done), same cache
    vs_acc_done: list[float]  # per round: accelerate's done time / this row's done time (speedup)
    vs_acc_returned: list[float]  # per round: accelerate's returned time / this row's returned time
    vs_memcpy: list[float]  # per round: this row's done time / the memcpy's time (for warm loads, async saves)
    peak_rss: int

    @staticmethod
    def med(values: list[float]) -> float | None:
        return statistics.median(values) if values else None


def _find(rows: list[Row], workload: str, name: str, cache: str) -> Row | None:
    return next((r for r in rows if r.workload == workload and r.name == name and r.cache == cache), None)


def summarize(rows: list[Row]) -> list[Result]:
    """Medians and per-round ratios for every row."""
    out = []
    for row in rows:
        op = "save" if row.op == "copy" else row.op
        raw = _find(rows, row.workload, RAW[op], row.cache)
        acc = _find(rows, row.workload, ACCELERATE[op], row.cache)
        mem = _find(rows, row.workload, MEMCPY, "")
        vs_raw, vs_acc_d, vs_acc_r, vs_mem = [], [], [], []
        for i, t in enumerate(row.timings):
            if raw is not None and i < len(raw.timings) and row.op != "copy":
                vs_raw.append((row.nbytes / t.done) / (raw.nbytes / raw.timings[i].done))
            if acc is not None and i < len(acc.timings):
                vs_acc_d.append(acc.timings[i].done / t.done)
                vs_acc_r.append(acc.timings[i].returned / t.returned)
            if mem is not None and i < len(mem.timings):
                vs_mem.append(t.done / mem.timings[i].done)
        done = statistics.median(t.done for t in row.timings)
        out.append(Result(
            row=row,
            returned=statistics.median(t.returned for t in row.timings),
            done=done,
            gbps=row.nbytes / 1e9 / done,
            vs_raw=vs_raw,
            vs_acc_done=vs_acc_d,
            vs_acc_returned=vs_acc_r,
            vs_memcpy=vs_mem,
            peak_rss=max(t.peak_rss for t in row.timings),
        ))
    return out


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def table(results: list[Result]) -> list[str]:
    """The side-by-side Markdown table: one row per contender and workload."""
    lines = [
        "| workload | contender | GB | returned s | done s | GB/s | x raw | x acc (done) | x acc (returned) "
        "| peak extra RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        row = r.row
        lines.append(
            f"| {row.workload} | {row.label} | {row.nbytes / 1e9:.2f} | {r.returned:.3f} | {r.done:.3f} | "
            f"{r.gbps:.2f} | {_x(r.med(r.vs_raw))} | {_x(r.med(r.vs_acc_done))} | {_x(r.med(r.vs_acc_returned))} | "
            f"{r.peak_rss / 1e6:,.0f} |"
        )
    return lines


def round_table(results: list[Result], names: Iterable[str]) -> list[str]:
    """Per-round ratios of the chosen contenders (x raw baseline of the same round, same cache)."""
    wanted = set(names)
    lines = ["| workload | contender | x raw, each round | x accelerate (done), each round |", "|---|---|---|---|"]
    for r in results:
        if r.row.label in wanted:
            raw = " ".join(f"{v:.2f}" for v in r.vs_raw)
            acc = " ".join(f"{v:.2f}" for v in r.vs_acc_done)
            lines.append(f"| {r.row.workload} | {r.row.label} | {raw} | {acc} |")
    return lines


def _get(results: list[Result], workload: str, label: str) -> Result | None:
    return next((r for r in results if r.row.workload == workload and r.row.label == label), None)


def targets(results: list[Result]) -> list[str]:
    """The issue's targets, each checked on every workload it applies to: ``| target | workload | value | met |``."""
    lines = ["| target | workload | measured | met |", "|---|---|---|---|"]

    def add(what: str, workload: str, value: float | None, ok: bool | None, unit: str = "x") -> None:
        shown = "n/a" if value is None else (f"{value:.2f}{unit}" if unit == "x" else f"{value:,.0f} {unit}")
        lines.append(f"| {what} | {workload} | {shown} | {'n/a' if ok is None else ('yes' if ok else 'NO')} |")

    workloads = list(dict.fromkeys(r.row.workload for r in results))
    full_save = "fastckpt save_state full"
    for w in workloads:
        save = _get(results, w, full_save)
        if save is not None:
            v = save.med(save.vs_raw)
            add("full save, durable: >= 0.85x raw write", w, v, v is not None and v >= 0.85)
            if save.row.state_bytes >= 1e9:
                v = save.med(save.vs_acc_done)
                add("full save, durable: >= 2x faster than accelerate (>= 1 GB)", w, v, v is not None and v >= 2)
            limit = 256e6 + 0.05 * save.row.state_bytes
            add(f"sync save peak extra RSS <= {limit / 1e6:,.0f} MB", w, save.peak_rss / 1e6, save.peak_rss <= limit,
                "MB")
        mo = _get(results, w, "fastckpt save_state model_only")
        st = _get(results, w, "safetensors save_file")
        if mo is not None:
            v = mo.med(mo.vs_acc_done)
            add("model-only save: >= 5x faster than accelerate full save", w, v, v is not None and v >= 5)
            if st is not None:
                ratios = [a.done / b.done for a, b in zip(st.row.timings, mo.row.timings)]
                v = Result.med(ratios)
                add("model-only save: no slower than safetensors save_file (durable)", w, v, v >= 1.0)
        for cache, lo in (("cold", "load cold: >= 0.85x raw read"), ("warm", None)):
            load = _get(results, w, f"fastckpt load_state existing ({cache})")
            if load is None:
                continue
            if lo:
                v = load.med(load.vs_raw)
                add(lo, w, v, v is not None and v >= 0.85)
            else:
                v = load.med(load.vs_memcpy)
                add("load warm into existing: <= 2x one memcpy of the state", w, v, v is not None and v <= 2)
            v = load.med(load.vs_acc_done)
            add(f"load {cache}: faster than accelerate load_state", w, v, None if v is None else v > 1)
        asy = _get(results, w, "fastckpt save_state async")
        if asy is not None:
            mem = _get(results, w, MEMCPY)
            if mem is not None:
                ratios = [a.returned / m.done for a, m in zip(asy.row.timings, mem.row.timings)]
                v = Result.med(ratios)
                add("async save blocking <= 1.3x memcpy of the state", w, v, v <= 1.3)
            v = asy.med(asy.vs_acc_returned)
            add("async save blocking <= 0.1x accelerate save_state", w, None if v is None else 1 / v,
                None if v is None else 1 / v <= 0.1)
    for label in (full_save, "fastckpt load_state existing (cold)"):
        per = [(r.row.workload, r.med(r.vs_raw)) for r in results
               if r.row.label == label and not r.row.workload.startswith("tensor") and r.vs_raw]
        if len(per) >= 2:
            values = [v for _, v in per]
            spread = max(values) / min(values) - 1
            add(f"flat throughput, {label}: x raw within 15% across sizes", ", ".join(w for w, _ in per),
                spread * 100, spread <= 0.15, "%")
    return lines

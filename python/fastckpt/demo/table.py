"""The demo's figures: one :class:`DemoRow` per checkpoint, the table, and the line on how busy the machine was.

Speed-ups are medians of per-round ratios against accelerate measured in the same round (accelerate's seconds /
the row's), for saves and for loads. The machine's load average is printed beside the table: on a machine that
other work keeps busy (a 1-minute load average at or above its CPU count) every time is longer and varies more
between rounds, and the speed-ups shrink toward 1x, because fastckpt's parallel I/O threads find no idle cores.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import statistics

from fastckpt.demo.files import dir_bytes

__all__ = ["DemoRow", "format_table", "make_row", "load_average", "busy_line", "format_weights_table"]


@dataclasses.dataclass
class DemoRow:
    """One checkpoint of the demo: how big it is, how long it took, whether it reloaded bit-exactly.

    Attributes:
        name: the row label (``fastckpt full``, ``fastckpt model_only``, ``accelerate``).
        path: the checkpoint folder.
        bytes_written: total size of the files in ``path``, in bytes.
        save_s: seconds to save, including fsync (durable): the median over the rounds.
        load_s: seconds to load into fresh objects, from a cold page cache: the median over the rounds.
        problems: every mismatch found by the verification (of any round); empty when verified.
        save_rounds, load_rounds: the seconds of each round.
        save_speedup: the median over the rounds of accelerate's save seconds / this row's, in the same round
            (NaN without an accelerate row).
        load_speedup: the same for loads: accelerate's load seconds / this row's, median of per-round ratios.
    """

    name: str
    path: pathlib.Path
    bytes_written: int
    save_s: float
    load_s: float
    problems: list[str]
    save_rounds: list[float] = dataclasses.field(default_factory=list)
    load_rounds: list[float] = dataclasses.field(default_factory=list)
    save_speedup: float = math.nan
    load_speedup: float = math.nan

    @property
    def verified(self) -> bool:
        """True when the reloaded state equals the saved one bit for bit."""
        return not self.problems


def _median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def _ratio(baseline: list[float], mine: list[float]) -> float:
    """Median of per-round ``baseline / mine`` over the rounds where both ran (NaN if none did)."""
    ratios = [b / s for b, s in zip(baseline, mine) if s and not math.isnan(b) and not math.isnan(s)]
    return statistics.median(ratios) if ratios else math.nan


def make_row(name: str, path: pathlib.Path, saves: list[float], loads: list[float], problems: list[str], *,
             baseline: tuple[list[float], list[float]]) -> DemoRow:
    """A table row from its rounds.

    Args:
        name, path: the row label and its checkpoint folder.
        saves, loads: seconds of each round (NaN where it did not run).
        problems: verification failures.
        baseline: ``(save seconds, load seconds)`` of accelerate's rounds, the same rounds (empty lists: none).

    Returns:
        The :class:`DemoRow`, medians and per-round-ratio speed-ups filled in.
    """
    return DemoRow(name, path, dir_bytes(path) if path.exists() else 0, _median(saves), _median(loads), problems,
                   saves, loads, _ratio(baseline[0], saves), _ratio(baseline[1], loads))


def _number(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else spec.format(value)


def format_table(rows: list[DemoRow]) -> str:
    """The demo's table as aligned plain text: size (MB = 1e6 bytes), seconds, GB/s (1e9 bytes/s), speed-ups
    (accelerate's seconds / the row's: above 1x is faster than accelerate), verification."""
    header = ["checkpoint", "MB written", "save s", "load s", "save GB/s", "load GB/s", "save speedup",
              "load speedup", "verified"]
    lines = [header]
    for row in rows:
        lines.append(
            [
                row.name,
                f"{row.bytes_written / 1e6:,.1f}",
                _number(row.save_s, "{:.3f}"),
                _number(row.load_s, "{:.3f}"),
                _number(row.bytes_written / 1e9 / row.save_s if row.save_s else math.nan, "{:.2f}"),
                _number(row.bytes_written / 1e9 / row.load_s if row.load_s else math.nan, "{:.2f}"),
                _number(row.save_speedup, "{:.2f}x"),
                _number(row.load_speedup, "{:.2f}x"),
                "yes" if row.verified else "no",
            ]
        )
    return _aligned(lines)


def _aligned(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def format_weights_table(rows: list[DemoRow]) -> str:
    """The weights-only load table (fastckpt's model-only load and the peers, into an existing model): bytes read
    (MB = 1e6), median seconds, GB/s, ``vs fastckpt`` (in ``load_speedup``: fastckpt's seconds / the row's, median of
    per-round ratios; above 1x is faster than fastckpt's verifying load), whether the result equalled the saved
    weights.

    Args:
        rows: one :class:`DemoRow` per loader (``save_s`` unused).

    Returns:
        The aligned plain-text table.
    """
    lines = [["weights-only load", "MB read", "load s", "load GB/s", "vs fastckpt", "equal"]]
    for row in rows:
        lines.append([row.name, f"{row.bytes_written / 1e6:,.1f}", _number(row.load_s, "{:.3f}"),
                      _number(row.bytes_written / 1e9 / row.load_s if row.load_s else math.nan, "{:.2f}"),
                      _number(row.load_speedup, "{:.2f}x"), "yes" if row.verified else "no"])
    return _aligned(lines)


def load_average() -> float:
    """The 1-minute load average (runnable and uninterruptible tasks, averaged), NaN where the OS has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def busy_line(peak_load: float, cpus: int | None = None) -> str:
    """The line printed beside the table: the highest 1-minute load average seen during the rounds against the
    CPU count, and what that does to the figures.

    Args:
        peak_load: the highest 1-minute load average sampled during the rounds (NaN: not available).
        cpus: CPUs this process may run on (default: ``os.sched_getaffinity``, else ``os.cpu_count()``).

    Returns:
        One line of text, e.g. ``"machine load: 1-minute load average up to 11.32 on 2 CPUs: busy ..."``.
    """
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if math.isnan(peak_load):
        return "machine load: no load average on this system; figures from a busy machine are slower and noisier"
    head = f"machine load: 1-minute load average up to {peak_load:.2f} on {cpus} CPU{'s' if cpus != 1 else ''}"
    if peak_load >= cpus:
        return (f"{head}: busy (other work wanted every CPU): every time above is longer and varies between rounds, "
                "and both speedup columns shrink toward 1x (fastckpt's parallel I/O threads find no idle core); "
                "rerun when the load average is below the CPU count for representative figures")
    return f"{head}: not saturated; a busier machine gives longer times and speed-ups closer to 1x"

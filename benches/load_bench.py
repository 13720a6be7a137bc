"""Loads that verify every byte (issue 19 item 2, issue 20 item 1): fastckpt's default ``load_state`` (every byte
read is checked against the recorded crc32c before it reaches a live tensor) against the physical limits and its
peers, measured in the same run, alternated, medians of per-round ratios.

Usage::

    python benches/load_bench.py                         # tensor-1GB, gpt-1GB, llama-1.2GB; 7 rounds
    python benches/load_bench.py --workloads gpt-256MB --rounds 3

Contenders per round (in benches._measure.round_order: every pair in both orders; cold = ``posix_fadvise(DONTNEED)`` on the files first,
warm = the files read once first):

- ``raw read`` (cold): the checkpoint's own files read sequentially by one thread with 64 MiB ``readinto`` calls
  into a pre-faulted buffer: what the disk gives one plain reader.
- the device's parallel read rate (``benches/disk_probe.py``: O_DIRECT at queue depths 1-32, the best), probed
  before the rounds: the stricter baseline (on the development VM one buffered reader gets 0.25-1.0 GB/s of a
  disk that serves 1-2 GB/s to 16 reads in flight, so "x raw read" flatters any parallel reader); the cold
  targets are held against both.
- ``copy_`` (warm reference): one ``copy_`` of every tensor of the state into pre-faulted tensors of the same shapes.
- ``fastckpt`` / ``fastckpt verify=False`` (cold, warm): ``load_state`` into a stepped model + optimizer (the live
  tensors are the destinations), with and without the checksums.
- ``fastckpt fresh`` (cold): ``load_state`` into objects built just before (a resume: new tensors fault in).
- ``accelerate`` (cold): ``Accelerator.load_state`` of accelerate's own checkpoint of the same state.
- ``fastckpt.dcp`` / ``fastckpt.dcp verify=False`` (cold, warm): ``fastckpt.dcp.load`` of a ``fastckpt.dcp.save``
  of every tensor of the state into pre-faulted tensors.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import shutil
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import fastckpt  # noqa: E402
import fastckpt.dcp  # noqa: E402
from benches._contenders import Bench, _accelerator  # noqa: E402
from benches._measure import RAW_CHUNK, drop_caches, fsync_tree, round_order, warm_cache  # noqa: E402
from benches._workloads import WORKLOADS, build_state, model_bytes, state_bytes, state_tensors  # noqa: E402
from benches.disk_probe import describe, probe  # noqa: E402

DEFAULT = ["tensor-1GB", "gpt-1GB", "llama-1.2GB"]
#: (ratio label, numerator contender, denominator contender, "speed" = num_time/den_time is how much faster the
#: denominator... see _ratios: each ratio is written so that >= target is good)
TARGETS = [
    ("cold vs raw read", "raw read cold", "fastckpt cold", 0.9),
    ("cold vs accelerate", "accelerate cold", "fastckpt cold", 1.5),
    ("warm vs copy_ (time ratio, <=)", "fastckpt warm", "copy_ warm", 1.2),
    ("verifying vs verify=False, cold", "fastckpt verify=False cold", "fastckpt cold", 0.9),
    ("verifying vs verify=False, warm", "fastckpt verify=False warm", "fastckpt warm", 0.7),
    ("dcp verifying vs verify=False, cold", "fastckpt.dcp verify=False cold", "fastckpt.dcp cold", 0.9),
    ("dcp verifying vs verify=False, warm", "fastckpt.dcp verify=False warm", "fastckpt.dcp warm", 0.7),
    ("fresh objects vs raw read, cold", "raw read cold", "fastckpt fresh cold", None),
]


def _raw_read(files: list[pathlib.Path], scratch: torch.Tensor) -> None:
    view = memoryview(scratch.numpy())
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view[:RAW_CHUNK]):
                pass


def _prepare(name: str, root: pathlib.Path) -> tuple[Bench, dict]:
    workload = WORKLOADS[name]
    state = build_state(workload, seed=0)
    target = build_state(workload, seed=1)
    scratch = torch.empty(RAW_CHUNK, dtype=torch.uint8)
    scratch.fill_(1)
    b = Bench(workload, state, target, root / name, state_bytes(state), model_bytes(state), scratch=scratch)
    shutil.rmtree(b.root, ignore_errors=True)
    (b.root / "src").mkdir(parents=True)
    b.sources["fastckpt"] = fastckpt.save_state(*state.objects, output_dir=b.root / "src" / "fastckpt")
    flat = {f"t{i}": t for i, t in enumerate(state_tensors(state))}
    b.sources["dcp"] = b.root / "src" / "dcp"
    fastckpt.dcp.save(flat, b.sources["dcp"])
    if not workload.single_tensor:
        b.sources["accelerate"] = b.root / "src" / "accelerate"
        _accelerator(b, "save").save_state(str(b.sources["accelerate"]))
    fsync_tree(b.root / "src")
    dcp_dest = {f"t{i}": torch.zeros_like(t) for i, t in enumerate(state_tensors(state))}
    copy_dest = [torch.zeros_like(t) for t in state_tensors(state)]
    return b, {"dcp_dest": dcp_dest, "copy_dest": copy_dest, "flat": list(flat.values())}


def _contenders(b: Bench, extra: dict) -> list[tuple[str, str, str, object]]:
    """(name, cache, source, call) of every contender."""
    src = b.sources["fastckpt"]
    files = sorted(p for p in src.iterdir() if p.is_file())

    def fast(verify: bool):
        return lambda: fastckpt.load_state(*b.target.objects, input_dir=src, verify=verify)

    def fresh():
        objs = b.extras.pop("fresh").objects
        fastckpt.load_state(*objs, input_dir=src)

    def dcp(verify: bool):
        return lambda: fastckpt.dcp.load(extra["dcp_dest"], b.sources["dcp"], verify=verify)

    def copy() -> None:
        for d, s in zip(extra["copy_dest"], extra["flat"]):
            d.copy_(s)

    out = [("raw read", "cold", "fastckpt", lambda: _raw_read(files, b.scratch)), ("copy_", "warm", "", copy)]
    for cache in ("cold", "warm"):
        out += [("fastckpt", cache, "fastckpt", fast(True)), ("fastckpt verify=False", cache, "fastckpt", fast(False)),
                ("fastckpt.dcp", cache, "dcp", dcp(True)), ("fastckpt.dcp verify=False", cache, "dcp", dcp(False))]
    out.append(("fastckpt fresh", "cold", "fastckpt", fresh))
    if "accelerate" in b.sources:
        acc = _accelerator(b, "load")
        out.append(("accelerate", "cold", "accelerate", lambda: acc.load_state(str(b.sources["accelerate"]))))
    return out


def run_workload(name: str, root: pathlib.Path, rounds: int) -> dict[str, list[float]]:
    b, extra = _prepare(name, root)
    chosen = _contenders(b, extra)
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        order = round_order(chosen, r)
        for cname, cache, source, call in order:
            if cname == "fastckpt fresh":
                b.extras["fresh"] = build_state(b.workload, seed=3, stepped=False)
            if source:
                drop_caches([b.sources[source]])
                if cache == "warm":
                    warm_cache([b.sources[source]])
            gc.collect()
            t0 = time.perf_counter()
            call()
            times.setdefault(f"{cname} {cache}", []).append(time.perf_counter() - t0)
        print(f"  {name}: round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    times["_bytes"] = [float(b.full_bytes)]
    shutil.rmtree(b.root, ignore_errors=True)
    return times


def _ratios(times: dict[str, list[float]]) -> list[tuple[str, float | None, float | None]]:
    """(label, median of per-round ratios, target) for each target whose contenders ran."""
    out = []
    for label, num, den, target in TARGETS:
        if num in times and den in times:
            per_round = [a / c for a, c in zip(times[num], times[den])]
            out.append((label, statistics.median(per_round), target))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(DEFAULT))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--root", default="/tmp/fastckpt-load-bench")
    args = ap.parse_args()
    root = pathlib.Path(args.root)
    disk = probe(root / "probe")
    results = {w: run_workload(w, root, args.rounds) for w in args.workloads.split(",")}
    print(f"\n{args.rounds} rounds, alternated; medians (s, GB/s); ratios are medians of per-round ratios\n")
    print(describe(disk) + "\n")
    names = sorted({k for t in results.values() for k in t if not k.startswith("_")})
    print("| contender | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for n in names:
        cells = []
        for t in results.values():
            if n in t:
                m = statistics.median(t[n])
                cells.append(f"{m:.3f} s ({t['_bytes'][0] / m / 1e9:.2f} GB/s)")
            else:
                cells.append("-")
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("\n| ratio (target) | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    labels = [t[0] for t in TARGETS]
    got = {w: {label: (v, target) for label, v, target in _ratios(t)} for w, t in results.items()}
    for label, target in ((t[0], t[3]) for t in TARGETS):
        cells = []
        for w in results:
            if label in got[w]:
                v, _ = got[w][label]
                cells.append(f"{v:.2f}x")
            else:
                cells.append("-")
        want = "" if target is None else (f" (<= {target})" if "<=" in label else f" (>= {target})")
        print(f"| {label.replace(' (time ratio, <=)', '')}{want} | " + " | ".join(cells) + " |")
    for n in ("fastckpt cold", "fastckpt fresh cold", "raw read cold"):  # GB/s over the device's parallel rate
        cells = [f"{t['_bytes'][0] / statistics.median(t[n]) / 1e9 / disk['parallel_read']:.2f}x" if n in t else "-"
                 for t in results.values()]
        print(f"| {n} vs the device's parallel read rate (>= 0.9) | " + " | ".join(cells) + " |")
    del labels


if __name__ == "__main__":
    main()

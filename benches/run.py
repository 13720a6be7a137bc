"""Benchmark driver: every contender on every workload, alternated, in one run; prints the side-by-side table and
writes ``benches/RESULTS.md`` (the part above its hand-written notes) with the machine's description.

Usage::

    python benches/run.py                      # default workloads, 5 rounds (about 8 minutes on 2 cores)
    python benches/run.py --large              # also the 4 GB and 8 GB states
    python benches/run.py --workloads gpt-256MB --rounds 2 --only "fastckpt,raw" --no-write

Each round runs every contender once, in an order rotated by one every two rounds and reversed every other round
(so every pair runs in both orders), each after its untimed setup (fresh
output folder, page cache dropped, or warmed for the warm loads). See benches/README.md for what is measured.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import shutil
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benches._contenders import Bench, Contender, contenders, prepare_sources  # noqa: E402
from benches._measure import machine_description, round_order  # noqa: E402
from benches._peers import peer_table  # noqa: E402
from benches._report import Row, round_table, summarize, table, targets  # noqa: E402
from benches._workloads import (  # noqa: E402
    DEFAULT_WORKLOADS,
    LARGE_WORKLOADS,
    WORKLOADS,
    build_state,
    model_bytes,
    state_bytes,
)
from benches.disk_probe import describe, probe  # noqa: E402

MARKER = "<!-- Everything below this line is kept when run.py rewrites the file. -->"
#: Contenders that need a second state in memory, skipped when it does not fit.
MEMORY_HUNGRY = {"accelerate load_state", "torch.load mmap", "fastckpt load_state fresh"}
SCRATCH_MAX = 1 << 30


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _bench(name: str, root: pathlib.Path) -> tuple[Bench, list[str]]:
    workload = WORKLOADS[name]
    state = build_state(workload, seed=0)
    nbytes = state_bytes(state)
    roomy = _available_bytes() > 2.6 * nbytes + SCRATCH_MAX
    target = build_state(workload, seed=1) if roomy else state
    scratch = torch.empty(min(nbytes, SCRATCH_MAX), dtype=torch.uint8)
    scratch.fill_(1)  # pre-fault: first touch of fresh memory is not what is measured
    bench = Bench(workload, state, target, root / name, nbytes, model_bytes(state), scratch=scratch)
    skipped = [] if roomy else sorted(MEMORY_HUNGRY)
    return bench, skipped


def _nbytes(b: Bench, c: Contender) -> int:
    return b.model_bytes if c.moves == "model" else b.full_bytes


def run_workload(name: str, root: pathlib.Path, rounds: int, only: list[str], log) -> tuple[list[Row], list[str]]:
    """Measure every contender on one workload; returns the rows and notes (skips, errors)."""
    t0 = time.perf_counter()
    bench, skipped = _bench(name, root)
    notes = [f"{name}: {c} skipped (a second copy of the state does not fit in memory)" for c in skipped]
    chosen = [c for c in contenders(bench.workload) if c.name not in skipped]
    if only:
        chosen = [c for c in chosen if any(s in c.label for s in only)]
    log(f"== {name}: state {bench.full_bytes / 1e9:.2f} GB (model {bench.model_bytes / 1e9:.2f} GB), "
        f"{len(chosen)} contenders x {rounds} rounds")
    prepare_sources(bench)
    rows = {c.label: Row(name, c.name, c.op, c.cache, _nbytes(bench, c), bench.full_bytes) for c in chosen}
    if any(c.name == "fastckpt save_state async" for c in chosen):  # the host buffer pool is allocated once
        import fastckpt

        start = time.perf_counter()
        try:
            fastckpt.save_state(*bench.state.objects, output_dir=bench.out("warmup"), async_save=True).wait()
            notes.append(f"{name}: first async save (allocates and pre-faults the host buffer pool): "
                         f"{time.perf_counter() - start:.2f} s, not counted")
        except TypeError as exc:  # a fastckpt without async_save
            notes.append(f"{name}: no async save: {exc}")
        shutil.rmtree(bench.out("warmup"), ignore_errors=True)
    failed: set[str] = set()
    for r in range(rounds):
        for c in round_order(chosen, r):
            if c.label in failed:
                continue
            try:
                if c.setup:
                    c.setup(bench)
                timing = c.run(bench)
                if c.teardown:
                    c.teardown(bench)
            except Exception as exc:  # a contender that breaks is reported, the others go on
                failed.add(c.label)
                notes.append(f"{name}: {c.label} failed: {type(exc).__name__}: {exc}")
                log(traceback.format_exc())
                continue
            rows[c.label].timings.append(timing)
            log(f"  round {r + 1} {c.label:45s} returned {timing.returned:7.3f} s  done {timing.done:7.3f} s  "
                f"rss +{timing.peak_rss / 1e6:,.0f} MB")
    shutil.rmtree(bench.root, ignore_errors=True)
    for key in [k for k in bench.extras if k.startswith("accelerator")]:
        bench.extras[key].free_memory()
    del bench
    gc.collect()
    log(f"== {name} took {time.perf_counter() - t0:.0f} s")
    return [row for row in rows.values() if row.timings], notes


def render(results, notes: list[str], header: list[str], disk: dict | None = None) -> list[str]:
    key = ["fastckpt save_state full", "fastckpt load_state existing (cold)", "fastckpt save_state async"]
    peers = peer_table(results, disk)
    if len(peers) <= 2:  # no workload measured the peers (``peers=False``, or --only left them out): no empty table
        peers = ["No workload of this run measured the peers (gpt-1GB and gpt2-small do)."]
    return [
        *header, "", *table(results), "", "### Targets", "", *targets(results), "",
        "### Per-round ratios (each against the baseline measured in the same round)", "",
        *round_table(results, key), "",
        "### The fastest loaders (weights only; `vs best`: the best peer's time over fastckpt's, per round, median)",
        "", *([describe(disk), ""] if disk else []), *peers, "",
        *(["### Notes", "", *[f"- {n}" for n in notes], ""] if notes else []),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                        help=f"comma-separated, from {', '.join(WORKLOADS)}")
    parser.add_argument("--large", action="store_true", help=f"add {', '.join(LARGE_WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("FASTCKPT_BENCH_ROUNDS", "5")))
    parser.add_argument("--dir", default=os.environ.get("FASTCKPT_BENCH_DIR", "/tmp/fastckpt-bench"),
                        help="folder on the disk under test (emptied and removed)")
    parser.add_argument("--only", default="", help="comma-separated substrings of contender names to keep")
    parser.add_argument("--output", default=str(pathlib.Path(__file__).with_name("RESULTS.md")))
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    parser.add_argument("--quiet", action="store_true", help="no per-round lines")
    parser.add_argument("--no-probe", action="store_true", help="skip the disk probe (benches/disk_probe.py)")
    args = parser.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w] + (LARGE_WORKLOADS if args.large else [])
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {list(WORKLOADS)}")
    root = pathlib.Path(args.dir) / f"run-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    torch.set_num_threads(os.cpu_count() or 1)
    started, t0 = time.strftime("%Y-%m-%d %H:%M"), time.perf_counter()
    rows, notes = [], []
    disk = None if args.no_probe else probe(root / "probe")
    if disk is not None:
        log(describe(disk))
    try:
        for name in names:
            r, n = run_workload(name, root, args.rounds, only, log)
            rows += r
            notes += n
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = summarize(rows)
    import accelerate
    import safetensors

    header = [
        "## Results", "",
        f"{started}, {time.perf_counter() - t0:.0f} s: `{' '.join(['python benches/run.py', *(argv or sys.argv[1:])])}`",
        "",
        f"Machine: {machine_description(pathlib.Path(args.dir))}; accelerate {accelerate.__version__}, "
        f"safetensors {safetensors.__version__}. {args.rounds} rounds, contenders alternated; medians; GB = 1e9 "
        "bytes. `returned`: the call returned; `done`: durable (fsync'd) for saves, every byte in memory for loads. "
        "`x raw`: GB/s against the raw sequential baseline of the same round and cache; `x acc`: accelerate's time "
        "over this one's (speedup), same round.",
    ]
    text = render(results, notes, header, disk)
    print("\n".join(text))
    if not args.no_write:
        out = pathlib.Path(args.output)
        kept = out.read_text().split(MARKER, 1)[1] if out.exists() and MARKER in out.read_text() else "\n"
        out.write_text("\n".join(["# fastckpt benchmark results", "", *text, MARKER]) + kept)
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

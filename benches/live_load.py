"""Cold loads of the weights into a live model, only these, from one file: fastckpt's verifying and plain loads
against run:ai's model streamer + ``copy_`` (the fastest peer of the suite's "live, cold" rows).

The suite (``benches/run.py``) runs 38 contenders per round, and each leaves something behind for the next (page
cache, mappings to unmap, a background huge-page collapse after an async save); this runs only the loads in
question, each into the same live model from the same ``model.safetensors`` (written once by
``fastckpt.save_state(model_only=True)``), page cache dropped and checked empty before each load, in
:func:`benches._measure.round_order`, every result checked ``torch.equal`` to the saved weights.

Usage::

    python benches/live_load.py --workload gpt-1GB --rounds 6 [--threads 0,8,16] [--dir /path/on/the/disk]

Prints each contender's median seconds and the median of its per-round ratios against run:ai's (``vs runai``:
runai's seconds / the contender's; above 1x is faster). Needs ``runai-model-streamer`` (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import fastckpt  # noqa: E402
from benches._measure import drop_caches, round_order  # noqa: E402
from benches._workloads import WORKLOADS, build_state  # noqa: E402


def _runai(model: torch.nn.Module, path: pathlib.Path) -> None:
    from runai_model_streamer import SafetensorsStreamer

    sd = model.state_dict()
    with torch.no_grad(), SafetensorsStreamer() as s:
        s.stream_file(str(path), owned=False)
        for name, t in s.get_tensors():
            sd[name].copy_(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="gpt-1GB", choices=sorted(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", default="0", help="comma-separated reader thread counts of fastckpt (0 = default)")
    ap.add_argument("--dir", type=pathlib.Path, default=None, help="folder on the disk under test")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    root = pathlib.Path(tempfile.mkdtemp(prefix="live-load-", dir=args.dir))
    try:
        saved = build_state(WORKLOADS[args.workload], seed=0).model
        fastckpt.save_state(saved, output_dir=root / "ckpt", model_only=True)
        path = root / "ckpt" / "model.safetensors"
        model = build_state(WORKLOADS[args.workload], seed=3).model
        calls: dict[str, Callable[[], object]] = {"runai + copy_": lambda: _runai(model, path)}
        for th in (int(t) for t in args.threads.split(",")):
            calls[f"fastckpt t{th}"] = lambda th=th: fastckpt.load_state(
                model, input_dir=root / "ckpt", model_only=True, threads=th)
            calls[f"fastckpt t{th} verify=False"] = lambda th=th: fastckpt.load_state(
                model, input_dir=root / "ckpt", model_only=True, threads=th, verify=False)
        times: dict[str, list[float]] = {k: [] for k in calls}
        want = [t.clone() for t in saved.state_dict().values()]
        for r in range(args.rounds):
            for name in round_order(list(calls), r):
                with torch.no_grad():
                    for t in model.state_dict().values():
                        t.zero_()
                drop_caches([path])
                start = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - start)
                got = list(model.state_dict().values())
                if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                    raise SystemExit(f"{name}: the loaded weights differ from the saved ones")
        print(f"{args.workload}: {path.stat().st_size / 1e9:.2f} GB of weights, {args.rounds} rounds, cold")
        for name, ts in times.items():
            ratio = statistics.median(a / b for a, b in zip(times["runai + copy_"], ts, strict=True))
            print(f"  {name:28s} median {statistics.median(ts):.3f} s   vs runai {ratio:.2f}x   "
                  + " ".join(f"{t:.3f}" for t in ts))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

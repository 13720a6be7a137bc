"""The training loop's overhead of checkpointing, end to end: what a user feels.

GPT-2 small (``fastckpt.demo.gpt2``, 124 M parameters, AdamW: a 1.5 GB state) trains on CPU; every ``K`` steps the
state is checkpointed. Contenders, alternated each round (benches._measure.round_order: every pair in both orders): no checkpoint (the baseline),
fastckpt sync, fastckpt async (``async_save=True``: streaming, hashed at the call), ``Accelerator.save_state``
and DCP ``async_save``.
Each loop runs ``(C + 1) * K`` steps with ``C`` checkpoints and ends by waiting for the last save, so the time of a
background write that training did not hide is counted.

Per contender (medians over rounds of per-round values):

- ``added s/ckpt``: (loop time - the baseline loop of the same round) / C.
- ``longest step s``: the longest training step (forward, backward, ``optimizer.step()``), the call excluded.
- ``call s``: how long the checkpoint call blocked the loop.
- ``stall s``: the step right after the call minus the baseline's median step of the same round (an async save's
  step waits there for what is not yet written or copied).
- each also as a ratio to accelerate's value (``x acc``) and to a plain memcpy of the state (``x memcpy``: the
  same round's time to copy every tensor of the state once into preallocated memory).

Usage::

    python benches/train_loop.py --rounds 2 --every 4 --checkpoints 1 [--write benches/RESULTS.md]

Timing on a shared machine is noisy; see benches/RESULTS.md for the conditions of the recorded run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import fastckpt  # noqa: E402
from benches._measure import PeakRss, machine_description, round_order  # noqa: E402
from fastckpt.demo.gpt2 import GPT, PRESETS  # noqa: E402

SEQ = 64
SECTION = "## Training loop: checkpoint overhead"


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    idx = torch.randint(0, 256, (1, SEQ), generator=g)
    _, loss = model(idx, targets=torch.roll(idx, -1, 1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the state once (tied weights once), as a checkpoint holds them."""
    unique = {t.data_ptr(): t for t in model.state_dict().values()}
    return [*unique.values()] + [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _memcpy_seconds(model: torch.nn.Module, opt: torch.optim.Optimizer, scratch: list[torch.Tensor]) -> float:
    tensors = _state_tensors(model, opt)
    start = time.perf_counter()
    for dst, src in zip(scratch, tensors):
        dst.copy_(src)
    return time.perf_counter() - start


class Loop:
    """One contender's loop: ``save(step)`` starts a checkpoint, returns a ``wait`` callable or None."""

    def __init__(self, name: str, save: Callable[[int], Callable[[], Any] | None] | None) -> None:
        self.name, self.save = name, save


def _contenders(model, opt, out: pathlib.Path) -> list[Loop]:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    acc_model, acc_opt = acc.prepare(model, opt)

    def fast_sync(step: int):
        fastckpt.save_state(model, opt, output_dir=out / "fast_sync", step=step)
        return None

    def fast_async(step: int):
        return fastckpt.save_state(model, opt, output_dir=out / "fast_async", step=step, async_save=True).wait

    def accelerate_save(step: int):
        acc.save_state(str(out / "accelerate"))
        return None

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{out / 'pg'}", rank=0, world_size=1)

    def dcp_async(step: int):
        msd, osd = get_state_dict(model, opt)
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(out / f"dcp_{step}"))
        return future.result

    return [Loop("no checkpoint", None), Loop("fastckpt sync", fast_sync), Loop("fastckpt async", fast_async),
            Loop("Accelerator.save_state", accelerate_save), Loop("DCP async_save", dcp_async)]


def _run_loop(loop: Loop, model, opt, every: int, checkpoints: int, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    steps, calls, stalls_at = [], [], []
    waits: list[Callable[[], Any]] = []
    with PeakRss() as rss:
        start = time.perf_counter()
        for i in range(1, (checkpoints + 1) * every + 1):
            t0 = time.perf_counter()
            _train_step(model, opt, g)
            steps.append(time.perf_counter() - t0)
            if loop.save is not None and i % every == 0 and i // every <= checkpoints:
                if waits:
                    waits.pop()()
                c0 = time.perf_counter()
                wait = loop.save(i)
                calls.append(time.perf_counter() - c0)
                stalls_at.append(len(steps))  # the next step is steps[len(steps)]
                if wait is not None:
                    waits.append(wait)
        for w in waits:
            w()
        total = time.perf_counter() - start
    after = [steps[k] for k in stalls_at if k < len(steps)]
    others = [s for k, s in enumerate(steps) if k not in stalls_at]
    return {"total": total, "longest": max(others) if others else 0.0, "call": statistics.median(calls or [0.0]),
            "after": statistics.median(after or [0.0]), "median_step": statistics.median(steps),
            "rss": rss.extra}


def run(rounds: int, every: int, checkpoints: int, preset: str = "small") -> tuple[list[dict[str, Any]], str]:
    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    _train_step(model, opt, g)  # optimizer state exists
    scratch = [torch.empty_like(t) for t in _state_tensors(model, opt)]
    for t in scratch:
        t.zero_()
    out = pathlib.Path(tempfile.mkdtemp(prefix="fastckpt-train-loop-", dir=os.environ.get("BENCH_DIR")))
    loops = _contenders(model, opt, out)
    for loop in loops[1:]:  # warm-up, untimed: first-use allocations (pools, stagers, accelerate's setup)
        wait = loop.save(0)
        if wait is not None:
            wait()
        for child in out.iterdir():
            if child.name != "pg":
                shutil.rmtree(child, ignore_errors=True)
    per_round: list[dict[str, dict[str, float]]] = []
    try:
        for r in range(rounds):
            results: dict[str, dict[str, float]] = {}
            order = round_order(loops, r)
            memcpy = _memcpy_seconds(model, opt, scratch)
            for loop in order:
                results[loop.name] = _run_loop(loop, model, opt, every, checkpoints, seed=100 + r)
                for child in out.iterdir():  # keep the disk small: each contender's checkpoints go
                    if child.name != "pg":
                        shutil.rmtree(child, ignore_errors=True)
                print(f"round {r} {loop.name}: {results[loop.name]}", flush=True)
            results["memcpy"] = {"call": memcpy}
            per_round.append(results)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        fastckpt.release_buffers()
    rows = []
    for loop in loops[1:]:
        row: dict[str, Any] = {"name": loop.name}
        for key in ("added", "longest", "call", "stall"):
            values, vs_acc, vs_copy = [], [], []
            for res in per_round:
                base = res["no checkpoint"]

                def metric(name: str, key: str = key, res: dict = res, base: dict = base) -> float:
                    m = res[name]
                    return {"added": (m["total"] - base["total"]) / checkpoints, "longest": m["longest"],
                            "call": m["call"], "stall": m["after"] - base["median_step"]}[key]

                v = metric(loop.name)
                values.append(v)
                a = metric("Accelerator.save_state")
                vs_acc.append(v / a if a > 0 else float("nan"))
                vs_copy.append(v / res["memcpy"]["call"])
            row[key] = (statistics.median(values), statistics.median(vs_acc), statistics.median(vs_copy))
        row["rss"] = statistics.median(res[loop.name]["rss"] for res in per_round) / 1e6
        rows.append(row)
    base = statistics.median(res["no checkpoint"]["median_step"] for res in per_round)
    copy = statistics.median(res["memcpy"]["call"] for res in per_round)
    gb = sum(t.numel() * t.element_size() for t in scratch) / 1e9
    base_rss = statistics.median(res["no checkpoint"]["rss"] for res in per_round) / 1e6
    facts = (f"{rounds} rounds, a checkpoint every {every} steps, {checkpoints} per loop; baseline median step "
             f"{base:.3f} s, peak extra RSS of the baseline loop {base_rss:,.0f} MB; memcpy of the {gb:.2f} GB "
             f"state {copy:.3f} s")
    return rows, facts + f"; GPT-2 {preset} (fastckpt.demo.gpt2)"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| contender | added s/ckpt | x acc | x memcpy | longest step s | x acc | call s | x acc | x memcpy "
            "| stall s | x acc | x memcpy | peak extra RSS MB (loop) |\n|---|" + "---:|" * 13)
    lines = [head]
    for r in rows:
        a, lg, c, s = r["added"], r["longest"], r["call"], r["stall"]
        lines.append(f"| {r['name']} | {a[0]:.3f} | {a[1]:.2f}x | {a[2]:.2f}x | {lg[0]:.3f} | {lg[1]:.2f}x | "
                     f"{c[0]:.4f} | {c[1]:.3f}x | {c[2]:.3f}x | {s[0]:.3f} | {s[1]:.2f}x | {s[2]:.2f}x | "
                     f"{r['rss']:,.0f} |")
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> str:
    fast = next(r for r in rows if r["name"] == "fastckpt async")
    checks = [("async added wall time per checkpoint <= 0.3x accelerate's", fast["added"][1], 0.3),
              ("async call <= 0.1x accelerate's save_state", fast["call"][1], 0.1),
              ("async call <= 0.25x a memcpy of the state", fast["call"][2], 0.25)]
    lines = ["| target | measured | met |", "|---|---:|---|"]
    lines += [f"| {name} | {v:.3f}x | {'yes' if v <= limit else 'NO'} |" for name, v, limit in checks]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--every", type=int, default=4, help="steps between checkpoints (K)")
    parser.add_argument("--checkpoints", type=int, default=1, help="checkpoints per loop (C)")
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS), help="GPT-2 size (tiny: a smoke test)")
    parser.add_argument("--write", type=pathlib.Path, default=None, help="append/replace the section in this file")
    args = parser.parse_args()
    start = time.perf_counter()
    rows, facts = run(args.rounds, args.every, args.checkpoints, args.preset)
    text = (f"{SECTION}\n\n{time.strftime('%Y-%m-%d %H:%M')}, {time.perf_counter() - start:.0f} s: "
            f"`python benches/train_loop.py --rounds {args.rounds} --every {args.every} --checkpoints "
            f"{args.checkpoints}`\n\nMachine: {machine_description(ROOT / 'benches')}. {facts}, AdamW, batch 1 x {SEQ} tokens, torch threads {torch.get_num_threads()}.\n\n"
            f"{table(rows)}\n\n{targets(rows)}\n")
    print(text)
    if args.write is not None:
        old = args.write.read_text() if args.write.exists() else ""
        if SECTION in old:
            head, _, rest = old.partition(SECTION)
            tail = rest[rest.find("\n## ", 1):] if "\n## " in rest[1:] else ""
            old = head.rstrip() + "\n\n" + text + tail
        else:
            old = old.rstrip() + "\n\n" + text
        args.write.write_text(old)


if __name__ == "__main__":
    main()

"""What ``fastckpt.CheckpointManager`` costs a training loop, and how fast it restores from RAM.

Rows, all measured in the same run (rounds alternated, medians of per-round ratios):

- **loop overhead**: ``--steps`` training steps of an MLP (``--width``, 8 layers, AdamW; the state is printed) with
  ``mgr.step(n)`` and ``every_n_steps=1`` (every step committed in the memory tier under ``/dev/shm`` before
  ``step()`` returns, the durable copy in the background), against the same steps without checkpointing. Ratio =
  with / without, per round.
- **restore from the memory tier**: ``mgr.restore()`` of that state from ``/dev/shm`` (read, crc32c of every byte,
  applied into the live model and optimizer), against a memcpy of the same tensors into preallocated memory (the
  floor of any restore). Ratio = memcpy seconds / restore seconds (1.0 = as fast as a memcpy).
- **continuous mode**: ``continuous=True`` over ``--steps`` steps: the median number of steps and seconds between
  consecutive saves (each starts once the previous one is durable).
- **store read per step**: what the multi-process agreement costs each ``step()``: one ``check`` of a key on a
  ``TCPStore`` served by this process (median microseconds over 2000 reads).

Usage::

    python benches/recovery_bench.py [--rounds 5] [--steps 20] [--width 1024]
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import fastckpt  # noqa: E402
from benches._measure import machine_description  # noqa: E402


def build(width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    model(batch).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [*model.state_dict().values()] + [v for s in opt.state.values() for v in s.values()]


def loop(model, opt, batch, steps: int, mgr=None, start: int = 0) -> float:
    began = time.perf_counter()
    for step in range(start, start + steps):
        train(model, opt, batch)
        if mgr is not None:
            mgr.step(step + 1)
    return time.perf_counter() - began


def store_read_us() -> float:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    times = []
    for _ in range(2000):
        began = time.perf_counter()
        store.check(["fastckpt/manager/1/event/0"])
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    base = pathlib.Path("/dev/shm") if pathlib.Path("/dev/shm").is_dir() else pathlib.Path(tempfile.gettempdir())
    work = pathlib.Path(tempfile.mkdtemp(prefix="fastckpt-recovery-bench-"))
    memory = base / f"fastckpt-recovery-bench-{work.name}"
    model, opt = build(args.width)
    batch = torch.randn(64, args.width)
    train(model, opt, batch)  # the Adam moments exist
    tensors = state_tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(machine_description(work))
    print(f"state: {nbytes / 1e6:.1f} MB (8 x Linear({args.width}, {args.width}) + AdamW), {args.steps} steps a round, "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}")
    try:
        t0 = time.perf_counter()
        ratios, plain_s, managed_s, costs = [], [], [], []
        step = 1
        for r in range(args.rounds):
            mgr = fastckpt.CheckpointManager(work / "proj", model, opt, every_n_steps=1, memory=memory, keep=1)
            order = ["plain", "managed"] if r % 2 == 0 else ["managed", "plain"]
            times = {}
            for kind in order:
                times[kind] = loop(model, opt, batch, args.steps, mgr if kind == "managed" else None, step)
                step += args.steps
            mgr.wait()
            costs.append(mgr.schedule.cost)
            mgr.close(clear_memory=False)
            ratios.append(times["managed"] / times["plain"])
            plain_s.append(times["plain"] / args.steps)
            managed_s.append(times["managed"] / args.steps)

        print(f"loop rounds done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        restore_ratios, restore_s, memcpy_s = [], [], []
        scratch = [torch.empty_like(t) for t in tensors]
        for d, s in zip(scratch, tensors):
            d.copy_(s)
        for r in range(args.rounds):
            fresh_model, fresh_opt = build(args.width)
            train(fresh_model, fresh_opt, batch)
            mgr = fastckpt.CheckpointManager(work / "proj", fresh_model, fresh_opt, every_n_steps=1, memory=memory)
            times = {}
            for kind in (["memcpy", "restore"] if r % 2 == 0 else ["restore", "memcpy"]):
                began = time.perf_counter()
                if kind == "memcpy":
                    for d, s in zip(scratch, tensors):
                        d.copy_(s)
                else:
                    mgr.restore()
                    assert mgr.restored_from == "memory"
                times[kind] = time.perf_counter() - began
            mgr.close(clear_memory=False)
            restore_ratios.append(times["memcpy"] / times["restore"])
            restore_s.append(times["restore"])
            memcpy_s.append(times["memcpy"])

        print(f"loop and restore rounds done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        shutil.rmtree(memory, ignore_errors=True)
        mgr = fastckpt.CheckpointManager(work / "cont", model, opt, continuous=True, memory=memory, keep=1)
        saves = []
        began = time.perf_counter()
        for n in range(1, 2 * args.steps + 1):
            train(model, opt, batch)
            if mgr.step(n):
                saves.append(time.perf_counter() - began)
        mgr.close()
        print(f"continuous done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        gaps = [b - a for a, b in zip(saves, saves[1:])]
        store_us = store_read_us()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)

    med = statistics.median
    print()
    print("| row | fastckpt | reference | ratio (median of rounds) |")
    print("|---|---:|---:|---:|")
    print(f"| loop, every_n_steps=1, memory tier (s/step) | {med(managed_s):.4f} | {med(plain_s):.4f} (no "
          f"checkpointing) | {med(ratios):.2f}x time |")
    print(f"| save blocking in step() (s, memory-tier commit) | {med(costs):.4f} | | |")
    print(f"| restore from the memory tier, crc32c checked (s) | {med(restore_s):.4f} | {med(memcpy_s):.4f} (memcpy "
          f"of the state) | {med(restore_ratios):.2f}x memcpy speed |")
    print(f"| continuous mode: steps between saves | {med(mgr.schedule.intervals) if mgr.schedule.intervals else 0:g}"
          f" | | {med(gaps) if gaps else 0:.3f} s between saves |")
    print(f"| store read per step (us, multi-process agreement) | {store_us:.1f} | | |")


if __name__ == "__main__":
    main()

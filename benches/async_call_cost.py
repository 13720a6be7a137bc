"""What ``save_state(..., async_save=...)`` costs at the call, against a memcpy of the state, by mode.

The issue's model: 8 ``nn.Linear(2048, 2048)`` and its AdamW after one step (a 403 MB state: 134 MB of
parameters, twice that of Adam moments). Per round, alternated (benches._measure.round_order: every pair in both orders): ``memcpy``
(every tensor of the state copied once into preallocated memory, as a snapshot does), and the call of each mode
(``True``: write guards where the kernel allows them, see ``fastckpt._io.async_save.write_guard``; ``True`` with the
guards off: every streamed tensor hashed at the call, the fallback; ``True`` with ``MERGE_GAP=0``: one registration per
tensor, as before the guards were shared; ``"stream"``: neither; ``"snapshot"``: a copy
into the reused pool). Each save is
waited for outside the timed call. Printed: medians over rounds of the call's seconds and of per-round ratios to
the same round's memcpy.

Usage::

    python benches/async_call_cost.py [--rounds 7] [--threads 0]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import fastckpt  # noqa: E402
from benches._measure import machine_description, round_order  # noqa: E402
from fastckpt._io.async_save import write_guard  # noqa: E402


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [*model.state_dict().values()] + [v for s in opt.state.values() for v in s.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="writer/hash threads (0 = min(8, cores))")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 2048)).square().mean().backward()
    opt.step()
    tensors = _state(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    scratch = [torch.empty_like(t) for t in tensors]
    for d, s in zip(scratch, tensors):  # fault the pages in once, as a reused pool has them
        d.copy_(s)

    def memcpy() -> float:
        start = time.perf_counter()
        for d, s in zip(scratch, tensors):
            d.copy_(s)
        return time.perf_counter() - start

    root = pathlib.Path(tempfile.mkdtemp(prefix="fastckpt-call-cost-"))

    def call(mode: object, guards: bool = True, merge_gap: int = write_guard.MERGE_GAP) -> float:
        write_guard.ENABLED, write_guard.MERGE_GAP = guards, merge_gap
        start = time.perf_counter()
        handle = fastckpt.save_state(model, opt, output_dir=root / str(mode), async_save=mode, durable=False,
                                     threads=args.threads)
        seconds = time.perf_counter() - start
        handle.wait()
        write_guard.ENABLED, write_guard.MERGE_GAP = True, default_gap
        return seconds

    default_gap = write_guard.MERGE_GAP

    guarded = write_guard.WriteGuard.open()
    if guarded is not None:
        guarded.close()
    contenders = {"memcpy": memcpy, "async_save=True": lambda: call(True),
                  "async_save=True, one guard per tensor (MERGE_GAP=0)": lambda: call(True, merge_gap=0),
                  "async_save=True, guards off (hash at the call)": lambda: call(True, guards=False),
                  'async_save="stream"': lambda: call("stream"), 'async_save="snapshot"': lambda: call("snapshot")}
    first = {n: fn() for n, fn in contenders.items()}  # warm-up: pool allocated, pages faulted, huge pages asked for
    names = list(contenders)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in round_order(names, r):
            seconds[n].append(contenders[n]())
    print(f"state: {nbytes / 1e6:.0f} MB; {args.rounds} rounds; {machine_description(root)}")
    print("| contender | call s (median) | x memcpy (median of per-round ratios) |")
    print("|---|---|---|")
    for n in names:
        ratio = statistics.median(a / b for a, b in zip(seconds[n], seconds["memcpy"]))
        print(f"| {n} | {statistics.median(seconds[n]):.4f} | {ratio:.3f}x |")
    print(f"- the warm-up's first async_save=True (the state's 4 KiB pages, before the first save's guards asked "
          f"the kernel for huge pages): {first['async_save=True']:.4f} s = "
          f"{first['async_save=True'] / first['memcpy']:.3f}x the warm-up's memcpy")
    print(f"- write guards: {'on' if guarded is not None else 'unavailable (' + str(write_guard._refused) + ')'}; "
          f"load average after the run {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

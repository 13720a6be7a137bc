"""The GPU half of the training-loop benchmark (run by benches/cuda_check.py on a machine with CUDA).

A GPT-style model of ``--gb`` GB of state (fp32 weights + AdamW moments) trains on the GPU; the checkpoint is taken
between two steps. Every time is measured with CUDA events on the caller's stream (``elapsed_time``), never with
``torch.cuda.synchronize()``, which would also wait for the side stream's copies and hide what is measured.

Per contender, alternated each round (medians):

- ``call s``: how long the checkpoint call blocked the host.
- ``fwd+bwd ms``: the forward and backward pass right after the call (an async save must add nothing to it).
- ``step ms``: the ``optimizer.step()`` right after the call, its wait for the copies included.
- ``stall ms``: that step minus the baseline step; target: <= max(0, copy time - fwd+bwd time) + 5 ms.
- ``d2h GB/s``: the state's device-to-host copy into pinned memory on its own (target >= 40 GB/s on an H200).

Contenders: no checkpoint, fastckpt async stream (``async_save="stream"``: side-stream copies, the step waits on an
event), fastckpt async (``async_save=True``: the same copies, the caller's stream waits for them),
fastckpt async snapshot (``async_save="snapshot"``), and DCP ``async_save`` with its pinned ``DefaultStager``
(where this torch has it; it needs a process group, made here with gloo and one process).
"""

from __future__ import annotations

import pathlib
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["time_train_loop"]


def _timed_on_stream(fn: Callable[[], Any]) -> float:
    """Milliseconds of ``fn``'s work on the current stream (events; waits only for that stream)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _dcp_saver(model: Any, optimizer: Any, folder: pathlib.Path) -> Callable[[pathlib.Path], Callable[[], Any]] | None:
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict import get_state_dict
    except ImportError:
        return None
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{folder / 'pg'}", rank=0, world_size=1)
    stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=True))

    def save(path: pathlib.Path) -> Callable[[], Any]:
        msd, osd = get_state_dict(model, optimizer)
        response = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(path), async_stager=stager)
        upload = getattr(response, "upload_completion", response)
        return upload.result

    return save


def time_train_loop(model: Any, optimizer: Any, folder: pathlib.Path, rounds: int) -> list[str]:
    """Markdown lines of the GPU training-loop table (see the module docs)."""
    import torch

    import fastckpt

    vocab = model.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(0)
    batch = torch.randint(0, vocab, (4, 512), device="cuda", generator=g)

    def fwd_bwd() -> None:
        _, loss = model(batch, targets=batch)
        loss.backward()

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    tensors = [*{t.data_ptr(): t for t in model.state_dict().values()}.values()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if v.numel() > 1]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def d2h() -> None:
        at = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            pinned[at : at + n].copy_(t.detach().reshape(-1).view(torch.uint8), non_blocking=True)
            at += n

    savers: dict[str, Callable[[pathlib.Path], Callable[[], Any] | None] | None] = {
        "no checkpoint": None,
        "fastckpt async stream": lambda p: fastckpt.save_state(model, optimizer, output_dir=p,
                                                               async_save="stream").wait,
        "fastckpt async": lambda p: fastckpt.save_state(model, optimizer, output_dir=p, async_save=True).wait,
        "fastckpt async snapshot": lambda p: fastckpt.save_state(model, optimizer, output_dir=p,
                                                                 async_save="snapshot").wait,
    }
    try:
        dcp_save = _dcp_saver(model, optimizer, folder)
    except Exception as exc:  # noqa: BLE001 - DCP is a contender, not a requirement: report and go on
        print(f"DCP async_save left out: {type(exc).__name__}: {exc}", flush=True)
        dcp_save = None
    if dcp_save is not None:
        savers["DCP async_save (pinned DefaultStager)"] = dcp_save
    for _ in range(2):  # warm-up: kernels, allocator, pools, stagers
        fwd_bwd()
        step()
        for save in savers.values():
            if save is not None:
                wait = save(folder / "warmup")
                if wait is not None:
                    wait()
                shutil.rmtree(folder / "warmup", ignore_errors=True)
    rows: dict[str, dict[str, list[float]]] = {n: {"call": [], "fb": [], "step": [], "d2h": []} for n in savers}
    for r in range(rounds):
        names = list(savers)
        names = names[r % len(names):] + names[: r % len(names)]
        for name in names:
            out = folder / "out"
            copy_ms = _timed_on_stream(d2h)
            save = savers[name]
            t0 = time.perf_counter()
            wait = save(out) if save is not None else None
            call = time.perf_counter() - t0
            fb = _timed_on_stream(fwd_bwd)
            st = _timed_on_stream(step)
            if wait is not None:
                wait()
            shutil.rmtree(out, ignore_errors=True)
            m = rows[name]
            m["call"].append(call)
            m["fb"].append(fb)
            m["step"].append(st)
            m["d2h"].append(copy_ms)
    base = {k: statistics.median(v) for k, v in rows["no checkpoint"].items()}
    copy_ms = statistics.median(x for m in rows.values() for x in m["d2h"])
    allowed = max(0.0, copy_ms - base["fb"]) + 5.0
    lines = [f"GPU training loop: {nbytes / 1e9:.2f} GB of state, batch 4 x 512 tokens; d2h copy of the state "
             f"{copy_ms:.1f} ms ({nbytes / 1e6 / copy_ms:.1f} GB/s, target >= 40); baseline fwd+bwd "
             f"{base['fb']:.1f} ms, step {base['step']:.1f} ms; allowed stall max(0, copy - fwd+bwd) + 5 ms = "
             f"{allowed:.1f} ms. {rounds} rounds, medians.", "",
             "| contender | call s | fwd+bwd ms | added fwd+bwd ms | step ms | stall ms | stall target met |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name, m in rows.items():
        call, fb, st = (statistics.median(m[k]) for k in ("call", "fb", "step"))
        stall = st - base["step"]
        met = "" if name == "no checkpoint" else ("yes" if stall <= allowed else "NO")
        lines.append(f"| {name} | {call:.4f} | {fb:.1f} | {fb - base['fb']:+.1f} | {st:.1f} | {stall:+.1f} | {met} |")
    return lines

"""The CUDA half of a streaming async save (:mod:`fastckpt._io.async_save.stream`): device-to-host copies on a side stream.

Every tensor to save is copied on its device's side stream (which first waits for the caller's stream, so it copies
the values as of the call) into one slot of the pinned host buffer pool, in chunks of
:data:`~fastckpt._io.async_save.snapshot.CUDA_CHUNK_BYTES` with an event after each, so the writer writes chunk k while chunk
k+1 is still being copied (:meth:`fastckpt._io.async_save.snapshot.Snapshot.ready`). The copies are grouped by optimizer (the
call-time clones first, then optimizer 0's tensors, ...), with one more event after each group: the event that
optimizer's step pre-hook makes the current stream wait for. The caller's stream never waits for the copies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fastckpt._io.async_save.host_pool import HostBufferPool, aligned
from fastckpt._io.async_save.snapshot import CUDA_CHUNK_BYTES, Snapshot, _Copy
from fastckpt._io.device_load import side_stream
from fastckpt._io.files import SavePlan

__all__ = ["start_copies"]


def _group(d: Any) -> int:
    """Call-time clones (no owner) first, then by the first optimizer owning the tensor."""
    return min(d.owners) if d.owners else -1


@torch.no_grad()
def start_copies(plan: SavePlan, everything: list[Any], pool: HostBufferPool
                 ) -> tuple[SavePlan, Snapshot, dict[int, list[tuple[Any, Any]]]]:
    """Enqueue the copies of ``everything`` (``_Deferred`` entries of the plan) into a pool slot.

    Returns:
        ``(plan over the host copies, the snapshot to gate the writer with, {optimizer: [(device, event)]})``; the
        snapshot's slot goes back to the pool when the save ends (``StreamingSave.close``).
    """
    total = sum(aligned(d.nbytes) for d in everything)
    slot = pool.acquire(total)
    try:
        return _copy(plan, everything, slot, total)
    except BaseException:
        pool.release(slot)
        raise


def _copy(plan: SavePlan, everything: list[Any], slot: Any, total: int
          ) -> tuple[SavePlan, Snapshot, dict[int, list[tuple[Any, Any]]]]:
    assert slot.buffer is not None
    copies, at = [], 0
    views: dict[int, torch.Tensor] = {}
    events: dict[int, list[tuple[Any, Any]]] = {}
    order = sorted(everything, key=lambda d: (_group(d), d.id))
    for device in {d.tensor.device for d in order if d.tensor.device.type == "cuda"}:
        side_stream(device).wait_stream(torch.cuda.current_stream(device))
    for k, d in enumerate(order):
        view = slot.buffer[at : at + d.nbytes]
        views[d.id] = view.view(d.tensor.dtype).view(d.tensor.shape)
        if d.tensor.device.type != "cuda":
            views[d.id].copy_(d.tensor)
        else:
            side = side_stream(d.tensor.device)
            with torch.cuda.stream(side):
                src = d.tensor.detach()
                src = src if src.is_contiguous() else src.contiguous()
                flat = src.reshape(-1).view(torch.uint8)
                for a in range(0, d.nbytes, CUDA_CHUNK_BYTES):
                    b = min(d.nbytes, a + CUDA_CHUNK_BYTES)
                    view[a:b].copy_(flat[a:b], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(side)
                    copies.append(_Copy(at + a, at + b, event))
                d.tensor.record_stream(side)  # its memory must not be reused before the side stream read it
            after = order[k + 1] if k + 1 < len(order) else None
            if after is None or _group(after) != _group(d) or after.tensor.device != d.tensor.device:
                event = torch.cuda.Event()
                event.record(side)
                for j in d.owners:  # call-time clones are private: nothing needs to wait for them
                    events.setdefault(j, []).append((d.tensor.device, event))
        at += aligned(d.nbytes)
    ids = {d.name: d.id for d in everything}
    parts = [dataclasses.replace(p, tensors={n: views.get(ids.get(f"{p.name}:{n}", -1), t)
                                             for n, t in p.tensors.items()}) for p in plan.parts]
    plan = dataclasses.replace(plan, parts=parts)
    return plan, Snapshot(plan, slot, total, copies), events

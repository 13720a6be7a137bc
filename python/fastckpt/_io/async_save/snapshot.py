"""Snapshots: a :class:`~fastckpt._io.files.SavePlan` whose tensors are copied into a reused host buffer.

An async save must write the values as of the call while training goes on updating the parameters in place, and a
GPU tensor must reach host memory before the writer can stream it. :func:`snapshot_plan` does both: it copies every
tensor of the plan into one slot of a :class:`~fastckpt._io.async_save.host_pool.HostBufferPool` (at :data:`ALIGN`-aligned
offsets) and returns the same plan with those copies in place of the live tensors.

- CPU tensors are copied right away, in the caller (``Tensor.copy_``, which uses torch's intra-op threads);
  non-contiguous ones are gathered by the copy, so the writer streams plain contiguous memory.
- CUDA tensors are copied on a side stream per device, in chunks of :data:`CUDA_CHUNK_BYTES`, into the pool's
  pinned buffer (``non_blocking``), each chunk followed by an event. The side stream first waits for the caller's
  current stream (so it copies the latest values), and the caller's stream then waits for the side stream (so a
  later in-place update, e.g. ``optimizer.step()``, cannot overwrite a value before it was copied): the caller is
  not blocked by the copies at all. :meth:`Snapshot.ready` waits only for the chunks that a byte range needs, so the
  writer can write chunk k while chunk k+1 is still being copied; :meth:`Snapshot.wait_copies` waits for all.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fastckpt._format.dtypes import to_safetensors_dtype
from fastckpt._format.tensors import tensor_source
from fastckpt._io.async_save.host_pool import HostBufferPool, Slot, aligned
from fastckpt._io.device_load import side_stream
from fastckpt._io.files import SavePlan

__all__ = ["CUDA_CHUNK_BYTES", "Snapshot", "snapshot_plan", "has_device_tensors"]

#: Bytes per device-to-host copy (one event each): the granularity at which writing overlaps copying.
CUDA_CHUNK_BYTES = 64 << 20


@dataclass
class _Copy:
    """An asynchronous device-to-host copy into bytes ``[begin, end)`` of the slot, done when ``event`` is."""

    begin: int
    end: int
    event: Any  # torch.cuda.Event
    waited: bool = False


@dataclass
class Snapshot:
    """A plan whose tensors live in ``slot`` (views of its buffer), and the device copies still in flight.

    Attributes:
        plan: the plan to write; its tensors are views of ``slot.buffer`` (empty tensors stay as they were).
        slot: the pool slot holding the copies; release it once the plan is written.
        nbytes: bytes of the slot in use.
        copies: device-to-host copies (empty when the state is all on the CPU), in slot order.
    """

    plan: SavePlan
    slot: Slot
    nbytes: int
    copies: list[_Copy] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.copies.sort(key=lambda c: c.begin)
        self._ends = [c.end for c in self.copies]

    def wait_copies(self) -> None:
        """Block (GIL released by torch) until every device-to-host copy has landed in the slot."""
        for c in self.copies:
            if not c.waited:
                c.event.synchronize()
                c.waited = True

    def ready(self, spans: list[tuple[int, int]]) -> None:
        """Block until the bytes ``[address, address + length)`` of each span are in host memory.

        The writer calls this before it writes a chunk (``address`` is the chunk's source memory); spans outside
        the slot are ready by definition.
        """
        base = self.slot.data_ptr
        for address, length in spans:
            offset = address - base
            if not self.copies or offset < 0 or offset >= self.nbytes:
                continue
            i = bisect.bisect_right(self._ends, offset)
            while i < len(self.copies) and self.copies[i].begin < offset + length:
                c = self.copies[i]
                if not c.waited:
                    c.event.synchronize()
                    c.waited = True
                i += 1


def has_device_tensors(plan: SavePlan) -> bool:
    """Whether any tensor of ``plan`` lives off the CPU (and so needs a host copy before it is written)."""
    return any(isinstance(t, torch.Tensor) and t.device.type != "cpu" and t.numel()
               for part in plan.parts for t in part.tensors.values())


def _check(name: str, t: Any) -> None:
    """Raise now, in the caller, what the writer would raise later for this tensor."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized or t.is_meta:
        tensor_source(name, t)  # raises ValueError naming the tensor and what is wrong
    to_safetensors_dtype(t.dtype, name=name)  # raises DtypeError for dtypes the format cannot hold


def _copy_from_cuda(buffer: torch.Tensor, device: torch.device, entries: list[tuple]) -> list[_Copy]:
    """Enqueue the copies of ``entries`` (on ``device``) into ``buffer`` on the device's side stream."""
    caller = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(caller)
    copies = []
    with torch.cuda.stream(side):
        for _name, t, offset, nbytes in entries:
            src = t.detach()
            if src.is_conj():
                src = src.resolve_conj()
            if src.is_neg():
                src = src.resolve_neg()
            if not src.is_contiguous():
                src = src.contiguous()  # a temporary on the device, made on the side stream
            src_bytes = src.reshape(-1).view(torch.uint8)
            for a in range(0, nbytes, CUDA_CHUNK_BYTES):
                b = min(nbytes, a + CUDA_CHUNK_BYTES)
                buffer[offset + a : offset + b].copy_(src_bytes[a:b], non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
                copies.append(_Copy(offset + a, offset + b, event))
            t.record_stream(side)  # its memory must not be reused before the side stream has read it
    caller.wait_stream(side)  # later work on the caller's stream (in-place updates) waits for the copies
    return copies


@torch.no_grad()
def _copy_into(buffer: torch.Tensor, entries: list[tuple]) -> list[_Copy]:
    copies: list[_Copy] = []
    on_cuda: dict[torch.device, list[tuple]] = {}
    for entry in entries:
        if entry[1].device.type == "cuda":
            on_cuda.setdefault(entry[1].device, []).append(entry)
    for device, group in on_cuda.items():  # enqueued first, so they overlap the CPU copies below
        copies += _copy_from_cuda(buffer, device, group)
    for _name, t, offset, nbytes in entries:
        if t.device.type != "cuda":
            buffer[offset : offset + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
    return copies


def snapshot_plan(plan: SavePlan, pool: HostBufferPool, *, timeout: float | None = None,
                  on_slot: Callable[[], Any] | None = None) -> Snapshot:
    """Copy every tensor of ``plan`` into a slot of ``pool``; returns the plan over the copies.

    Waits for a free slot first (at most ``timeout`` seconds; that wait is what bounds saves in flight). CPU
    tensors are copied before this returns; CUDA copies are only enqueued (see the module docs).

    Args:
        plan: the plan of a save (its tensors are read, never changed).
        pool: where the copies go.
        timeout: seconds to wait for a free slot; None waits as long as it takes.
        on_slot: called once a slot is taken, before anything is copied; if it raises, the slot is given back
            and nothing is copied (an async save reports the failure of the save it waited for this way).

    Returns:
        A :class:`Snapshot`; release ``snapshot.slot`` to the pool when it is written.

    Raises:
        ValueError: a sparse, quantized or meta tensor (names it), raised before anything is copied.
        DtypeError: a dtype the format cannot hold (names the tensor).
        TimeoutError: no free slot within ``timeout``.
    """
    entries: list[list[tuple]] = []
    total = 0
    for part in plan.parts:
        mine = []
        for name, t in part.tensors.items():
            _check(name, t)
            nbytes = t.numel() * t.element_size()
            if nbytes:
                mine.append((name, t, total, nbytes))
                total += aligned(nbytes)
        entries.append(mine)
    slot = pool.acquire(total, timeout)
    try:
        if on_slot is not None:
            on_slot()
        copies = _copy_into(slot.buffer, [e for mine in entries for e in mine])
    except BaseException:
        pool.release(slot)
        raise
    parts = []
    for part, mine in zip(plan.parts, entries):
        views = {name: slot.buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
                 for name, t, offset, nbytes in mine}
        parts.append(dataclasses.replace(part, tensors={k: views.get(k, v) for k, v in part.tensors.items()}))
    return Snapshot(dataclasses.replace(plan, parts=parts), slot, total, copies)

"""Loading to a GPU through pinned bounce buffers.

A tensor that must land in CUDA memory is read from the file into a small pinned (page-locked) host buffer by the
core's parallel positional reads (``SafetensorsFile.read_ranges``, GIL released), then copied to the device with
``non_blocking=True`` on a side stream. There are :data:`BOUNCE_BUFFERS` buffers of :data:`BOUNCE_BYTES` each,
allocated and pinned once per process and reused by every load: while the device copies batch k out of one
buffer, the file is read into the other for batch k+1, so disk (or page cache) and PCIe work at the same time.
Small tensors share one batch; a large tensor is split into buffer-sized pieces.

The side stream first waits for the caller's current stream (earlier kernels may still read the destinations) and
every copy has landed when :func:`read_to_device` returns.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BOUNCE_BYTES", "BOUNCE_BUFFERS", "read_to_device", "bounce_buffers", "side_stream"]

#: Bytes of each pinned bounce buffer.
BOUNCE_BYTES = 64 << 20
#: Number of bounce buffers (2: one being read into while the other is copied to the device).
BOUNCE_BUFFERS = 2

_LOCK = threading.Lock()
_BUFFERS: list[torch.Tensor] = []


def bounce_buffers() -> list[torch.Tensor]:
    """The process's pinned bounce buffers (1-D uint8, :data:`BOUNCE_BYTES` each), allocated on first use.

    Raises:
        RuntimeError: CUDA is not available (pinning needs it).
    """
    with _LOCK:
        if not _BUFFERS:
            _BUFFERS.extend(torch.empty(BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True)
                            for _ in range(BOUNCE_BUFFERS))
        return _BUFFERS


@dataclass
class _Piece:
    file: Any  # the SafetensorsFile holding the tensor
    name: str
    offset: int  # first byte within the tensor
    nbytes: int
    dst: torch.Tensor  # 1-D uint8 view of the destination's bytes [offset, offset + nbytes)


def _owner_of(file: Any) -> dict[str, Any]:
    """``{tensor name: SafetensorsFile}``: a sharded optimizer file (``.files``) reads each name from its shard."""
    shards = getattr(file, "files", None) or [file]
    return {entry[0]: f for f in shards for entry in f.tensors()}


def _pieces(file: Any, targets: list[tuple[str, torch.Tensor]], staged: list) -> list[_Piece]:
    owner = _owner_of(file)
    sizes = {e[0]: e[4] - e[3] for f in set(owner.values()) for e in f.tensors()}
    pieces = []
    for name, dst in targets:
        want = dst.numel() * dst.element_size()
        if name not in owner:
            from fastckpt.errors import KeyMismatchError

            raise KeyMismatchError(f"{file.path}: no tensor named {name!r}")
        if sizes[name] != want:
            raise ValueError(f"{file.path}: tensor {name!r} is {sizes[name]} bytes but its destination "
                             f"({dst.dtype}, shape {list(dst.shape)}, {dst.device}) is {want} bytes")
        if want == 0:
            continue
        if dst.is_contiguous() and not dst.is_conj() and not dst.is_neg():
            flat = dst.detach().reshape(-1).view(torch.uint8)
        else:  # read into a contiguous temporary on the device, then copy_ into the strided destination
            tmp = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
            staged.append((tmp, dst))
            flat = tmp.reshape(-1).view(torch.uint8)
        for at in range(0, want, BOUNCE_BYTES):
            n = min(BOUNCE_BYTES, want - at)
            pieces.append(_Piece(owner[name], name, at, n, flat[at : at + n]))
    return pieces


def _batches(pieces: list[_Piece]) -> list[list[_Piece]]:
    """Consecutive pieces packed into batches of at most BOUNCE_BYTES."""
    batches: list[list[_Piece]] = []
    used = BOUNCE_BYTES
    for p in pieces:
        if used + p.nbytes > BOUNCE_BYTES:
            batches.append([])
            used = 0
        batches[-1].append(p)
        used += p.nbytes
    return batches


_SIDE_STREAMS: dict[torch.device, Any] = {}


def side_stream(device: torch.device) -> Any:
    """The device's one side stream (made on first use) for copies that must not block the caller's stream."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


@torch.no_grad()
def read_to_device(file: Any, targets: list[tuple[str, torch.Tensor]], *, threads: int = 0) -> None:
    """Fill CUDA tensors with stored tensors through the pinned bounce buffers (see the module docs).

    Args:
        file: an opened ``SafetensorsFile``, or a sharded file object with ``.files``.
        targets: ``(stored name, destination)``; each destination is a CUDA tensor of exactly the stored bytes
            (dtype and shape were checked by the caller's plan); strided destinations are filled through a
            contiguous device temporary.
        threads: reader threads (0 = min(8, cores)).

    Raises:
        KeyMismatchError: a name the file lacks. ValueError: a destination of another byte size (names both).
        OSError / TruncatedFileError: the read failed.
    """
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, dst in targets:
        by_device.setdefault(dst.device, []).append((name, dst))
    buffers = bounce_buffers()
    for device, mine in by_device.items():
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        caller, side = torch.cuda.current_stream(device), side_stream(device)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            pieces = _pieces(file, mine, staged)  # device temporaries are made on the side stream
        events: list[Any] = [None] * len(buffers)
        for k, batch in enumerate(_batches(pieces)):
            slot = k % len(buffers)
            if events[slot] is not None:
                events[slot].synchronize()  # the device copy out of this buffer is done (GIL released)
            buf = buffers[slot]
            by_file: dict[int, tuple[Any, list]] = {}
            at = 0
            for p in batch:
                by_file.setdefault(id(p.file), (p.file, []))[1].append((p.name, p.offset, buf[at : at + p.nbytes].numpy()))
                at += p.nbytes
            for f, ranges in by_file.values():
                f.read_ranges(ranges, threads=threads)
            with torch.cuda.stream(side):
                at = 0
                for p in batch:
                    p.dst.copy_(buf[at : at + p.nbytes], non_blocking=True)
                    at += p.nbytes
                events[slot] = torch.cuda.Event()
                events[slot].record(side)
        with torch.cuda.stream(side):
            for tmp, dst in staged:
                dst.copy_(tmp)
        caller.wait_stream(side)
        side.synchronize()  # the bounce buffers are free again and every destination holds its bytes

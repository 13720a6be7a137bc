"""Reading a rank's boxes of a fastckpt DCP folder into the load plan's destinations (the reader's data path):
every destination checked, the chunks read verified whole, then the boxes read in parallel batches (bounce buffers
for destinations that are not contiguous CPU memory, at most ``_BOUNCE_BYTES`` per batch) and committed; the
non-tensor values are set from the decoded JSON, never unpickled."""

from __future__ import annotations

import io
import math
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from fastckpt._format.tensors import destination_buffer
from fastckpt._io.dcp.files import BoxRead, read_boxes, verify_chunks

try:  # DCP's own walk (a private module); the same walk is in fastckpt.dcp.traverse for a torch without it
    from torch.distributed.checkpoint._traverse import set_element
except ImportError:  # pragma: no cover - exercised by tests/integrations/test_torch_compat.py in a subprocess
    from fastckpt.dcp.traverse import set_element

__all__ = ["read_own"]

#: bytes of bounce buffers (destinations that are not contiguous CPU memory) filled per round
_BOUNCE_BYTES = 256 << 20


def _set_object(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """Put a decoded non-tensor value where ``planner.load_bytes`` would, without unpickling anything."""
    fqn = item.dest_index.fqn
    if isinstance(planner, DefaultLoadPlanner):
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], value)
        else:
            planner.state_dict[fqn] = value
        return
    # Another planner only takes bytes: hand it the value serialized here, in memory, from the decoded JSON
    # (nothing read from the folder is unpickled).
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    planner.load_bytes(item, buf)


def read_own(reader: Any, plan: LoadPlan, planner: LoadPlanner, elsewhere: set[int]) -> dict:
    """Check every destination of ``plan``, then read the boxes not ``elsewhere`` (plan positions another rank
    reads for this one) and commit them.

    Args:
        reader: the :class:`fastckpt.dcp.StorageReader` (its parsed metadata, open files, counters, threads).
        plan, planner: DCP's local load plan and planner.
        elsewhere: plan positions not read here.

    Returns:
        ``{position: (item, destination)}`` of every tensor item of the plan.

    Raises:
        DtypeError, ShapeMismatchError: a destination that does not match the stored chunk (nothing filled).
        IntegrityError, OSError: a chunk that fails verification or cannot be read (nothing filled on a checksum
            mismatch: the chunks are verified before any box is read).
    """
    parsed = reader._parsed
    tensor_items: dict[int, tuple[ReadItem, torch.Tensor]] = {}
    for pos, item in enumerate(plan.items):
        if item.type == LoadItemType.BYTE_IO:
            continue
        dest = planner.resolve_tensor(item).detach()
        reader._check(item, dest)
        tensor_items[pos] = (item, dest)
    mine = [(item, dest) for pos, (item, dest) in tensor_items.items() if pos not in elsewhere]
    # every chunk a box is read from, summed whole, before anything is filled (a fetched s3 checkpoint was
    # summed whole as it came in: not again)
    if reader.verify and not reader.checked_whole:
        wanted: dict[str, set[str]] = {}
        for item, dest in mine:
            loc, sizes = parsed.locate(item.storage_index.fqn,
                                       tuple(int(o) for o in (item.storage_index.offset or ())))
            if loc.name not in wanted.setdefault(loc.file, set()):
                reader.verified_bytes += math.prod(sizes) * dest.element_size()
            wanted[loc.file].add(loc.name)
        verify_chunks(reader._files, reader._records or {}, wanted, threads=reader.threads)
    for item in plan.items:  # every check passed: nothing was filled before this point
        if item.type == LoadItemType.BYTE_IO:
            _set_object(planner, item, parsed.objects[item.storage_index.fqn])
    seen: set[tuple] = set()
    batch: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None, BoxRead]] = []
    bounce = 0
    for item, dest in mine:
        index = item.storage_index
        offsets = tuple(int(o) for o in (index.offset or ()))
        loc, chunk_sizes = parsed.locate(index.fqn, offsets)
        if dest.numel() == 0:
            planner.commit_tensor(item, dest)
            continue
        key = (dest.untyped_storage().data_ptr(), dest.storage_offset(), tuple(dest.stride()), loc,
               tuple(item.storage_offsets), tuple(item.lengths)) if dest.device.type == "cpu" else None
        if key is not None and key in seen:  # a tied destination already receives these bytes
            planner.commit_tensor(item, dest)
            continue
        if key is not None:
            seen.add(key)
        buf = destination_buffer(dest)
        tmp = None
        if buf is None:
            tmp = torch.empty(dest.shape, dtype=dest.dtype)
            buf = tmp.reshape(-1).view(torch.uint8).numpy()
            bounce += tmp.numel() * tmp.element_size()
        read = BoxRead(loc.file, loc.name, chunk_sizes, [int(o) for o in item.storage_offsets],
                       [int(n) for n in item.lengths], dest.element_size(), buf)
        batch.append((item, dest, tmp, read))
        if bounce >= _BOUNCE_BYTES:
            _flush(reader, batch, planner)
            batch, bounce = [], 0
    _flush(reader, batch, planner)
    return tensor_items


def _flush(reader: Any, batch: list, planner: LoadPlanner) -> None:
    read_boxes(reader._files, [b[3] for b in batch], threads=reader.threads)
    reader.read_bytes += sum(int(b[3].dest.nbytes) for b in batch)
    for item, dest, tmp, _ in batch:
        if tmp is not None:
            dest.copy_(tmp)
        planner.commit_tensor(item, dest)

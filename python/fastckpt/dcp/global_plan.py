"""The coordinator's merge of every rank's save plan, done over columns instead of DCP's per-item objects.

:func:`merge_save_plans` is a pure function from the per-rank plans to the global plans and the metadata, with the
output of DCP's ``DefaultSavePlanner._create_global_plan`` (``dedup_save_plans``, ``create_default_global_save_plan``,
``_validate_global_plan``) object for object: the same deduplication choices (DCP's smallest-plan rule and its tie
order), the same index hints, the same ``TensorStorageMetadata`` (properties and size of the first chunk seen, chunks
in plan order), the same errors. What differs is the work: DCP hashes every ``MetadataIndex`` several times,
copies every item twice through ``dataclasses.replace`` and checks chunk overlaps with a sweep that turns quadratic
when the chunks share the sweep dimension (an FSDP2 ``Shard(0)`` of a wider-than-tall matrix: every chunk spans the
widest dimension, so at 2816 ranks each such tensor made ~4 M pairwise checks). Here the keys are plain tuples,
the copies are made once, and a tensor's chunks are shown disjoint over int64 columns (numpy) along whichever
dimension separates them; only when that cannot show it (or a bound or the volume is wrong) does DCP's own check
run for that tensor, so the error messages are DCP's.
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap, Counter
from itertools import chain, compress
from operator import attrgetter, not_
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

__all__ = ["merge_save_plans"]

_SHARD = WriteItemType.SHARD
_BYTE_IO = WriteItemType.BYTE_IO
_new = object.__new__
_set = object.__setattr__
_OFFSETS = attrgetter("offsets")
_SIZES = attrgetter("sizes")
_INDEX = attrgetter("index")
_FQN = attrgetter("fqn")
_OFFSET = attrgetter("offset")


def merge_save_plans(all_plans: list[SavePlan], *, save_to_lowest_rank: bool = False,
                     flatten_state_dict: bool = False) -> tuple[list[SavePlan], Metadata]:
    """The global plans and metadata DCP's ``DefaultSavePlanner._create_global_plan`` makes of ``all_plans``.

    Args:
        all_plans: one ``SavePlan`` per rank, in rank order (not modified).
        save_to_lowest_rank: DCP's ``dedup_save_to_lowest_rank``: an item several ranks hold is written by the
            lowest of them (else by the one with the least planned bytes so far, DCP's default).
        flatten_state_dict: merge the plans' ``planner_data`` into the metadata, as DCP's flattening planner does.

    Returns:
        ``(global plans, metadata)``: equal to DCP's, index hints included (the ``index`` of every item's
        ``MetadataIndex``), pickling to the same bytes.

    Raises:
        ValueError: DCP's "Failed to validate global plan" (out-of-bounds or overlapping chunks, a tensor whose
            chunks do not fill it), with DCP's message.
        AssertionError: as DCP, for a non-shard item saved twice or a tensor item without a chunk.

    Example:
        >>> plans, metadata = merge_save_plans(gathered_plans)  # doctest: +SKIP
    """
    dropped = _dedup(all_plans, save_to_lowest_rank)
    md: dict[str, Any] = {}
    new_plans = []
    for plan, drop in zip(all_plans, dropped):
        items = plan.items if drop is None else list(
            compress(plan.items, map(not_, map(drop.__contains__, range(len(plan.items))))))
        new_items = []
        append = new_items.append
        for item in items:
            index = item.index
            fqn = index.fqn
            kind = item.type
            if kind is not _SHARD and fqn in md:
                raise AssertionError("item.index.fqn not in md")
            if kind is _BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                append(item)
                continue
            data = item.tensor_data
            if data is None:
                raise AssertionError("item.tensor_data is not None")
            tensor_md = md.get(fqn)
            if tensor_md is None:
                tensor_md = md[fqn] = TensorStorageMetadata(properties=data.properties, size=data.size, chunks=[])
            chunks = tensor_md.chunks
            offset = index.offset
            # what dataclasses.replace(item.index, index=n) and dataclasses.replace(item, index=...) make, field for
            # field (DCP's __init__ leaves a None offset to the class default; a given one is a private copy, so
            # the new index may hold it: it is in no other object of the output)
            new_index = _new(MetadataIndex)
            _set(new_index, "__dict__", {"fqn": fqn, "index": len(chunks)} if offset is None else
                 {"fqn": fqn, "index": len(chunks), "offset": offset})
            state = item.__dict__.copy()
            state["index"] = new_index
            new_item = _new(WriteItem)
            _set(new_item, "__dict__", state)
            append(new_item)
            chunk = data.chunk
            if chunk is None:
                raise AssertionError(f"""
                    Cannot create MD for tensor without bounds.
                    FQN: {fqn}
                """)
            chunks.append(chunk)
        new_plans.append(dataclasses.replace(plan, items=new_items))
    metadata = Metadata(md)
    if flatten_state_dict:
        merged = dict(ChainMap(*[p.planner_data for p in new_plans]))
        metadata = dataclasses.replace(metadata, planner_data=merged)
    errors: list[str] = []
    for key, value in md.items():
        if isinstance(value, TensorStorageMetadata) and len(value.size) and not _valid(value, len(new_plans) > 1):
            errors += _validate_global_plan(new_plans, Metadata({key: value}))
    if errors:
        summary = "; ".join(errors)
        if len(summary) > 500:
            summary = summary[:500] + "... (truncated)"
        raise ValueError(f"Failed to validate global plan: {summary}")
    return new_plans, metadata


def _dedup(all_plans: list[SavePlan], save_to_lowest_rank: bool) -> list[set[int] | None]:
    """Per plan, the positions of the items another plan writes (None: none), chosen as DCP's
    ``dedup_save_plans`` chooses.

    DCP walks every key (fqn, offset) in first-seen order and gives it to the holder with the least planned bytes
    so far, adding the key's bytes to that plan. A key only one plan holds always goes to that plan, and a key
    first seen at position i of plan h can only be held by plans h, h+1, ...: the only bytes of keys held once
    that count when it is decided are plan h's before position i. So only the keys held more than once are walked
    (found by counting, in C), with plan h's bytes before i and the bytes of the shared keys given so far; ``min``
    runs over the same set of plan numbers, built in the same order, so ties go the same way."""
    keys = [list(zip(map(_FQN, indices), map(_OFFSET, indices)))
            for indices in (list(map(_INDEX, plan.items)) for plan in all_plans)]
    counts = Counter(chain.from_iterable(keys))
    drop: list[set[int] | None] = [None] * len(all_plans)
    if len(counts) == sum(map(len, keys)):
        return drop  # every key once
    repeated = {key for key, n in counts.items() if n > 1}  # in two plans, or twice in one
    holders: dict[tuple[str, Any], list[tuple[int, int]]] = {}  # first-seen order; per plan its first position
    last: dict[tuple[str, Any], WriteItem] = {}
    is_repeated = repeated.__contains__
    for p, plan_keys in enumerate(keys):
        for i in compress(range(len(plan_keys)), map(is_repeated, plan_keys)):
            key = plan_keys[i]
            seen = holders.setdefault(key, [])
            if not seen or seen[-1][0] != p:
                seen.append((p, i))
            last[key] = all_plans[p].items[i]
    shared = {key for key, seen in holders.items() if len(seen) > 1}
    if not shared:
        return drop
    planned = [0] * len(all_plans)  # bytes of the shared keys given to each plan so far
    singles: dict[int, list[int]] = {}  # per first holder: its bytes of keys held once, by position
    for key, seen in holders.items():
        if len(seen) == 1:
            continue
        first, position = seen[0]
        plan_set: set[int] = set()
        for q, _ in seen:
            plan_set.add(q)
        if save_to_lowest_rank:
            chosen = min(plan_set)
        else:
            if first not in singles:
                singles[first] = _bytes_before(all_plans[first].items, keys[first], shared)
            before = singles[first][position]
            planned[first] += before
            chosen = min(plan_set, key=planned.__getitem__)
            planned[first] -= before
        planned[chosen] += _weight(last[key])
        for q, _ in seen:
            if q != chosen:
                if drop[q] is None:
                    drop[q] = set()
                drop[q].add(key)  # type: ignore[arg-type]
    for p, dropped_keys in enumerate(drop):  # DCP filters a plan by index: every occurrence of a dropped key goes
        if dropped_keys:
            drop[p] = set(compress(range(len(keys[p])), map(dropped_keys.__contains__, keys[p])))
    return drop


def _bytes_before(items: list[WriteItem], keys: list[tuple[str, Any]], shared: set[tuple[str, Any]]) -> list[int]:
    """DCP's planned bytes of one plan's keys held by no other plan, first seen before each position ``i``
    (``[i]``, ``len(items) + 1`` entries; a key weighs what the last item with it weighs): one pass per plan, so
    a plan of many shared keys (a replicated state) is not walked once per key."""
    last: dict[tuple[str, Any], WriteItem] = {}
    for key, item in zip(keys, items):
        if key not in shared:
            last[key] = item
    out = [0] * (len(keys) + 1)
    total = 0
    for i, key in enumerate(keys):
        out[i] = total
        if key in last:
            total += _weight(last.pop(key))  # counted at its first position only
    out[len(keys)] = total
    return out


def _weight(item: WriteItem) -> int:
    """DCP's dedup weight of an item, ``item.tensor_storage_size() or 1``: the bytes of its global size."""
    data = item.tensor_data
    if data is None:
        return 1
    numel = 1
    for n in data.size:
        numel *= n
    return numel * torch._utils._element_size(data.properties.dtype) or 1


def _valid(value: TensorStorageMetadata, check_volume: bool) -> bool:
    """Whether DCP's validation finds nothing wrong with this tensor's chunks (False: let DCP's check say what)."""
    chunks = value.chunks
    dims = len(value.size)
    count = len(chunks)
    if {dims} != set(map(len, map(_OFFSETS, chunks))) | set(map(len, map(_SIZES, chunks))):
        return False  # a chunk of other dimensions than its tensor: DCP's check says what (the columns would misalign)
    offsets = np.fromiter(chain.from_iterable(map(_OFFSETS, chunks)), np.int64, count * dims).reshape(count, dims)
    sizes = np.fromiter(chain.from_iterable(map(_SIZES, chunks)), np.int64, count * dims).reshape(count, dims)
    shape = np.array(value.size, dtype=np.int64)
    if (offsets < 0).any() or (sizes < 0).any() or (offsets + sizes > shape).any():
        return False
    if check_volume:
        volume = 1
        for n in value.size:
            volume *= n
        if int(np.prod(sizes, axis=1, dtype=np.int64).sum()) != volume:
            return False
    if len(chunks) < 2:
        return True
    full = (sizes > 0).all(axis=1)
    ends = offsets + sizes
    for e in np.flatnonzero(~full):  # DCP counts an empty box strictly inside another one as overlapping it
        touching = ((offsets[e] < ends) & (offsets < ends[e])).all(axis=1)
        if touching.any():
            return False
    return _disjoint(offsets[full], ends[full])


def _disjoint(offsets: np.ndarray, ends: np.ndarray) -> bool:
    """True when the (non-empty) boxes are shown pairwise disjoint: along some dimension their distinct intervals
    are disjoint and the boxes sharing each interval are disjoint in the other dimensions (recursively). A False
    may be wrong (boxes disjoint in a way this does not see); DCP's exact check then decides."""
    count, dims = offsets.shape
    if count < 2:
        return True
    for d in range(dims):
        starts, stops = offsets[:, d], ends[:, d]
        order = np.lexsort((stops, starts))
        starts, stops = starts[order], stops[order]
        new = np.empty(count, dtype=bool)
        new[0] = True
        new[1:] = (starts[1:] != starts[:-1]) | (stops[1:] != stops[:-1])
        first_starts, first_stops = starts[new], stops[new]
        if len(first_starts) > 1 and (first_starts[1:] < np.maximum.accumulate(first_stops[:-1])).any():
            continue  # distinct intervals overlap along d: try another dimension
        distinct = first_starts
        group = np.empty(count, dtype=np.int64)
        group[order] = np.cumsum(new) - 1
        if len(distinct) == count:
            return True
        if dims == 1:
            return False  # two boxes with one and the same interval
        rest = [e for e in range(dims) if e != d]
        order = np.argsort(group, kind="stable")
        for members in np.split(order, np.flatnonzero(np.diff(group[order])) + 1):
            if len(members) > 1 and not _disjoint(offsets[members][:, rest], ends[members][:, rest]):
                return False
        return True
    return False

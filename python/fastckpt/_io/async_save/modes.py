"""The ``async_save`` modes and which machinery each one uses; every mode commits exactly the state at the call
or raises (and commits nothing), within the limit stated for ``"stream"``.

- ``True`` (the default async mode): on the CPU, a streaming save (:mod:`fastckpt._io.async_save.stream`) whose call
  also pins every streamed tensor (:mod:`fastckpt._io.async_save.call_hashes`): write-protects its pages where the
  kernel allows (:mod:`fastckpt._io.async_save.write_guard`), else hashes it; any change after the call, tracked by
  torch or not (``p.data``, ``.numpy()`` views, other threads, syscalls), fails the save with
  :class:`~fastckpt.errors.ConcurrentModificationError`. With CUDA tensors, a snapshot: the device-to-host
  copies are only enqueued on a side stream, and the caller's stream waits for them on the device, so every
  later kernel on it (``p.data.mul_`` included) runs after the copies (the host is not blocked).
- ``"stream"``: the streaming save without the hashes (the call copies nothing it need not copy). Its one limit:
  writes that bypass torch's version counters (``p.data``, ``.numpy()`` views, raw pointers), made after the call
  and before the tensor is written, are not detected and end up in the checkpoint.
- ``"snapshot"``: the whole state is copied into the host buffer pool at the call (:mod:`fastckpt._io.async_save.writer`).

Over ``s3://`` every mode is a snapshot: the upload (minutes, on a slow link) then reads only the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastckpt._io.files import SavePlan

__all__ = ["MODES", "check_mode", "start_async"]

#: The values ``async_save`` takes.
MODES = (False, True, "stream", "snapshot")


def check_mode(async_save: Any) -> None:
    """Raise ValueError unless ``async_save`` is one of :data:`MODES`."""
    if not any(async_save is m or (isinstance(m, str) and async_save == m) for m in MODES):
        raise ValueError(f"async_save must be False, True, 'stream' or 'snapshot', got {async_save!r}")


def _plan_bytes(plan: SavePlan) -> int:
    return sum(t.numel() * t.element_size() for part in plan.parts for t in part.tensors.values())


def start_async(plan: SavePlan, optimizers: list[Any], target: Path | str, mode: bool | str, *,
                write: Callable[..., Any], budget: int | str | None = None, auto_named: bool = False,
                after: Callable[[], Any] | None = None, snapshot_only: str | None = None) -> Any:
    """Start the async save of ``plan`` in ``mode`` (``True``, ``"stream"`` or ``"snapshot"``); returns its
    :class:`~fastckpt._io.async_save.writer.AsyncSave`.

    Args:
        plan: the save plan (live tensors).
        optimizers: the optimizers whose steps a streaming save guards.
        target: the checkpoint folder (absolute).
        write: as :func:`fastckpt._io.async_save.stream.submit_stream`.
        budget: ``host_memory_budget`` (bytes, ``"4GB"``, None): streaming saves only; with ``True`` and CUDA
            tensors (a snapshot) a budget below the state's bytes is refused.
        auto_named: skip the numbers of saves in flight (``checkpoint_N``).
        after: run on the writer thread after a successful commit (rotation).
        snapshot_only: every mode is a snapshot, for this reason (e.g. ``"over s3://"``: the writer uploads from
            the copy); a budget below the state's bytes is refused, as for CUDA tensors with ``True``.

    Raises:
        ValueError: a budget ``True`` cannot keep on CUDA; what the chosen machinery raises before copying.
    """
    from fastckpt._io.async_save.snapshot import has_device_tensors
    from fastckpt._io.async_save.stream import parse_budget, submit_stream
    from fastckpt._io.async_save.writer import submit

    if snapshot_only is not None:
        limit, need = parse_budget(budget), _plan_bytes(plan)
        if limit is not None and limit < need:
            raise ValueError(f"host_memory_budget of {limit:,} bytes is below the {need:,} bytes an async save "
                             f"{snapshot_only} copies at the call (every async mode is a snapshot there); raise "
                             "the budget, or save with async_save=False")
        mode = "snapshot"
    elif mode is True and has_device_tensors(plan):
        limit, need = parse_budget(budget), _plan_bytes(plan)
        if limit is not None and limit < need:
            raise ValueError(
                f"host_memory_budget of {limit:,} bytes is below the {need:,} bytes async_save=True copies from "
                "CUDA at the call; raise the budget, or pass async_save='stream' (writes that bypass torch's "
                "version counters are then not detected)"
            )
        mode = "snapshot"
    if mode == "snapshot":
        return submit(plan, target, write=write, blocking=False, auto_named=auto_named, after=after)
    return submit_stream(plan, optimizers, target, write=write, budget=budget, auto_named=auto_named, after=after,
                         hash_at_call=mode is True)

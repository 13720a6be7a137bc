"""The few collectives a multi-process save or load needs, on ``torch.distributed`` (gloo or nccl).

- :func:`gather_to_main`: every rank's small object (its RNG states) to the main process, which writes them all in
  the same atomic commit as the shared files, so a committed checkpoint never lacks a rank's file.
- :func:`on_main`: run the save on the main process only and broadcast its outcome; this broadcast is the barrier
  that ends a save: no rank returns before the checkpoint is committed, and every rank raises if it failed.
- :func:`agree`: every rank validates its part of a load; if any rank failed, every rank raises before any
  object changes.

With one process (or without an initialised process group) each is the plain local operation.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch.distributed as dist

from fastckpt.errors import CheckpointError

__all__ = ["is_distributed", "gather_to_main", "broadcast_from_main", "on_main", "agree", "side_group",
           "broadcast_outcome", "describe"]

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a process group of more than one process is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (a list in rank order); None on the other ranks."""
    if not is_distributed():
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not is_distributed():
        return obj
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def describe(exc: BaseException | None) -> str | None:
    """``"TypeName: message"`` of ``exc``, or None: what :func:`broadcast_outcome` sends."""
    return None if exc is None else _describe(exc)


_SIDE_GROUP: Any = None


def side_group() -> Any:
    """A gloo process group of every rank for the outcome of async saves, which writer threads broadcast while
    the main threads train on the default group. Made on first use, by every rank at the same call (a collective);
    None with one process."""
    global _SIDE_GROUP
    if not is_distributed():
        return None
    if _SIDE_GROUP is None:
        _SIDE_GROUP = dist.new_group(backend="gloo")
    return _SIDE_GROUP


def broadcast_outcome(message: str | None, group: Any) -> str | None:
    """Rank 0's ``message`` (None: success) on every rank, over ``group`` (from :func:`side_group`)."""
    if group is None:
        return message
    box = [message if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def on_main(fn: Callable[[], T], *, what: str) -> T:
    """Run ``fn`` on rank 0; every rank returns its result, or raises when it failed.

    Rank 0 re-raises its own exception; the other ranks raise :class:`~fastckpt.errors.CheckpointError` naming it.
    """
    if not is_distributed():
        return fn()
    result: Any = None
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # reported to every rank below, then re-raised here
            error = exc
    outcome = broadcast_from_main((result, None if error is None else _describe(error)))
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise CheckpointError(f"{what} failed on process 0: {outcome[1]}")
    return outcome[0]


def agree(error: BaseException | None, *, what: str) -> None:
    """Raise on every rank if any rank's ``error`` is set (the own exception where it happened)."""
    if not is_distributed():
        if error is not None:
            raise error
        return
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, None if error is None else _describe(error))
    if error is not None:
        raise error
    failed = [(rank, msg) for rank, msg in enumerate(reports) if msg is not None]
    if failed:
        rank, msg = failed[0]
        raise CheckpointError(f"{what} failed on process {rank}: {msg}; nothing was changed on any process")

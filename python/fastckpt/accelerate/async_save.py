"""``fastckpt.accelerate.save_state(..., async_save=...)``: one atomic commit on the main process, a handle on every
process.

The main process builds the plan and starts the background write (streaming, :mod:`fastckpt._io.async_save.stream`, or
a whole snapshot, :mod:`fastckpt._io.async_save.writer`) exactly as :func:`fastckpt.save_state` does. The other
processes start a background wait instead. When the main process's write ends, its writer thread broadcasts the
outcome over a gloo group of its own (:func:`fastckpt._io.group.distributed.side_group`, so it never interleaves with
the training's collectives); every process's handle then completes, or raises if the save failed. A failure before
the write starts is broadcast the same way, so no process waits forever.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastckpt._io.async_save.modes import start_async
from fastckpt._io.async_save.writer import AsyncSave, default_saver, finish_pending
from fastckpt._io.group.distributed import broadcast_outcome, describe, is_distributed, side_group
from fastckpt._io.storage.local.commit import claim_target, write_checkpoint
from fastckpt.errors import CheckpointError

__all__ = ["save_async"]

_NO_COPY = types.SimpleNamespace(call_bytes=0, buffer_ptr=0)  # what a handle reports on the other processes


def _is_main() -> bool:
    if not is_distributed():
        return True
    import torch.distributed as dist

    return dist.get_rank() == 0


def save_async(build: Callable[[], Any], rotate: Callable[[], None], target: Path, optimizers: list[Any], *,
               durable: bool, threads: int, budget: int | str | None, mode: bool | str) -> AsyncSave:
    """Start the async save of ``build()`` to ``target`` on every process; returns this process's handle.

    Args:
        build: makes the save plan (called on the main process only).
        rotate: removes old checkpoints after the commit (main process).
        optimizers: the optimizers whose steps are guarded (``mode=True``).
        mode: ``True``, ``"stream"`` or ``"snapshot"`` (see :mod:`fastckpt._io.async_save.modes`).
    """
    group = side_group()  # a collective on first use: every process is here
    if not _is_main():
        try:
            finish_pending(wait=True)
        except Exception:  # an earlier failure: the main process reports it; this save goes on
            pass

        def receive() -> Path:
            message = broadcast_outcome(None, group)
            if message is not None:
                raise CheckpointError(f"saving {target} failed on process 0: {message}")
            return target

        return default_saver().start(target, receive, blocking_seconds=0.0, stream=_NO_COPY)

    def write(plan: Any, where: Path, **kwargs: Any) -> Path:
        error: BaseException | None = None
        try:
            write_checkpoint(plan, where, durable=durable, threads=threads, **kwargs)
            rotate()
        except BaseException as exc:  # broadcast, then raised by this process's handle
            error = exc
        broadcast_outcome(describe(error), group)
        if error is not None:
            raise error
        return where

    try:
        finish_pending(wait=mode != "snapshot")
        plan = build()
        # the folder is claimed at the call (claim_target): one that takes no files fails here, as a sync save does.
        # Not with several processes: the others have returned their handles and go on into collectives, so the
        # main process raising alone here would leave them waiting; every process's handle raises it instead.
        return start_async(plan, optimizers, target, mode, write=write, budget=budget,
                           claim=None if is_distributed() else claim_target)
    except BaseException as exc:  # nothing was started: tell the other processes, whose handles wait
        broadcast_outcome(describe(exc), group)
        raise

"""The argument checks and the save paths behind :mod:`fastckpt.checkpoint` (its public functions stay there, each
one screen: resolve, plan, write, commit; load: resolve, open, plan, apply).

:func:`save` is the plan / begin / write / commit / rotate of :func:`fastckpt.save_state`, one path for every
backend (a local folder, an object store, a tiered save: they differ only behind the storage verbs); the
``_check_*`` functions and :func:`_as_list` validate the public arguments before anything is written or read.

May import: layers 0-4 (a public-layer module; :mod:`fastckpt.checkpoint` imports it, never the reverse).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fastckpt._io.async_save.modes import check_mode, writer_for
from fastckpt._io.async_save.writer import finish_pending
from fastckpt._io.group.distributed import check_timeout
from fastckpt._io.storage.base import Storage
from fastckpt._plan.save import build_save_plan
from fastckpt._plan.share import split_shared
from fastckpt._state.sharded import is_sharded
from fastckpt.checkpoint_sharded import save_sharded_state
from fastckpt.errors import OptionError, OptionTypeError

__all__: list[str] = []

_KIND_CHECKS = {
    "model": (lambda o: isinstance(o, torch.nn.Module), "a torch.nn.Module"),
    "optimizer": (lambda o: isinstance(o, torch.optim.Optimizer)
                  or (hasattr(o, "param_groups") and hasattr(o, "load_state_dict")), "a torch.optim.Optimizer"),
    "scheduler": (lambda o: not isinstance(o, (torch.optim.Optimizer, torch.nn.Module))
                  and hasattr(o, "state_dict") and hasattr(o, "load_state_dict"),
                  "an LR scheduler (an object with state_dict() and load_state_dict())"),
}


_DATA_PARALLEL = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


def _as_list(obj: Any, kind: str) -> list:
    """``obj`` as a list of ``kind`` objects (one, a list or tuple, or None for none).

    Raises:
        TypeError: an entry is not a ``kind`` (names its position and type; a path passed positionally is the
            usual cause).
    """
    if obj is None:
        return []
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    check, what = _KIND_CHECKS[kind]
    for i, item in enumerate(items):
        if not check(item):
            hint = " (pass folders as output_dir= / input_dir=)" if isinstance(item, (str, os.PathLike)) else ""
            raise OptionTypeError(f"{kind}[{i}] is a {type(item).__name__}, expected {what}{hint}")
    if kind == "model":  # DDP / DataParallel: the wrapped module, as accelerate's unwrap_model (no ``module.`` keys)
        items = [m.module if isinstance(m, _DATA_PARALLEL) else m for m in items]
    return items


def _check_flags(**flags: Any) -> None:
    """Each of ``flags`` is True or False: a truthy string (``model_only="no"``) would silently save or load
    something else than asked (an ``OptionTypeError`` naming the option, as the checkpoint manager's checks)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise OptionTypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def _check_common(threads: int) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise OptionTypeError(f"threads must be an int >= 0 (0 picks min(8, cores)), got {threads!r}")
    if threads < 0:
        raise OptionError(f"threads must be an int >= 0 (0 picks min(8, cores)), got {threads!r}")


def _check_save_args(model: Any, threads: int, step: int, total_limit: int | None) -> None:
    if model is None:
        raise OptionTypeError("model is None; pass the torch.nn.Module (or a list of them) to save")
    _check_common(threads)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise OptionError(f"step must be an int in [0, 2**63), got {step!r}")
    if total_limit is not None and (isinstance(total_limit, bool) or not isinstance(total_limit, int)
                                    or total_limit < 1):
        raise OptionError(f"total_limit must be an int >= 1 (or None to keep every checkpoint), got {total_limit!r}")


def _check_map_location(map_location: Any) -> None:
    if map_location is None:
        return
    try:
        device = torch.device(map_location)
    except (RuntimeError, TypeError) as exc:
        raise OptionError(f"map_location {map_location!r} is not a torch device: {exc}") from None
    if device.type == "meta":
        raise OptionError("map_location='meta' would load no data; use a real device or None")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"map_location={map_location!r} but CUDA is not available on this machine")


def _plan(model: Any, optimizer: Any, scheduler: Any, *, model_only: bool, step: int, max_shard_size: Any,
          compat: Any, trainable_only: bool, trainable_buffers: Sequence[str], dtype: Any, threads: int) -> Any:
    return build_save_plan(_as_list(model, "model"), _as_list(optimizer, "optimizer"), _as_list(scheduler, "scheduler"),
                           model_only=model_only, step=step, max_shard_size=max_shard_size, compat=compat,
                           trainable_only=trainable_only, trainable_buffers=tuple(trainable_buffers), dtype=dtype,
                           threads=threads)


def save_to(storage: Storage, model: Any, optimizer: Any, scheduler: Any, *, model_only: bool,
            total_limit: int | None, step: int, durable: bool, threads: int, max_shard_size: Any, compat: Any,
            async_save: bool | str, trainable_only: bool, trainable_buffers: Sequence[str], dtype: Any,
            share_unchanged: bool, timeout: float, host_memory_budget: Any) -> Any:
    """:func:`fastckpt.save_state` after ``resolve``, for every backend: plan, begin, write and commit (by the
    writer of the ``async_save`` mode, :mod:`fastckpt._io.async_save.modes`), then rotate; returns
    ``save.returned(...)`` of that (the folder or URL, an ``AsyncSave``, a tiered save's ``TieredSave``)."""
    _check_flags(model_only=model_only, durable=durable, trainable_only=trainable_only,
                 share_unchanged=share_unchanged)
    check_mode(async_save)
    _check_save_args(model, threads, step, total_limit)
    timeout = check_timeout(timeout)
    models = _as_list(model, "model")
    sharded = is_sharded(models)
    storage.check_save(sharded=sharded, async_save=async_save, share_unchanged=share_unchanged)
    writer = writer_for(async_save, optimizers=[] if model_only else _as_list(optimizer, "optimizer"),
                        budget=host_memory_budget, snapshot_only=storage.snapshot_only)
    # an in-order save (synchronous or streaming) first waits for the saves in flight (commits in call order, fresh
    # numbers); every save raises an earlier async save's unreported failure here, once
    finish_pending(wait=writer.in_order)
    save = storage.begin(model_only=model_only, step=step)
    try:
        if share_unchanged and compat is not None:
            raise ValueError("share_unchanged needs fastckpt's layout (shards and hard links); pass compat=None")
        if sharded:  # a sharded plan: every rank writes its shards through DCP
            return _save_sharded(models, optimizer, scheduler, storage=storage, model_only=model_only,
                                 total_limit=total_limit, step=step, durable=durable, threads=threads,
                                 max_shard_size=max_shard_size, compat=compat, async_save=async_save,
                                 trainable_only=trainable_only, dtype=dtype, share_unchanged=share_unchanged,
                                 timeout=timeout)
        plan = _plan(models, optimizer, scheduler, model_only=model_only, step=step,
                     max_shard_size=None if share_unchanged else max_shard_size, compat=compat,
                     trainable_only=trainable_only, trainable_buffers=trainable_buffers, dtype=dtype,
                     threads=threads)
        if share_unchanged:  # the storage links what equals its previous checkpoint (see fastckpt._plan.share)
            save.share(*split_shared(plan, models, max_shard_size=max_shard_size, threads=threads))

        def after() -> None:  # after a successful commit (on the writer thread for async saves)
            if total_limit is not None:
                storage.rotate(total_limit, model_only=model_only)

        result = writer.write(plan, save, options={"durable": durable, "threads": threads}, after=after)
    except BaseException:
        save.abort()  # drop what was staged (an async save's writer owns the save once started)
        raise
    return save.returned(result, total_limit=total_limit)


def _save_sharded(model: Any, optimizer: Any, scheduler: Any, *, storage: Storage, trainable_only: bool, dtype: Any,
                  share_unchanged: bool, timeout: Any, **kwargs: Any) -> Path | str:
    if trainable_only or dtype is not None or share_unchanged:
        raise ValueError("trainable_only, dtype and share_unchanged are not supported for sharded (DTensor / FSDP2) "
                         "models yet; save the full sharded state, then `fastckpt consolidate` it")
    return save_sharded_state(_as_list(model, "model"), _as_list(optimizer, "optimizer"),
                              _as_list(scheduler, "scheduler"), storage=storage, timeout=check_timeout(timeout),
                              **kwargs)

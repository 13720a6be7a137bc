"""The save behind :func:`fastckpt.accelerate.save_state`: what the Accelerator tracks, as one plan and one commit.

Layer 5 (public package, private module). May import every private layer and the sibling modules of
:mod:`fastckpt.accelerate`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from fastckpt._io.async_save.writer import AsyncSave
from fastckpt._io.group.distributed import gather_to_main, on_main
from fastckpt._io.storage.base import Storage
from fastckpt._plan.save import build_save_plan
from fastckpt._state.rng import rng_payload
from fastckpt.accelerate.fsdp import save_sharded_state
from fastckpt.accelerate.location import checkpoint_name
from fastckpt.accelerate.project import project_root

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "UNSET", "save_tracked"]

#: accelerate's ``save_model`` default; applies to fastckpt's layout (``compat="accelerate"`` is unsharded).
DEFAULT_MAX_SHARD_SIZE = "10GB"
#: ``max_shard_size`` not passed: :data:`DEFAULT_MAX_SHARD_SIZE` for fastckpt's layout, None for accelerate's
UNSET: Any = object()


def save_tracked(accelerator: Any, output_dir: Any, fsdp: str | None, *, model_only: bool, compat: str | None,
                 max_shard_size: Any, durable: bool, threads: int, trainable_only: bool,
                 trainable_buffers: Sequence[str], dtype: Any, share_unchanged: bool, timeout: float,
                 async_save: bool | str, host_memory_budget: Any, files: dict[str, str | bytes] | None,
                 after_commit: Callable[[Path], None] | None, storage: Storage) -> Path | AsyncSave | str:
    """Save everything ``accelerator`` tracks (checked arguments, every participating process calls it; see
    :func:`fastckpt.accelerate.save_with_files`): the main process opens the save in ``storage`` (the checkpoint's,
    or the project's: :mod:`fastckpt.accelerate.location`), the RNG states are gathered to it, it builds the plan
    (fastckpt's layout or ``compat="accelerate"``), writes and commits it (or hands it to the async writer) and
    rotates; every process advances ``ProjectConfiguration.iteration``. Returns the folder, the async handle, or
    the ``s3://`` URL."""
    name, location, number = on_main(lambda: checkpoint_name(accelerator, storage, output_dir is not None,
                                                             model_only=model_only),
                                     what="choosing the checkpoint folder", timeout=timeout)
    if fsdp == "SHARDED_STATE_DICT":
        return save_sharded_state(accelerator, storage, name, number, model_only=model_only, durable=durable,
                                  threads=threads, timeout=timeout)
    if max_shard_size is UNSET:
        max_shard_size = None if compat else DEFAULT_MAX_SHARD_SIZE
    elif compat and max_shard_size is not None:
        raise ValueError("compat='accelerate' writes an unsharded model.safetensors as Accelerator.save_state does; "
                         "pass max_shard_size=None")
    step = int(accelerator.step)
    target = Path(location).absolute()  # a local save's folder (hooks, async saves, share_unchanged: local only)
    models = list(accelerator._models)
    unwrapped = [accelerator.unwrap_model(m) for m in models]
    full_optimizers = None
    if fsdp == "FULL_STATE_DICT":  # gathered to the main process (every process takes part)
        from fastckpt._state.sharded_full import full_model_states, full_optimizer_states

        weights = full_model_states(unwrapped)
        full_optimizers = None if model_only else full_optimizer_states(unwrapped, list(accelerator._optimizers))
    elif compat:
        weights = [accelerator.get_state_dict(m, unwrap=False) for m in models]
    else:
        weights = [m.state_dict() for m in unwrapped]
    hooks = list(accelerator._save_model_state_pre_hook.values())
    if hooks:
        os.makedirs(target, exist_ok=True)
        for hook in hooks:
            hook(models, weights, str(target))
    rng = None
    if not model_only:
        if compat:
            from fastckpt._plan.accelerate_format import accelerate_rng_state, torch_save_bytes

            rng = gather_to_main(torch_save_bytes(accelerate_rng_state(step)), timeout=timeout)
        else:  # tensors travel as numpy arrays: torch's object collectives cannot unpickle tensors reliably
            tensors, metadata = rng_payload(step)
            gathered = gather_to_main(({k: v.cpu().numpy() for k, v in tensors.items()}, metadata), timeout=timeout)
            rng = None if gathered is None else [({k: torch.from_numpy(a) for k, a in t.items()}, m)
                                                 for t, m in gathered]

    optimizers, schedulers = list(accelerator._optimizers), list(accelerator._schedulers)
    plan_optimizers = full_optimizers if full_optimizers is not None else optimizers
    share_hooks: list = []  # share_unchanged: called with the folder once it is committed

    def build() -> Any:
        from fastckpt._plan.accelerate_format import build_accelerate_plan
        from fastckpt.accelerate.tracked_objects import add_tracked_objects

        if compat:
            plan = build_accelerate_plan(unwrapped, plan_optimizers, schedulers, model_only=model_only, step=step,
                                         model_states=weights, rng_pickles=rng)
        else:
            plan = build_save_plan(unwrapped, plan_optimizers, schedulers, model_only=model_only, step=step,
                                   max_shard_size=None if share_unchanged else max_shard_size, model_states=weights,
                                   rng_states=rng, trainable_only=trainable_only,
                                   trainable_buffers=tuple(trainable_buffers), dtype=dtype, threads=threads)
        for name, text in (files or {}).items():
            if name in plan.texts or any(p.name == name for p in plan.parts):
                raise ValueError(f"{name}: a file of the checkpoint's own layout; pick another name")
            plan.texts[name] = text
        if not model_only:
            plan.counts["processes"] = len(rng or [])
            add_tracked_objects(plan, accelerator, compat=bool(compat))
        if share_unchanged:
            from fastckpt._plan.share import plan_sharing, previous_checkpoint

            share_hooks.append(plan_sharing(plan, unwrapped, previous_checkpoint(project_root(accelerator), target),
                                             max_shard_size=max_shard_size, threads=threads))
        return plan

    def rotate(folder: Path | str = target) -> None:  # the committed checkpoint (the async writer: target)
        for hook in share_hooks:
            if hook is not None:
                hook(target)
        limit = accelerator.project_configuration.total_limit
        if output_dir is None and limit is not None:  # automatic naming: the oldest of this kind go
            storage.rotate(limit, model_only=model_only)
        if after_commit is not None:
            after_commit(folder)  # type: ignore[arg-type]  # a URL when the checkpoint is in object storage

    def write() -> Path | str:
        save = storage.begin(name, model_only=model_only, step=step)  # one commit of every process's files
        save.write(build(), durable=durable, threads=threads)
        path = save.commit().named  # the absolute folder, or the URL
        rotate(path)
        return path

    if async_save:
        from fastckpt.accelerate.async_save import save_async

        handle = save_async(build, rotate, target, [] if model_only else optimizers, durable=durable,
                            threads=threads, budget=host_memory_budget, mode=async_save)
        if not model_only:
            config = accelerator.project_configuration
            config.iteration = number + 1 if number is not None else config.iteration + 1
        return handle

    path = on_main(write, what=f"saving {location}", timeout=timeout)  # the outcome broadcast ends the save
    config = accelerator.project_configuration
    if not model_only:  # iteration counts full checkpoints; model-only snapshots are numbered apart
        config.iteration = number + 1 if number is not None else config.iteration + 1
    return path

"""FSDP2 under ``fastckpt.accelerate``: ``SHARDED_STATE_DICT`` saves and loads through torch.distributed.checkpoint
and the storage plugin (:mod:`fastckpt._plan.sharded_save` / ``sharded_load``); phase 1 of a ``FULL_STATE_DICT``
load is :func:`fastckpt._plan.full_load.plan_full`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastckpt._io.group.distributed import Session, on_main
from fastckpt._io.storage.local.numbering import rotate_checkpoints
from fastckpt._plan.full_load import plan_full
from fastckpt._plan.sharded_load import is_sharded_checkpoint, plan_sharded_load
from fastckpt._plan.sharded_save import save_sharded
from fastckpt.accelerate.project import choose_target, project_root
from fastckpt.checkpoint import LoadResult
from fastckpt.checkpoint_sharded import dcp_storage_reader, dcp_storage_writer
from fastckpt.errors import MissingStateError

__all__ = ["plan_full", "save_sharded_state", "load_sharded_state"]


def save_sharded_state(accelerator: Any, output_dir: Any, *, model_only: bool, durable: bool, threads: int,
                  timeout: float) -> Path:
    """FSDP2 SHARDED_STATE_DICT: every process writes its shards into one atomic commit."""
    from fastckpt.accelerate.tracked_objects import add_tracked_objects

    target, number = on_main(lambda: choose_target(accelerator, output_dir, model_only), what="choosing the checkpoint folder",
                             timeout=timeout)
    models = [accelerator.unwrap_model(m) for m in accelerator._models]
    for hook in accelerator._save_model_state_pre_hook.values():
        os.makedirs(target, exist_ok=True)
        hook(list(accelerator._models), [m.state_dict() for m in models], str(target))
    path = save_sharded(models, list(accelerator._optimizers), list(accelerator._schedulers), target=target,
                        model_only=model_only, step=int(accelerator.step), durable=durable, threads=threads,
                        timeout=timeout, writer_factory=dcp_storage_writer,
                        add_files=None if model_only else lambda plan: add_tracked_objects(plan, accelerator,
                                                                                           compat=False),
                        what="fastckpt.accelerate.save_state")
    limit = accelerator.project_configuration.total_limit
    if number is not None and limit is not None and int(accelerator.process_index) == 0:
        rotate_checkpoints(project_root(accelerator), limit, model_only=model_only)  # the kind just saved
    config = accelerator.project_configuration
    if not model_only:  # iteration counts full checkpoints; model-only snapshots are numbered apart
        config.iteration = number + 1 if number is not None else config.iteration + 1
    return path


def load_sharded_state(accelerator: Any, folder: Path, models: list, *, model_only: bool, strict: bool,
                  trust_pickle: bool, timeout: float) -> LoadResult:
    from fastckpt.accelerate.tracked_objects import plan_tracked_objects

    session = Session(f"fastckpt.accelerate.load_state from {folder}", timeout)
    error: BaseException | None = None
    try:
        if not is_sharded_checkpoint(folder):
            raise MissingStateError(f"{folder}: not a sharded checkpoint; FSDP2 SHARDED_STATE_DICT loads folders "
                                    "saved with SHARDED_STATE_DICT (switch state_dict_type to FULL_STATE_DICT "
                                    "to load single-file ones)")
    except Exception as exc:  # reported to every rank with the validation (plan_sharded_load's one round)
        error = exc
    plan = plan_sharded_load(folder, models, list(accelerator._optimizers), list(accelerator._schedulers),
                             model_only=model_only, strict=strict, session=session,
                             reader_factory=dcp_storage_reader,
                             rng_rank=None if model_only else int(accelerator.process_index),
                             extra=lambda load: plan_tracked_objects(load, folder, accelerator, layout="fastckpt",
                                                                     trust_pickle=trust_pickle),
                             failed=error)
    plan.apply()
    if plan.step is not None:
        accelerator.step = plan.step
    return LoadResult(plan.missing_keys, plan.unexpected_keys, plan.skipped)

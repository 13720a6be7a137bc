"""``fastckpt.accelerate.checkpoint_manager``: a :class:`fastckpt.CheckpointManager` over what an ``Accelerator``
tracks, for accelerate training loops: periodic saves, preemption saves (SIGTERM / SIGUSR1 at a step boundary,
then exit 0) and the memory tier, with accelerate's objects.

The manager gets the prepared models (DDP unwrapped), optimizers and LR schedulers in ``prepare`` order, then, as
registered objects in this order: every object given to ``accelerator.register_for_checkpointing`` (in its order)
and the GradScaler (mixed precision fp16), if there is one. Its checkpoints are the manager's
(``{project_dir}/checkpoints/checkpoint_{step}``, ``custom_checkpoint_{i}.safetensors``; see
:mod:`fastckpt.manager.state`), readable by :func:`fastckpt.load_state`; accelerate's dataloaders are not
checkpointed by the manager: register the data order (a sampler or ``StatefulDataLoader`` with ``state_dict()`` /
``load_state_dict()``) with ``accelerator.register_for_checkpointing``, or skip the batches already trained with
``accelerator.skip_first_batches`` from the restored step.

May import: every private layer and the public package (layer 5).
"""

from __future__ import annotations

import os
from typing import Any

from fastckpt.errors import OptionError, OptionTypeError

__all__ = ["checkpoint_manager"]


def checkpoint_manager(accelerator: Any, project_dir: str | os.PathLike[str] | None = None,
                       **kwargs: Any) -> Any:
    """A :class:`fastckpt.CheckpointManager` over everything ``accelerator`` tracks (see the module docs).

    Call it after ``accelerator.prepare(...)`` and ``accelerator.register_for_checkpointing(...)``, on every
    process, then ``restore()`` before the loop and ``step(n)`` after each optimizer step.

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare``.
        project_dir: the durable tier; None: the Accelerator's ``project_dir`` (``ProjectConfiguration``).
        **kwargs: the manager's options (``every_n_steps``, ``memory``, ``replicas``, ``keep``, ``remote``,
            ``preemption_signals``, ...; see :class:`fastckpt.CheckpointManager`).

    Returns:
        The manager (a context manager; ``close()`` it at the end).

    Raises:
        OptionError: (a ValueError) no ``project_dir`` here nor on the Accelerator; a bad manager option.
        OptionTypeError / TypeError: nothing prepared (no model), or a registered object without ``state_dict()``.
        NotImplementedError: DeepSpeed, FSDP, Megatron-LM or XLA (their engines keep their own state).

    Example:
        >>> model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        >>> accelerator.register_for_checkpointing(sampler)
        >>> with fastckpt.accelerate.checkpoint_manager(accelerator, "run", every_n_steps=100) as mgr:
        ...     for step in range(mgr.restore(), total_steps):
        ...         train_one_step()
        ...         mgr.step(step + 1)   # a SIGTERM: step saved durably, then exit 0
    """
    import fastckpt

    engine = str(getattr(accelerator, "distributed_type", "")).rsplit(".", 1)[-1]
    if engine in ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA"):
        raise NotImplementedError(f"fastckpt.accelerate.checkpoint_manager does not handle {engine} training (its "
                                  "engine keeps its own state); use fastckpt.accelerate.save_state")
    if project_dir is None:
        project_dir = getattr(accelerator, "project_dir", None)
        if project_dir is None:
            raise OptionError("project_dir=None and the Accelerator has no project_dir: pass one, or make the "
                              "Accelerator with "
                             "ProjectConfiguration(project_dir=...)")
    if not accelerator._models:
        raise OptionTypeError("the Accelerator has no prepared model: call accelerator.prepare(model, ...) first")
    mgr = fastckpt.CheckpointManager(project_dir, list(accelerator._models), list(accelerator._optimizers) or None,
                                     list(accelerator._schedulers) or None, **kwargs)
    objects = list(accelerator._custom_objects)
    if getattr(accelerator, "scaler", None) is not None:
        objects.append(accelerator.scaler)
    if objects:
        mgr.register_for_checkpointing(*objects)
    return mgr

"""What a save writes: the model-only policy, decided in Python before anything crosses into the core.

:func:`build_save_plan` turns live objects into a :class:`SavePlan`: the safetensors files (name, tensors,
metadata) and the small JSON files of one checkpoint. Tensors in a plan are the live tensors themselves (no
copies); the writer (:mod:`fastckpt._io.commit`) streams them to disk. With ``model_only`` only the model tensors
are collected: the optimizer and scheduler are never read.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fastckpt._format.codec import encode
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.layout import part_name, random_states_name
from fastckpt._state.model import collect_model_state, model_config_json
from fastckpt._state.optimizer import optimizer_payload, param_fqns
from fastckpt._state.rng import rng_payload
from fastckpt._state.scheduler import scheduler_class_name

__all__ = ["FilePart", "SavePlan", "build_save_plan"]


def _shard(plan: SavePlan, max_shard_size: int | str | None) -> SavePlan:
    """Split the model and optimizer parts of ``plan`` into Hugging Face shards (see :mod:`fastckpt._io.shards`)."""
    if max_shard_size is None:
        return plan
    from fastckpt._io.shards import parse_size, split_part

    limit = parse_size(max_shard_size)
    parts: list[FilePart] = []
    for part in plan.parts:
        if part.name.startswith(("model", "optimizer")):
            pieces, index = split_part(part, limit)
            parts += pieces
            plan.texts.update(index)
        else:
            parts.append(part)
    plan.parts = parts
    return plan


def build_save_plan(
    models: list[torch.nn.Module],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    *,
    model_only: bool,
    step: int = 0,
    max_shard_size: int | str | None = None,
    compat: str | None = None,
    model_states: list[dict[str, torch.Tensor]] | None = None,
    rng_states: list[tuple[dict[str, torch.Tensor], dict[str, str]]] | None = None,
) -> SavePlan:
    """Collect the files of a checkpoint (see :mod:`fastckpt._io.layout` for the names).

    Args:
        max_shard_size: split model and optimizer files larger than this (bytes, or ``"10GB"``) into
            ``{base}-0000k-of-0000N.safetensors`` + ``{base}.safetensors.index.json``; None keeps one file each.
        compat: None (fastckpt's layout) or ``"accelerate"`` (accelerate's exact files, pickles included;
            see :mod:`fastckpt._plan.accelerate_format`).
        model_states: state dicts to write instead of the models' own (accelerate's save hooks may edit them);
            optimizer fqns still come from ``models``.
        rng_states: ``rng_payload`` results per rank (``random_states_{rank}``); None: this process as rank 0.

    Raises:
        KeyMismatchError: an optimizer holds a parameter of no passed model.
        TypeError: state that cannot be stored without pickle (names its path).
        ValueError: an unknown ``compat``, a bad ``max_shard_size``, or ``max_shard_size`` with accelerate's
            layout (which is unsharded).
    """
    if compat is not None:
        if compat != "accelerate":
            raise ValueError(f"compat must be None or 'accelerate', got {compat!r}")
        if max_shard_size is not None:
            raise ValueError("compat='accelerate' writes an unsharded model.safetensors as Accelerator.save_state "
                             "does; pass max_shard_size=None")
        from fastckpt._plan.accelerate_format import build_accelerate_plan

        return build_accelerate_plan(models, optimizers, schedulers, model_only=model_only, step=step,
                                     model_states=model_states)
    if model_only:
        optimizers, schedulers = [], []
    plan = SavePlan(
        mode="model_only" if model_only else "full",
        step=step,
        counts={"models": len(models), "optimizers": len(optimizers), "schedulers": len(schedulers)},
    )
    states: list[Any] = list(models) if model_states is None else list(model_states)
    plan.counts["models"] = len(states)
    for i, m in enumerate(states):
        tensors, aliases = collect_model_state(m)
        plan.parts.append(FilePart(part_name("model", i, ".safetensors"), tensors,
                                   [("format", "pt"), *aliases.items()]))
    if models and (config := model_config_json(models[0])) is not None:
        plan.texts["config.json"] = config
    if model_only:
        return _shard(plan, max_shard_size)
    fqns = param_fqns(models)
    for j, opt in enumerate(optimizers):
        tensors, metadata = optimizer_payload(opt, fqns, label=part_name("optimizer", j, ""))
        plan.parts.append(FilePart(part_name("optimizer", j, ".safetensors"), tensors, list(metadata.items())))
    if schedulers:
        plan.counts["scheduler_classes"] = [scheduler_class_name(s) for s in schedulers]
    for k, sched in enumerate(schedulers):
        state = encode(sched.state_dict(), path=part_name("scheduler", k, ""))
        plan.texts[part_name("scheduler", k, ".json")] = json.dumps(state)
    for rank, (tensors, metadata) in enumerate(rng_states if rng_states is not None else [rng_payload(step)]):
        plan.parts.append(FilePart(random_states_name(rank), tensors, list(metadata.items())))
    return _shard(plan, max_shard_size)

"""What a save writes: the model-only policy, decided in Python before anything crosses into the core.

:func:`build_save_plan` turns live objects into a :class:`SavePlan`: the safetensors files (name, tensors,
metadata) and the small JSON files of one checkpoint. Tensors in a plan are the live tensors themselves (no
copies); the writer (:mod:`fastckpt._io.storage.local.commit`) streams them to disk. With ``model_only`` only the model tensors
are collected: the optimizer and scheduler are never read.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fastckpt._format.codec import encode
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.storage.local.layout import part_name, random_states_name
from fastckpt._state.hf_files import hf_model_files
from fastckpt._state.model import collect_model_state
from fastckpt._state.optimizer import optimizer_payload, param_fqns
from fastckpt._state.peft_adapter import ADAPTER_CONFIG, ADAPTER_FILE, adapter_config_json, adapter_state, is_peft_model
from fastckpt._state.rng import rng_payload
from fastckpt._state.scheduler import scheduler_class_name
from fastckpt._state.subclasses import refuse_subclasses
from fastckpt._state.trainable import split_state
from fastckpt.errors import OptionError

__all__ = ["FilePart", "SavePlan", "build_save_plan"]


def _shard(plan: SavePlan, max_shard_size: int | str | None) -> SavePlan:
    """Split the model and optimizer parts of ``plan`` into Hugging Face shards (see :mod:`fastckpt._io.storage.local.shards`)."""
    if max_shard_size is None:
        return plan
    from fastckpt._io.sizes import parse_size
    from fastckpt._io.storage.local.shards import split_part

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


_EXPORT_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}


def export_dtype(dtype: Any, *, model_only: bool) -> str | None:
    """The safetensors name of an export ``dtype`` (None for None).

    Raises:
        ValueError: ``dtype`` without ``model_only`` (a full training state in another dtype would not resume
            exactly), or a dtype that is not bfloat16 / float16 / float32 / float64.
    """
    if dtype is None:
        return None
    if dtype not in _EXPORT_DTYPES:
        raise OptionError(f"dtype must be torch.bfloat16, torch.float16, torch.float32 or torch.float64, got {dtype!r}")
    if not model_only:
        raise ValueError(f"dtype={dtype} converts the weights for export and needs model_only=True: a full training "
                         "state saved in another dtype would not resume exactly")
    return _EXPORT_DTYPES[dtype]


def _config_with_dtype(config: str, dtype: str) -> str:
    """A transformers ``config.json`` text saying the weights are ``dtype`` (``"dtype"``; ``"torch_dtype"`` too
    when the config has that older key)."""
    data = json.loads(config)
    data["dtype"] = dtype
    if "torch_dtype" in data:
        data["torch_dtype"] = dtype
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


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
    trainable_only: bool = False,
    trainable_buffers: tuple[str, ...] | list[str] = (),
    dtype: torch.dtype | None = None,
    threads: int = 0,
) -> SavePlan:
    """Collect the files of a checkpoint (see :mod:`fastckpt._io.storage.local.layout` for the names).

    Args:
        max_shard_size: split model and optimizer files larger than this (bytes, or ``"10GB"``) into
            ``{base}-0000k-of-0000N.safetensors`` + ``{base}.safetensors.index.json``; None keeps one file each.
        compat: None (fastckpt's layout) or ``"accelerate"`` (accelerate's exact files, pickles included;
            see :mod:`fastckpt._plan.accelerate_format`).
        model_states: state dicts to write instead of the models' own (accelerate's save hooks may edit them);
            optimizer fqns still come from ``models``.
        rng_states: ``rng_payload`` results per rank (``random_states_{rank}``); None: this process as rank 0.
        trainable_only: write only parameters with ``requires_grad`` and ``trainable_buffers``; record the frozen
            rest in the manifest (see :mod:`fastckpt._state.trainable`). With ``model_only`` on a ``PeftModel``:
            PEFT's adapter folder (see :mod:`fastckpt._state.peft_adapter`).
        dtype: ``model_only`` only: store floating tensors as ``torch.bfloat16`` / ``float16`` / ``float32`` /
            ``float64``, converted while written.
        threads: hashing threads for the frozen record (0 = min(8, cores)).

    An optimizer parameter of no passed model is keyed by its position (``#k``) and listed in the manifest's
    ``positional_params``.

    Raises:
        TypeError: state that cannot be stored without pickle (names its path).
        ValueError: an unknown ``compat``, a bad ``max_shard_size``, or ``max_shard_size`` with accelerate's
            layout (which is unsharded); ``dtype`` without ``model_only``, or a dtype that is not floating;
            ``trainable_only`` or ``dtype`` with ``compat="accelerate"``.
    """
    dtype_name = export_dtype(dtype, model_only=model_only)
    if compat is not None and (trainable_only or dtype_name is not None):
        raise ValueError("compat='accelerate' writes Accelerator.save_state's files; trainable_only and dtype "
                         "need fastckpt's layout (pass compat=None)")
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
    if dtype_name is not None:
        plan.counts["dtype"] = str(dtype).removeprefix("torch.")
    if trainable_only:
        plan.counts["trainable_only"] = True
        plan.counts["frozen"] = {}
    for i, m in enumerate(states):
        tensors, aliases = collect_model_state(m)
        name = part_name("model", i, ".safetensors")
        if trainable_only:
            refuse_subclasses(aliases, why="trainable_only does not record tensor subclasses yet (their frozen "
                                           "check would not see them); save without trainable_only")
            tensors, aliases, frozen = split_state(models[i], tensors, aliases, trainable_buffers, threads=threads)
            plan.counts["frozen"][part_name("model", i, "")] = frozen
            if model_only and i == 0 and is_peft_model(models[0]):
                tensors, aliases, name = adapter_state(models[0]), {}, ADAPTER_FILE
                plan.counts["peft"] = ADAPTER_FILE
                plan.texts[ADAPTER_CONFIG] = adapter_config_json(models[0])
        plan.parts.append(FilePart(name, tensors, [("format", "pt"), *aliases.items()], dtype_name))
    if models and "peft" not in plan.counts:
        files = hf_model_files(models[0])  # config.json, generation_config.json
        if dtype_name is not None and "config.json" in files:
            files["config.json"] = _config_with_dtype(files["config.json"], plan.counts["dtype"])
        plan.texts.update(files)
    if model_only:
        return _shard(plan, max_shard_size)
    fqns = param_fqns(models)
    for j, opt in enumerate(optimizers):
        tensors, metadata = optimizer_payload(opt, fqns, label=part_name("optimizer", j, ""))
        if "positional_params" in metadata:  # parameters of no passed model: keyed by position, said so here
            keys = sorted(json.loads(metadata["positional_params"]), key=lambda k: int(k[1:]))
            plan.counts.setdefault("positional_params", {})[part_name("optimizer", j, "")] = keys
        plan.parts.append(FilePart(part_name("optimizer", j, ".safetensors"), tensors, list(metadata.items())))
    if schedulers:
        plan.counts["scheduler_classes"] = [scheduler_class_name(s) for s in schedulers]
    for k, sched in enumerate(schedulers):
        state = encode(sched.state_dict(), path=part_name("scheduler", k, ""))
        plan.texts[part_name("scheduler", k, ".json")] = json.dumps(state)
    for rank, (tensors, metadata) in enumerate(rng_states if rng_states is not None else [rng_payload(step)]):
        plan.parts.append(FilePart(random_states_name(rank), tensors, list(metadata.items())))
    return _shard(plan, max_shard_size)

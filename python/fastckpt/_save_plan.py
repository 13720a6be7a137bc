"""What a save writes: the model-only policy, decided in Python before anything crosses into the core.

:func:`build_save_plan` turns live objects into a :class:`SavePlan`: the safetensors files (name, tensors,
metadata) and the small JSON files of one checkpoint. Tensors in a plan are the live tensors themselves (no
copies); the writer (:mod:`fastckpt._commit`) streams them to disk. With ``model_only`` only the model tensors
are collected: the optimizer and scheduler are never read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ._codec import encode
from ._layout import part_name, random_states_name
from ._optimizer import optimizer_payload, param_fqns
from ._rng import rng_payload
from ._state_dict import collect_model_state

__all__ = ["FilePart", "SavePlan", "build_save_plan"]


@dataclass
class FilePart:
    """One safetensors file of a checkpoint: ``name`` in the folder, ``{tensor_name: tensor}``, metadata."""

    name: str
    tensors: dict[str, torch.Tensor]
    metadata: list[tuple[str, str]] | None


@dataclass
class SavePlan:
    """Everything one checkpoint folder will hold, before anything is written."""

    mode: str  # "full" or "model_only"
    step: int
    counts: dict[str, int]
    parts: list[FilePart] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Tensor bytes in the plan (what the writer streams)."""
        return sum(t.numel() * t.element_size() for p in self.parts for t in p.tensors.values())


def _model_config_json(model: Any) -> str | None:
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json() if callable(to_json) else None


def build_save_plan(
    models: list[torch.nn.Module],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    *,
    model_only: bool,
    step: int = 0,
) -> SavePlan:
    """Collect the files of a checkpoint (see :mod:`fastckpt._layout` for the names).

    Raises:
        KeyMismatchError: an optimizer holds a parameter of no passed model.
        TypeError: state that cannot be stored without pickle (names its path).
    """
    if model_only:
        optimizers, schedulers = [], []
    plan = SavePlan(
        mode="model_only" if model_only else "full",
        step=step,
        counts={"models": len(models), "optimizers": len(optimizers), "schedulers": len(schedulers)},
    )
    for i, m in enumerate(models):
        tensors, aliases = collect_model_state(m)
        plan.parts.append(FilePart(part_name("model", i, ".safetensors"), tensors,
                                   [("format", "pt"), *aliases.items()]))
    if models and (config := _model_config_json(models[0])) is not None:
        plan.texts["config.json"] = config
    if model_only:
        return plan
    fqns = param_fqns(models)
    for j, opt in enumerate(optimizers):
        tensors, metadata = optimizer_payload(opt, fqns, label=part_name("optimizer", j, ""))
        plan.parts.append(FilePart(part_name("optimizer", j, ".safetensors"), tensors, list(metadata.items())))
    for k, sched in enumerate(schedulers):
        state = encode(sched.state_dict(), path=part_name("scheduler", k, ""))
        plan.texts[part_name("scheduler", k, ".json")] = json.dumps(state)
    tensors, metadata = rng_payload(step)
    plan.parts.append(FilePart(random_states_name(0), tensors, list(metadata.items())))
    return plan

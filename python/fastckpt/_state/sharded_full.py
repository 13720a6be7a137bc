"""FSDP2 ``FULL_STATE_DICT``: a sharded model's state gathered into fastckpt's single-file layout, and read back.

Save: every rank takes part in ``get_model_state_dict`` / ``get_optimizer_state_dict`` with
``full_state_dict=True, cpu_offload=True``; the main process gets full CPU tensors (the others get nothing) and
writes them as :func:`fastckpt._plan.save.build_save_plan` writes any model (ties stored once: a tied name gets the
kept tensor, so the alias search finds it). The optimizer goes through :class:`FullOptimizer`, which looks like the
live optimizer to :func:`fastckpt._state.optimizer.optimizer_payload` but holds the gathered state.

Load: every rank reads the full tensors of ``model.safetensors`` / ``optimizer.safetensors`` and checks names, global
shapes and dtypes (:func:`read_full_model`, :func:`read_full_optimizer`); applying them
(``set_model_state_dict`` / ``set_optimizer_state_dict`` with ``full_state_dict=True``) keeps each rank's shard.
"""

from __future__ import annotations

from typing import Any

import torch

from fastckpt._format.codec import decode
from fastckpt._format.tensors import file_tensors
from fastckpt._state.optimizer import _load_json, optimizer_class_name, param_fqns
from fastckpt._state.sharded import owner_model, tied_names
from fastckpt.errors import DtypeError, KeyMismatchError, ShapeMismatchError

__all__ = ["full_model_states", "full_optimizer_states", "FullOptimizer", "read_full_model", "read_full_optimizer"]


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_states(models: list[torch.nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Every model's full state dict on the main process (``{}`` elsewhere). Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    states = []
    for m in models:
        sd = dict(get_model_state_dict(m, options=_options()))
        for dropped, kept in tied_names(m).items():
            if dropped in sd and kept in sd:
                sd[dropped] = sd[kept]  # the same tensor: stored once, recorded as an alias
        states.append(sd)
    return states


class FullOptimizer:
    """A live optimizer's ``param_groups`` with its gathered full state (what ``optimizer_payload`` reads)."""

    def __init__(self, live: Any, state_dict: dict[str, Any], fqns: dict[int, str]) -> None:
        inner = getattr(live, "optimizer", None)  # accelerate's AcceleratedOptimizer wraps the torch one
        self.optimizer = inner if isinstance(inner, torch.optim.Optimizer) else live
        self.param_groups = live.param_groups
        flat = [fqns[id(p)] for g in live.param_groups for p in g["params"]]
        index = {fqn: i for i, fqn in enumerate(flat)}
        self._state = {"state": {index[f]: s for f, s in state_dict.get("state", {}).items()},
                       "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                         "params": [index[f] for f in g["params"]]}
                                        for g in state_dict.get("param_groups", [])]}  # {} off the main process

    def state_dict(self) -> dict[str, Any]:
        return self._state


def full_optimizer_states(models: list[torch.nn.Module], optimizers: list[Any]) -> list[FullOptimizer]:
    """Every optimizer's full state on the main process, as :class:`FullOptimizer`. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = []
    fqns = param_fqns(models)
    for j, opt in enumerate(optimizers):
        model = owner_model(opt, models, f"optimizer {j}")
        sd = get_optimizer_state_dict(model, opt, options=_options()) if opt.state else {
            "state": {}, "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                           "params": [fqns[id(p)] for p in g["params"]]} for g in opt.param_groups]}
        out.append(FullOptimizer(opt, sd, fqns))
    return out


def _fits(name: str, stored: torch.Tensor, live: torch.Tensor, where: str) -> None:
    if tuple(stored.shape) != tuple(live.shape):
        raise ShapeMismatchError(f"{where}: {name} is stored with shape {list(stored.shape)}, the live tensor has "
                                 f"shape {list(live.shape)}")
    if stored.dtype != live.dtype:
        raise DtypeError(f"{where}: {name} is stored as {stored.dtype}, the live tensor is {live.dtype}")


def read_full_model(files: list, model: torch.nn.Module, *, strict: bool,
                    where: str) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """``(full state dict, missing, unexpected)`` from the model's file(s), checked against the live model."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for f in files:
        stored.update(file_tensors(f))
        aliases.update({k: v for k, v in (f.metadata() or {}).items() if k != "format"})
    live = get_model_state_dict(model)
    state, missing = {}, []
    for name, t in live.items():
        source = name if name in stored else aliases.get(name)
        if source not in stored:
            missing.append(name)
            continue
        _fits(name, stored[source], t, where)
        state[name] = stored[source]
    unexpected = sorted(set(stored) - set(live))
    if strict and (missing or unexpected):
        raise KeyMismatchError(f"{where}: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}; pass "
                               "strict=False to load what matches")
    return state, missing, unexpected


def read_full_optimizer(file: Any, model: torch.nn.Module, optimizer: Any, *, strict: bool,
                        where: str) -> dict[str, Any]:
    """The fqn-keyed full optimizer state dict from fastckpt's optimizer file, checked against the live one."""
    metadata = file.metadata() or {}
    if strict and metadata.get("optimizer") != optimizer_class_name(optimizer):
        raise KeyMismatchError(f"{where}: saved by {metadata.get('optimizer')}, loading into "
                               f"{optimizer_class_name(optimizer)}; pass strict=False")
    tensors = file_tensors(file)
    groups = _load_json(metadata, "param_groups", where)
    names = _load_json(metadata, "state_names", where)
    extra = _load_json(metadata, "extra_state", where)
    fqns = param_fqns([model])
    live = {fqns[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    if strict and (len(groups) != len(optimizer.param_groups) or {f for g in groups for f in g["params"]} != set(live)):
        raise KeyMismatchError(f"{where}: the saved param_groups do not cover the live parameters")

    def resolve(key: str) -> torch.Tensor:
        return tensors[key]

    state: dict[str, dict[str, Any]] = {}
    for fqn, entries in names.items():
        if fqn not in live:
            continue
        for n in entries:
            t = tensors[f"state.{fqn}.{n}"]
            if t.dim() and tuple(t.shape) != tuple(live[fqn].shape):
                raise ShapeMismatchError(f"{where}: state.{fqn}.{n} has shape {list(t.shape)}, parameter {fqn} "
                                         f"has shape {list(live[fqn].shape)}")
            state.setdefault(fqn, {})[n] = t
    for fqn, values in extra.items():
        if fqn in live:
            state.setdefault(fqn, {}).update(decode(values, tensors=resolve))
    decoded = []
    for g in groups:
        entry = decode({k: v for k, v in g.items() if k != "params"}, tensors=resolve)
        entry["params"] = [f for f in g["params"] if f in live]
        decoded.append(entry)
    return {"state": state, "param_groups": decoded}

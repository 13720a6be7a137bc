"""Sharded training state (FSDP2 / DTensor): what a save hands to torch.distributed.checkpoint, and how a load
builds the tensors DCP fills.

A model's state comes from ``get_model_state_dict`` (DTensor shards under FSDP2, plain tensors otherwise); tied
weights are found per *parameter* (the same ``nn.Parameter`` registered under two names), never by storage pointer,
since FSDP2's padded shards make pointers differ from rank to rank. Only the first name of a tie is stored; the
others are recorded as ``{dropped: kept}``.

An optimizer's state comes from ``get_optimizer_state_dict`` (keyed by fqn): every tensor (moments, ``step``) goes to
its own DCP part (``optimizer/``) as ``state.{fqn}.{name}``; ``param_groups`` (params as fqns), the state names and non-tensor state go to
``{base}.json`` (the pickle-free codec), written once by the main process.

On load, :func:`model_destination` / :func:`optimizer_destination` build empty tensors shaped like the live ones
(DTensors with the live placements, so DCP reshards into them) and check every name, shape and dtype against the
DCP metadata first: nothing live is touched, and the optimizer is not even initialised, until every rank agreed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from fastckpt._format.codec import decode, encode
from fastckpt._state.optimizer import optimizer_class_name, param_fqns
from fastckpt.errors import DtypeError, KeyMismatchError, ShapeMismatchError

__all__ = ["is_sharded", "tied_names", "model_tensors", "optimizer_tensors", "model_destination",
           "optimizer_destination", "owner_model", "OPTIMIZER_FORMAT"]

OPTIMIZER_FORMAT = "fastckpt.sharded_optimizer"


def is_sharded(models: list[torch.nn.Module]) -> bool:
    """Whether any parameter or buffer of ``models`` is a DTensor (FSDP2 ``fully_shard``, tensor parallel)."""
    module = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists (and none is imported)
    if module is None:
        return False
    return any(isinstance(t, module.DTensor) for m in models for t in (*m.parameters(), *m.buffers()))


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """``{dropped: kept}``: names under which the same parameter (or buffer) object is registered again."""
    first: dict[int, str] = {}
    ties: dict[str, str] = {}
    for named in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        for name, t in named:
            if id(t) in first:
                ties[name] = first[id(t)]
            else:
                first[id(t)] = name
    return ties


def _model_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(model))


def model_tensors(model: torch.nn.Module, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``({prefix + fqn: tensor}, {dropped fqn: kept fqn})`` of one model, ties stored once.

    Raises:
        TypeError: a state_dict value that is not a tensor (``get_extra_state``), naming its key.
    """
    state = _model_state_dict(model)
    ties = {k: v for k, v in tied_names(model).items() if k in state and v in state}
    tensors = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{prefix}{name}: a {type(value).__name__} in the model state_dict; a sharded save "
                            "stores tensors only")
        if name not in ties:
            tensors[prefix + name] = value
    return tensors, ties


def owner_model(optimizer: Any, models: list[torch.nn.Module], label: str) -> torch.nn.Module:
    """The one model of ``models`` holding every parameter of ``optimizer``.

    Raises:
        KeyMismatchError: a parameter belongs to no model, or the parameters span several models.
    """
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for m in models:
        if ids <= {id(p) for p in m.parameters()}:
            return m
    raise KeyMismatchError(f"{label}: its parameters are not all in one of the models passed; a sharded save "
                           "needs each optimizer's parameters in one model (pass that model)")


def optimizer_tensors(model: torch.nn.Module, optimizer: Any, base: str) -> tuple[dict[str, torch.Tensor], str]:
    """``({state.fqn.name: tensor}, json text)`` of one optimizer (see the module docs).

    Raises:
        TypeError: non-tensor state that cannot be stored without pickle (names its path).
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if not optimizer.state:  # nothing to take (get_optimizer_state_dict would initialise the state)
        sd: dict[str, Any] = {"state": {}, "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": [param_fqns([model])[id(p)] for p in g["params"]]} for g in optimizer.param_groups]}
    else:
        sd = get_optimizer_state_dict(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    names: dict[str, list[str]] = {}
    extra: dict[str, Any] = {}
    for fqn, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{fqn}.{name}"] = value
                names.setdefault(fqn, []).append(name)
            else:
                extra.setdefault(fqn, {})[name] = encode(value, path=f"{base}.state[{fqn!r}][{name!r}]")
    groups = []
    for gi, group in enumerate(sd["param_groups"]):
        entry = encode({k: v for k, v in group.items() if k != "params"}, path=f"{base}.param_groups[{gi}]")
        entry["params"] = list(group["params"])
        groups.append(entry)
    text = json.dumps({"format": OPTIMIZER_FORMAT, "optimizer": optimizer_class_name(optimizer),
                       "param_groups": groups, "state_names": names, "extra_state": extra})
    return tensors, text


def _check(key: str, saved: Any, live: torch.Tensor, where: str) -> None:
    size = tuple(saved.size)
    if size != tuple(live.shape):
        raise ShapeMismatchError(f"{where}: {key} is stored with shape {list(size)} but the live tensor has shape "
                                 f"{list(live.shape)}")
    if saved.properties.dtype != live.dtype:
        raise DtypeError(f"{where}: {key} is stored as {saved.properties.dtype} but the live tensor is {live.dtype} "
                         "(no silent casts)")


def _empty_like(live: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty_like(live.detach(), dtype=dtype)


def model_destination(model: torch.nn.Module, prefix: str, metadata: dict[str, Any], aliases: dict[str, str], *,
                      strict: bool, where: str) -> tuple[dict[str, torch.Tensor], dict[str, str], list, list]:
    """Empty tensors DCP fills for one model: ``(dest {prefix+fqn: tensor}, {live fqn: stored fqn} for live names
    served by a stored tie, missing, unexpected)``.

    Raises:
        KeyMismatchError: ``strict`` and names differ (both lists named). ShapeMismatchError / DtypeError.
    """
    live = _model_state_dict(model)
    live_ties = tied_names(model)
    stored = {k[len(prefix):] for k in metadata if k.startswith(prefix)}
    dest: dict[str, torch.Tensor] = {}
    served: dict[str, str] = {}
    missing = []
    for name, t in live.items():
        source = name if name in stored else aliases.get(name)
        if source is None and name in live_ties and live_ties[name] in stored:
            source = live_ties[name]
        if source is None or source not in stored:
            missing.append(name)
            continue
        if source != name:
            served[name] = source
            continue
        _check(prefix + name, metadata[prefix + name], t, where)
        dest[prefix + name] = _empty_like(t)
    for name, source in served.items():
        _check(prefix + source, metadata[prefix + source], live[name], where)
        if prefix + source not in dest:
            dest[prefix + source] = _empty_like(live[name])
    unexpected = sorted(stored - set(live) - set(aliases))
    if strict and (missing or unexpected):
        raise KeyMismatchError(f"{where}: missing keys {missing[:10]} ({len(missing)}), unexpected keys "
                               f"{unexpected[:10]} ({len(unexpected)}); pass strict=False to load what matches")
    return dest, served, missing, unexpected


def optimizer_destination(model: torch.nn.Module, optimizer: Any, base: str, saved: dict[str, Any],
                          metadata: dict[str, Any], *, strict: bool, where: str) -> tuple[dict[str, torch.Tensor],
                                                                                          dict[str, Any]]:
    """Empty tensors DCP fills for one optimizer, and its ``param_groups`` / non-tensor state, decoded.

    ``saved`` is the optimizer's JSON. Moments shaped like their parameter become DTensors with its placements;
    other tensors (``step``) are plain CPU tensors (``load_state_dict`` moves them where the optimizer keeps them).

    Raises:
        KeyMismatchError: ``strict`` and the optimizer class, the number of ``param_groups`` or the covered
            parameters differ. ShapeMismatchError / DtypeError for a moment that does not fit its parameter.
    """
    if saved.get("format") != OPTIMIZER_FORMAT:
        raise KeyMismatchError(f"{where}: not a sharded optimizer state (format {saved.get('format')!r})")
    cls = optimizer_class_name(optimizer)
    groups = [dict(g) for g in saved["param_groups"]]
    if strict and saved.get("optimizer") != cls:
        raise KeyMismatchError(f"{where}: saved by {saved.get('optimizer')}, loading into {cls}; pass strict=False")
    if strict and len(groups) != len(optimizer.param_groups):
        raise KeyMismatchError(f"{where}: {len(groups)} param_groups saved, the optimizer has "
                               f"{len(optimizer.param_groups)}")
    fqns = param_fqns([model])
    live = {fqns[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    covered = {f for g in groups for f in g["params"]}
    if strict and set(live) != covered:
        raise KeyMismatchError(f"{where}: parameters not covered by the saved param_groups "
                               f"{sorted(set(live) - covered)[:10]}, saved but not live {sorted(covered - set(live))[:10]}")
    dest: dict[str, torch.Tensor] = {}
    for fqn, names in saved["state_names"].items():
        if fqn not in live:
            continue
        for name in names:
            key = f"state.{fqn}.{name}"
            if key not in metadata:
                raise KeyMismatchError(f"{where}: {key} is recorded in {base}.json but absent from {base}/")
            md = metadata[key]
            param = live[fqn]
            if tuple(md.size) == tuple(param.shape):
                dest[key] = _empty_like(param, md.properties.dtype)
            elif len(md.size) == 0 or strict is False:
                dest[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            else:
                raise ShapeMismatchError(f"{where}: {key} is stored with shape {list(md.size)}, parameter {fqn} has "
                                         f"shape {list(param.shape)}")
    for g in groups:
        g.update(decode({k: v for k, v in g.items() if k != "params"}))
        g["params"] = [f for f in g["params"] if f in live] if not strict else g["params"]
    extra = {fqn: decode(v) for fqn, v in saved.get("extra_state", {}).items() if fqn in live}
    return dest, {"param_groups": groups, "extra_state": extra, "state_names": saved["state_names"]}

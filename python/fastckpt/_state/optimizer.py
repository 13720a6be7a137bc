"""Optimizer state keyed by parameter fqn instead of position: ``optimizer.safetensors``.

torch's ``Optimizer.state_dict()`` keys state by the position of each parameter in ``param_groups``; a checkpoint
keyed that way silently loads the wrong moments into the wrong parameters when the model or the groups change.
fastckpt stores

- tensors ``state.{fqn}.{name}`` (``state.encoder.weight.exp_avg``; with several models the fqn carries the
  ``model_{i}.`` prefix of its model),
- metadata ``param_groups`` (JSON, with fqns in place of positions), ``state_names`` (``{fqn: [name, ...]}``) and
  ``extra_state`` (non-tensor state such as SGD's ``momentum_buffer=None``, through :mod:`fastckpt._format.codec`).

Loading maps fqns back onto the live optimizer's positions and hands torch a positional state dict, so torch's own
``load_state_dict`` places ``step`` and moments where a fresh optimizer of that kind keeps them.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch

from fastckpt._format.codec import encode
from fastckpt._format.json_input import decode_json, load_json
from fastckpt._io.storage.local.folder import read_fresh
from fastckpt._state.key_match import canonical_fqn
from fastckpt._state.optimizer_checks import check_hyper, check_state_tensor, dropped_state_lines
from fastckpt.errors import HeaderError, KeyMismatchError, ShapeMismatchError

__all__ = ["param_fqns", "optimizer_payload", "read_optimizer_state"]

FORMAT = "fastckpt.optimizer"


def param_fqns(models: Sequence[torch.nn.Module]) -> dict[int, str]:
    """``{id(parameter): fqn}`` for every parameter of ``models`` (``model_{i}.`` prefixes with several models).

    A tied parameter gets its first name, the one kept in the model file; a ``torch.compile``'d model's names
    are its plain ones (no ``_orig_mod.``, see :mod:`fastckpt._state.key_match`).
    """
    fqns: dict[int, str] = {}
    prefix = len(models) > 1
    for i, model in enumerate(models):
        for name, p in model.named_parameters():
            name = canonical_fqn(name)
            fqns.setdefault(id(p), f"model_{i}.{name}" if prefix else name)
    return fqns


def optimizer_class_name(optimizer: Any) -> str:
    """``module.QualName`` of the optimizer's class, seen through wrappers (accelerate's AcceleratedOptimizer)."""
    inner = getattr(optimizer, "optimizer", None)
    cls = type(inner if isinstance(inner, torch.optim.Optimizer) else optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _flat_fqns(optimizer: torch.optim.Optimizer, fqns: dict[int, str], label: str) -> list[str]:
    """The key of every parameter of ``optimizer``, in ``param_groups`` order: its fqn, or ``#k`` (its position
    ``k`` in the flattened ``param_groups``) for a parameter of no passed model (a standalone ``nn.Parameter``,
    a module never prepared), as stock accelerate keys all of them."""
    del label
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            names.append(fqns.get(id(p)) or f"#{len(names)}")
    return names


def positional_params(optimizer: torch.optim.Optimizer, flat: list[str], fqns: dict[int, str]) -> dict[str, list[int]]:
    """``{"#k": shape}`` of the parameters of no passed model, keyed by position (see :func:`_flat_fqns`)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {fqn: list(p.shape) for fqn, p in zip(flat, params) if id(p) not in fqns}


def _check_positional(optimizer: torch.optim.Optimizer, live: list[str], fqns: dict[int, str],
                      metadata: dict[str, str], path: str, label: str) -> None:
    """Parameters keyed by position must have the shapes they were saved with (else their state would land on
    another parameter): ShapeMismatchError naming the position and both shapes."""
    if "positional_params" not in metadata:
        return
    saved = load_json(metadata["positional_params"], f"{path}: metadata 'positional_params'", dict)
    for fqn, shape in positional_params(optimizer, live, fqns).items():
        if fqn in saved and saved[fqn] != shape:
            raise ShapeMismatchError(
                f"{path}: the parameter at position {fqn[1:]} of the live {label} (in no passed model, so keyed by "
                f"position) has shape {shape} but the saved one had shape {saved[fqn]}"
            )


def _canonical_saved(groups: list, state_names: dict, extra: dict) -> tuple[list, dict, dict, dict[str, str]]:
    """The saved fqns in canonical form (a file written from a ``torch.compile``'d model may carry
    ``_orig_mod.``), and ``{canonical: stored}`` for the names the file's tensors use."""
    stored = {canonical_fqn(f): f for g in groups for f in g["params"]}
    stored.update({canonical_fqn(f): f for f in state_names})
    groups = [{**g, "params": [canonical_fqn(f) for f in g["params"]]} for g in groups]
    return (groups, {canonical_fqn(k): v for k, v in state_names.items()},
            {canonical_fqn(k): v for k, v in extra.items()}, stored)


def _defer_positional_values(optimizer: torch.optim.Optimizer, live: list[str], entries: dict[str, tuple],
                             file: Any, defer: list) -> None:
    """Schedule the saved values of parameters keyed by position (``param.#k``) to be read into the live
    parameters in phase 2. Raises DtypeError / ShapeMismatchError (phase 1) when a value does not fit."""
    from fastckpt._format.dtypes import to_safetensors_dtype, torch_shape
    from fastckpt.errors import DtypeError

    params = [p for g in optimizer.param_groups for p in g["params"]]
    targets = []
    for fqn, p in zip(live, params):
        entry = entries.get(f"param.{fqn}")
        if not fqn.startswith("#") or entry is None:
            continue
        name, dtype_name, shape = entry[0], entry[1], entry[2]
        if to_safetensors_dtype(p.dtype, name=name) != dtype_name:
            raise DtypeError(f"{file.path}: {name!r} is stored as {dtype_name} but the live parameter at position "
                             f"{fqn[1:]} is {p.dtype}; fastckpt never casts silently")
        if torch_shape(dtype_name, shape, name=name, path=file.path) != list(p.shape):
            raise ShapeMismatchError(f"{file.path}: {name!r} has shape {shape} but the live parameter at position "
                                     f"{fqn[1:]} has shape {list(p.shape)}")
        if not p.is_contiguous():
            raise ValueError(f"{file.path}: the live parameter at position {fqn[1:]} is not contiguous; its saved "
                             "value cannot be read into it in place")
        targets.append((name, p.detach()))
    if targets:
        defer.append((file, targets))


def optimizer_payload(
    optimizer: torch.optim.Optimizer, fqns: dict[int, str], *, label: str = "optimizer"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of one optimizer's file.

    Returns:
        ``({tensor_name: tensor}, {metadata_key: str})``; the tensors are the optimizer's own (no copies).

    A parameter of no passed model is keyed ``#k`` by its position in ``param_groups``; metadata
    ``positional_params`` records those keys with their shapes.

    Raises:
        TypeError: a state value that cannot be stored without pickle (names its path).
    """
    flat = _flat_fqns(optimizer, fqns, label)
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}

    def sink(path: str, t: torch.Tensor) -> str:
        key = f"extra.{len(tensors)}"
        tensors[key] = t
        return key

    state_names: dict[str, list[str]] = {}
    extra: dict[str, Any] = {}
    for index, state in sd["state"].items():
        fqn = flat[index]
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{fqn}.{name}"] = value
                state_names.setdefault(fqn, []).append(name)
            else:
                extra.setdefault(fqn, {})[name] = encode(value, path=f"{label}.state[{fqn!r}][{name!r}]",
                                                         tensor_sink=sink)
    groups = []
    for gi, group in enumerate(sd["param_groups"]):
        entry = {k: v for k, v in group.items() if k != "params"}
        encoded = encode(entry, path=f"{label}.param_groups[{gi}]", tensor_sink=sink)
        encoded["params"] = [flat[i] for i in group["params"]]
        groups.append(encoded)
    metadata = {
        "format": FORMAT,
        "optimizer": optimizer_class_name(optimizer),
        "param_groups": json.dumps(groups),
        "state_names": json.dumps(state_names),
        "extra_state": json.dumps(extra),
    }
    if positional := positional_params(optimizer, flat, fqns):
        metadata["positional_params"] = json.dumps(positional)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for fqn, p in zip(flat, params):  # their values too: no model file holds them
            if fqn in positional:
                tensors[f"param.{fqn}"] = p.detach()
    return tensors, metadata


def _load_json(metadata: dict[str, str], key: str, path: str) -> Any:
    if key not in metadata:
        raise HeaderError(f"{path}: metadata has no {key!r}; not a fastckpt optimizer file")
    where = f"{path}: metadata {key!r}"
    value = load_json(metadata[key], where, list if key == "param_groups" else dict)
    if key == "param_groups":
        if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in value):
            raise HeaderError(f"{where}: every param group must be an object with a 'params' list")
        if not all(isinstance(fqn, str) for g in value for fqn in g["params"]):
            raise HeaderError(f"{where}: 'params' must list parameter names (str)")
    elif key == "state_names":
        if not all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in value.values()):
            raise HeaderError(f"{where}: must map each parameter to a list of state names (str)")
    elif not all(isinstance(v, dict) for v in value.values()):
        raise HeaderError(f"{where}: must map each parameter to an object")
    return value


def optimizer_fits(saved_class: Any, optimizer: Any, *, strict: bool, path: str, label: str) -> bool:
    """Whether state saved by ``saved_class`` may be loaded into ``optimizer``; False (not ``strict``): another
    class, whose ``param_groups`` and state keys would not fit (AdamW's groups in SGD fail its next ``step()``), so
    the live optimizer keeps its own state.

    Raises:
        KeyMismatchError: ``strict`` and another class saved the state (names both).
    """
    live_class = optimizer_class_name(optimizer)
    stand_in = (saved_class or "").startswith("fastckpt.") or live_class.startswith("fastckpt.")  # fastckpt convert
    if not isinstance(saved_class, str) or stand_in or saved_class == live_class:
        return True
    if strict:
        raise KeyMismatchError(
            f"{path}: the state was saved by {saved_class} but the live {label} is {live_class}; its state keys "
            f"would not fit. With strict=False the live {label} keeps its own state (reported in "
            "LoadResult.skipped). Nothing was changed."
        )
    return False


def read_optimizer_state(
    optimizer: torch.optim.Optimizer,
    file: Any,
    fqns: dict[int, str],
    *,
    strict: bool = True,
    map_location: Any = None,
    label: str = "optimizer",
    defer: list | None = None,
    skipped: list[str] | None = None,
) -> dict[str, Any] | None:
    """Read an optimizer file into a positional state dict for ``optimizer.load_state_dict``; changes nothing.

    Returns None (nothing read) when, under ``strict=False``, another optimizer class saved the state.

    Tensors are read (parallel positional reads) into fresh CPU tensors, so nothing aliases the file.

    Args:
        file: an opened ``fastckpt._core.SafetensorsFile``.
        map_location: device for state tensors other than ``step`` (None: let torch move them to the params).
        defer: when a list is given, state the live optimizer already holds in a matching tensor is not read
            now: the returned state dict holds the live tensor itself and ``(file, [(name, tensor)])`` is appended
            to ``defer``; read it with :func:`fastckpt._state.live_targets.read_tensors` just before
            ``load_state_dict`` (see :mod:`fastckpt._state.live_targets`).
        skipped: when a list is given (``strict=False``), one line is appended for each saved parameter whose
            state is not applied because the live optimizer does not optimize it (frozen since, or left out of its
            ``param_groups``), naming the file, the fqn and the state names (``LoadResult.skipped``).

    Raises:
        KeyMismatchError: ``strict`` and a live parameter is in no saved param group, or the saved groups hold
            parameters the live optimizer does not optimize (names them).
        ShapeMismatchError: a parameter keyed by position has another shape than the saved one, or a state
            tensor another shape than the live optimizer's tensor of that name (or, for the moments torch keeps
            shaped like the parameter, ``exp_avg`` and the like, than the parameter); also under ``strict=False``.
        DtypeError: a state tensor of another dtype than the live optimizer's of that name, or a moment of another
            kind (integer for a floating parameter...); also under ``strict=False``.
        HeaderError: the file is not a fastckpt optimizer file (missing metadata, names the key), or a saved
            hyper-parameter is of another type than the live group's (``lr="x"``; a bool for a number; ``betas``
            of another length); also under ``strict=False``.
    """
    path = file.path
    metadata = file.metadata() or {}
    if not optimizer_fits(metadata.get("optimizer"), optimizer, strict=strict, path=path, label=label):
        return None
    saved_groups = _load_json(metadata, "param_groups", path)
    state_names = _load_json(metadata, "state_names", path)
    extra = _load_json(metadata, "extra_state", path)
    saved_groups, state_names, extra, stored_fqn = _canonical_saved(saved_groups, state_names, extra)
    entries = {e[0]: e for e in file.tensors()}

    fresh: dict[str, torch.Tensor] = {}
    targets = []
    from fastckpt._format.dtypes import to_torch_dtype, torch_shape
    from fastckpt._format.tensors import destination_buffer
    from fastckpt._state.live_targets import live_optimizer_targets

    reuse = {} if defer is None else live_optimizer_targets(
        optimizer, _flat_fqns(optimizer, fqns, label), entries, path=path, map_location=map_location)
    # map_location="cuda": state tensors (not ``step``) go straight to the device through pinned bounce buffers
    device = torch.device(map_location) if map_location is not None else None
    to_device = []
    for name, dtype_name, shape, _begin, _end in entries.values():
        if name.startswith("param.#"):
            continue  # the value of a parameter keyed by position: read into the parameter in phase 2
        if name in reuse:
            fresh[name] = reuse[name]
            continue
        on_device = device is not None and device.type == "cuda" and name.startswith("state.") \
            and not name.endswith(".step")
        t = torch.empty(torch_shape(dtype_name, shape, name=name, path=path),
                        dtype=to_torch_dtype(dtype_name, name=name, path=path), device=device if on_device else "cpu")
        fresh[name] = t
        buf = None if on_device else destination_buffer(t)
        if buf is not None:
            targets.append((name, buf))
        elif on_device:
            to_device.append((name, t))
    read_fresh(file, targets)  # fresh tensors: summed as they are read when the load defers its sums
    if to_device:
        from fastckpt._io.device_load import read_to_device

        read_to_device(file, to_device)
    if reuse:
        defer.append((file, list(reuse.items())))

    def resolve(key: str) -> torch.Tensor:
        try:
            return fresh[key]
        except KeyError:
            raise HeaderError(f"{path}: metadata refers to tensor {key!r}, which the file does not hold") from None

    live = _flat_fqns(optimizer, fqns, label)
    _check_positional(optimizer, live, fqns, metadata, path, label)
    if defer is not None:
        _defer_positional_values(optimizer, live, entries, file, defer)
    if strict and len(saved_groups) != len(optimizer.param_groups):
        raise KeyMismatchError(
            f"{path}: {len(saved_groups)} param_groups were saved but the live {label} has "
            f"{len(optimizer.param_groups)}; load with strict=False to match groups by their parameters"
        )
    saved_group_of = {fqn: gi for gi, g in enumerate(saved_groups) for fqn in g["params"]}
    uncovered = [fqn for fqn in live if fqn not in saved_group_of]
    if strict and uncovered:
        raise KeyMismatchError(
            f"{path}: the saved param_groups do not cover {len(uncovered)} parameter(s) of the live {label}: "
            f"{uncovered}; load with strict=False to start them fresh"
        )
    index_of = {fqn: i for i, fqn in enumerate(live)}
    orphaned = [fqn for fqn in saved_group_of if fqn not in index_of]
    if strict and orphaned:  # torch's load_state_dict refuses this too (a group of another size)
        raise KeyMismatchError(
            f"{path}: the saved {label} holds state for {len(orphaned)} parameter(s) the live {label} does not "
            f"optimize: {orphaned[:10]}{' ...' if len(orphaned) > 10 else ''}; loading would drop it (load with "
            "strict=False to take the state of the parameters it does optimize)"
        )
    if skipped is not None:
        skipped += dropped_state_lines(orphaned, state_names, extra, path=path, label=label)
    groups: list[dict[str, Any]] = []
    position = 0
    for live_group in optimizer.param_groups:
        n = len(live_group["params"])
        members = live[position: position + n]
        source = next((saved_group_of[f] for f in members if f in saved_group_of), None)
        if source is None:
            hyper = {k: v for k, v in live_group.items() if k != "params"}
        else:
            hyper = decode_json({k: v for k, v in saved_groups[source].items() if k != "params"},
                                f"{path}: metadata 'param_groups'", tensors=resolve)
            check_hyper(hyper, live_group, path, source, len(groups), label)
        groups.append({**hyper, "params": list(range(position, position + n))})
        position += n

    state: dict[int, dict[str, Any]] = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    live_state = getattr(optimizer, "state", None)
    for fqn in live:
        if fqn not in saved_group_of:
            continue
        values: dict[str, Any] = {}
        param = params[index_of[fqn]]
        held = live_state.get(param, {}) if isinstance(live_state, dict) and isinstance(param, torch.Tensor) else {}
        for name in state_names.get(fqn, []):
            key = f"state.{stored_fqn.get(fqn, fqn)}.{name}"
            t = resolve(key)
            check_state_tensor(key, name, t, param, held.get(name), path, label)
            if map_location is not None and name != "step":
                t = t.to(map_location)
            values[name] = t
        for name, encoded in extra.get(fqn, {}).items():
            values[name] = decode_json(encoded, f"{path}: metadata 'extra_state'", tensors=resolve)
        if values:
            state[index_of[fqn]] = values
    return {"state": state, "param_groups": groups}

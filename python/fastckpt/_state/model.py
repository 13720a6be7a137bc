"""Model state dicts: tied-weight handling on save, validated two-phase loading into a live module.

Tied weights (accelerate's convention): tensors that are the *same view* of one storage are stored once, under the
first name in ``state_dict`` order; every dropped name is recorded in the file's metadata as
``{dropped: kept}`` (the convention of ``safetensors.torch.save_model``, so Hugging Face tools read it too).
Tensors that merely share a storage with different views (or dtypes) are stored separately and round-trip exactly.

Loading is planned first (names, shapes and dtypes checked against every file) and applied only when the whole
plan is valid, so a failed load leaves the module untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, NamedTuple

import torch

from fastckpt._format.dtypes import to_safetensors_dtype, torch_shape
from fastckpt._format.tensors import destination_buffer, tensor_from_buffer
from fastckpt._state.destinations import check_destination
from fastckpt._state.key_match import canonical_fqn, untied_conflicts
from fastckpt._state.subclasses import expand_live, flatten_subclasses, is_plain, stored_records
from fastckpt.errors import DtypeError, KeyMismatchError, ShapeMismatchError

__all__ = [
    "find_aliases",
    "collect_model_state",
    "ModelLoadPlan",
    "plan_module_load",
    "matching_module",
    "apply_module_load",
    "load_into_module",
]


def _view_key(t: torch.Tensor) -> tuple:
    return (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def find_aliases(state_dict: Mapping[str, torch.Tensor], *, any_overlap: bool = False) -> list[list[str]]:
    """Groups (of 2+ names, in ``state_dict`` order) of tensors that alias each other.

    Args:
        state_dict: ``{name: tensor}``.
        any_overlap: group tensors whose bytes overlap at all (safetensors' refusal rule); otherwise group only
            tensors that are the same view (same storage, offset, shape, strides and dtype), i.e. tied weights.
    """
    by_storage: dict[tuple, list[str]] = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.numel() == 0 or t.is_meta:
            continue
        if not is_plain(t):  # a wrapper subclass has no storage of its own (its inner tensors are checked)
            continue
        storage = t.untyped_storage()
        by_storage.setdefault((t.device, storage.data_ptr()), []).append(name)
    groups: list[list[str]] = []
    for names in by_storage.values():
        if len(names) < 2:
            continue
        if any_overlap:
            spans = []
            for n in names:
                t = state_dict[n]
                start = t.storage_offset() * t.element_size()
                extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
                spans.append((start, start + extent * t.element_size(), n))
            spans.sort()
            current: list[str] = [spans[0][2]]
            end = spans[0][1]
            for s, e, n in spans[1:]:
                if s < end:
                    current.append(n)
                    end = max(end, e)
                else:
                    if len(current) > 1:
                        groups.append(current)
                    current, end = [n], e
            if len(current) > 1:
                groups.append(current)
        else:
            by_view: dict[tuple, list[str]] = {}
            for n in names:
                by_view.setdefault(_view_key(state_dict[n]), []).append(n)
            groups.extend(g for g in by_view.values() if len(g) > 1)
    order = {n: i for i, n in enumerate(state_dict)}
    return [sorted(g, key=order.__getitem__) for g in groups]


def collect_model_state(
    module: torch.nn.Module | Mapping[str, torch.Tensor], *, unwrap_compiled: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to store for ``module`` (or for a ready state dict) and the dropped tied names.

    ``unwrap_compiled``: store a ``torch.compile``'d model under its plain names (no ``_orig_mod.``); False keeps
    the names as given (accelerate's own layout, which stock ``Accelerator.load_state`` reads into the wrapper).

    Returns:
        ``(tensors, aliases)``: ``tensors`` is the state dict without tied duplicates (values are detached views
        of the live tensors, not copies), each traceable wrapper subclass replaced by its inner tensors;
        ``aliases``: the file's metadata entries, each dropped name -> the kept name, plus the subclass records
        of :func:`fastckpt._state.subclasses.flatten_subclasses`.

    Raises:
        TypeError: a state_dict entry is not a tensor (e.g. an ``extra_state`` object), naming it.
        TensorSubclassError: a tensor subclass fastckpt cannot store exactly (names it and its type).
    """
    state_dict = dict(module) if isinstance(module, Mapping) else module.state_dict()
    if unwrap_compiled:
        state_dict = {canonical_fqn(k): v for k, v in state_dict.items()}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{type(module).__name__}.state_dict()[{name!r}] is a {type(value).__name__}; "
                "fastckpt stores tensors only in model files (get_extra_state must return a tensor)"
            )
    state_dict, records = flatten_subclasses(state_dict, owner=type(module).__name__)
    aliases: dict[str, str] = {}
    for group in find_aliases(state_dict):
        for dropped in group[1:]:
            aliases[dropped] = group[0]
            del state_dict[dropped]
    aliases.update(records)
    return state_dict, aliases


@dataclass
class ModelLoadPlan:
    """What a validated model load will do: ``(destination, file, name)`` triples plus the key report."""

    module: torch.nn.Module
    assignments: list[tuple[torch.Tensor, object, str]] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


class _Source(NamedTuple):
    file: object  # fastckpt._core.SafetensorsFile
    name: str
    dtype: str
    shape: list[int]
    begin: int
    end: int


def _file_aliases(file: object, names: set[str]) -> dict[str, str]:
    metadata = file.metadata() or {}  # type: ignore[attr-defined]
    return {k: v for k, v in metadata.items() if k != "format" and v in names and k not in names}


def plan_module_load(module: torch.nn.Module, files: list, *, strict: bool = True,
                     rename: Mapping[str, str] | None = None, exempt: Collection[str] = (),
                     cast: bool = False) -> ModelLoadPlan:
    """Check ``files`` (opened ``_core.SafetensorsFile`` objects, e.g. shards) against ``module``; change nothing.

    ``rename``: ``{name in the files: state_dict name}`` for files keyed otherwise (PEFT's adapter keys).
    ``exempt``: state_dict names that are not missing when the files lack them (frozen weights already checked).
    ``cast``: a stored dtype other than the live tensor's is cast on load (``copy_``, as torch's ``load_state_dict``
    does) instead of refused.

    Raises:
        KeyMismatchError: ``strict`` and names are missing or unexpected (both lists in the message).
        ShapeMismatchError: a stored shape differs from the live tensor's (names file, tensor, both shapes).
        DtypeError: a stored dtype differs from the live tensor's and not ``cast`` (no silent casts; names both
            dtypes and ``cast=True``).
    """
    sources: dict[str, _Source] = {}  # by canonical name (torch.compile's _orig_mod. dropped)
    aliases: dict[str, str] = {}
    for f in files:
        for name, dtype, shape, begin, end in f.tensors():
            sources[canonical_fqn(rename.get(name, name) if rename else name)] = _Source(f, name, dtype, shape, begin, end)
    stored = {s.name for s in sources.values()}
    for f in files:
        aliases.update({canonical_fqn(k): canonical_fqn(v) for k, v in _file_aliases(f, stored).items()})
    records = stored_records(files)
    live = module.state_dict(keep_vars=True)
    if records or any(isinstance(t, torch.Tensor) and not is_plain(t) for t in live.values()):
        live = expand_live(live, {canonical_fqn(k): v for k, v in records.items()}, owner=type(module).__name__,
                           stored=set(sources), canonical=canonical_fqn)
    live_groups = {n: g for g in find_aliases(live) for n in g}
    live_canonical = {canonical_fqn(n) for n in live}

    plan = ModelLoadPlan(module)
    covered: set[str] = set()
    for name, dst in live.items():
        c = canonical_fqn(name)
        src = sources.get(c) or sources.get(aliases.get(c, ""))
        if src is None:
            continue
        covered.add(name)
        plan.assignments.append((dst, src, name))
    for name in live:
        if name not in covered and name not in exempt and not any(m in covered for m in live_groups.get(name, ())):
            plan.missing_keys.append(name)
    plan.unexpected_keys = [s.name for c, s in sources.items() if c not in live_canonical]
    plan.unexpected_keys += [n for n in aliases if n not in live_canonical]
    untied = untied_conflicts(plan.assignments, live_groups)  # stored apart, tied live: one would be dropped
    plan.unexpected_keys += [plan.assignments[i][1].name for i in untied]
    plan.assignments = [a for i, a in enumerate(plan.assignments) if i not in set(untied)]
    if strict and (plan.missing_keys or plan.unexpected_keys):
        where = ", ".join(sorted({f.path for f in files})) or "<no files>"
        note = ""
        if untied:
            note = (f"; the file stores {sorted(plan.unexpected_keys[-len(untied):])} with values different from "
                    f"the tensors {type(module).__name__} ties them to, so loading would drop them")
        raise KeyMismatchError(
            f"{where}: state_dict of {type(module).__name__} does not match: "
            f"missing keys {plan.missing_keys}, unexpected keys {plan.unexpected_keys}{note}"
        )
    for dst, src, name in plan.assignments:
        if not isinstance(dst, torch.Tensor):
            raise TypeError(f"{type(module).__name__}.state_dict()[{name!r}] is not a tensor")
        if dst.is_meta:
            raise ValueError(
                f"{type(module).__name__}.{name} is on the meta device (it has no storage to load into); "
                "materialize the model first, e.g. model.to_empty(device='cpu')"
            )
        want_dtype = to_safetensors_dtype(dst.dtype, name=name)
        if src.dtype != want_dtype and not cast:
            raise DtypeError(
                f"{src.file.path}: tensor {src.name!r} is stored as {src.dtype} but {name!r} in "
                f"{type(module).__name__} is {dst.dtype} ({want_dtype}); fastckpt never casts silently: pass "
                "cast=True to cast it as torch's load_state_dict would"
            )
        shape = torch_shape(src.dtype, src.shape, name=src.name, path=src.file.path)
        if list(dst.shape) != shape:
            raise ShapeMismatchError(
                f"{src.file.path}: tensor {src.name!r} has shape {shape} but {name!r} in "
                f"{type(module).__name__} has shape {list(dst.shape)}"
            )
        check_destination(dst, name, type(module).__name__)
    return plan


@torch.no_grad()
def apply_module_load(plan: ModelLoadPlan, *, threads: int = 0) -> None:
    """Copy the planned tensors into the live module: CPU contiguous tensors are filled straight from the file
    by the core's parallel positional reads; CUDA tensors through pinned bounce buffers
    (:mod:`fastckpt._io.device_load`); others (non-contiguous CPU) through a mapped view + copy_."""
    direct: dict[int, tuple[object, list]] = {}
    to_device: dict[int, tuple[object, list]] = {}
    seen: set[tuple] = set()
    for dst, src, _name in plan.assignments:
        key = (dst.device, dst.data_ptr(), _view_key(dst))
        if key in seen:
            continue  # tied in the live module: one write fills every name
        seen.add(key)
        if src.end == src.begin:
            continue
        same_dtype = src.dtype == to_safetensors_dtype(dst.dtype, name=_name)
        buf = destination_buffer(dst) if same_dtype else None  # a cast (cast=True) goes through copy_
        if not same_dtype and dst.device.type == "cuda":
            view = memoryview(src.file)
            start = src.file.data_start
            dst.copy_(tensor_from_buffer(view, src.dtype, src.shape, start + src.begin, start + src.end,
                                         name=src.name, path=src.file.path))
            continue
        if buf is not None:
            direct.setdefault(id(src.file), (src.file, []))[1].append((src.name, buf))
        elif dst.device.type == "cuda":
            to_device.setdefault(id(src.file), (src.file, []))[1].append((src.name, dst))
        else:
            view = memoryview(src.file)
            start = src.file.data_start
            mapped = tensor_from_buffer(view, src.dtype, src.shape, start + src.begin, start + src.end,
                                        name=src.name, path=src.file.path)
            dst.copy_(mapped)
    for file, targets in direct.values():
        file.read_into(targets, threads=threads)
    if to_device:
        from fastckpt._io.device_load import read_to_device

        for file, targets in to_device.values():
            read_to_device(file, targets, threads=threads)


def load_into_module(module: torch.nn.Module, path: str, *, strict: bool = True) -> tuple[list[str], list[str]]:
    """Validate then load one safetensors file into ``module``; returns ``(missing, unexpected)``."""
    from fastckpt import _core

    plan = plan_module_load(module, [_core.SafetensorsFile(path)], strict=strict)
    apply_module_load(plan)
    return plan.missing_keys, plan.unexpected_keys


def matching_module(module: torch.nn.Module, files: list[Any]) -> torch.nn.Module:
    """``module``, or a view of it whose keys carry / lose the ``module.`` prefix the files were saved with: a
    state dict saved from a ``DistributedDataParallel`` / ``DataParallel`` wrapper (every key ``module.*``: stock
    accelerate's ``.bin`` files, fastckpt checkpoints saved from the wrapper by earlier versions) loads into the bare model, and the reverse."""
    saved = [e[0] for f in files for e in f.tensors()]
    live = list(module.state_dict().keys())
    saved_prefixed = bool(saved) and all(n.startswith("module.") for n in saved)
    live_prefixed = bool(live) and all(n.startswith("module.") for n in live)
    if saved_prefixed and not live_prefixed:
        holder = torch.nn.Module()
        holder.add_module("module", module)  # same tensors, names with the DDP prefix
        return holder
    if live_prefixed and not saved_prefixed and isinstance(getattr(module, "module", None), torch.nn.Module):
        return module.module
    return module

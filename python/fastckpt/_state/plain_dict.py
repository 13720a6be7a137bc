"""What a plain checkpoint dict is (the object ``torch.save`` is used for), split into what fastckpt stores.

:func:`dict_payload` walks the object once: every tensor goes to the tensor file (``state.safetensors``) under a
name made from its key path (``state_dict.net.0.weight``, ``optimizer_states[0].state[0].exp_avg``; a flat
``{str: tensor}`` dict keeps its keys as they are, so the file is a plain safetensors file of that dict), and the
rest of the structure becomes exact JSON through :mod:`fastckpt._format.codec` (``exact=True``: integer and tuple
keys, tuple vs list, OrderedDict, None, inf/nan, numpy scalars, ``torch.dtype`` / ``torch.device`` /
``torch.Size``). Tensors that are the same view of one storage (tied weights, or one tensor under two keys) are
stored once; the structure records the dropped names (``aliases``) and whether they were the same object, and
:func:`rebuild` ties them again. Tensors that only partly overlap are stored apart (their sharing is not kept).

A value the codec cannot store exactly (a custom object, a namedtuple, an enum, a function) is a ``TypeError``
naming its key path, unless ``trust_pickle``: then it is recorded as ``{"__pickled__": i}`` and handed back in
``pickled`` for the pickle part (see :mod:`fastckpt._plan.dict_save`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fastckpt._format.codec import encode
from fastckpt._format.json_input import decode_json
from fastckpt.errors import HeaderError

__all__ = ["FORMAT", "VERSION", "ROOT", "DictPayload", "dict_payload", "check_structure", "rebuild"]

FORMAT = "fastckpt.dict"
VERSION = 1
ROOT = "checkpoint"  # the root of every key path in messages: checkpoint['optimizer_states'][0]...


@dataclass
class DictPayload:
    """A checkpoint dict split for storage.

    ``tensors``: ``{name: tensor}`` of the live tensors (no copies), tied duplicates dropped; ``structure``: the
    JSON document of ``state.json``; ``pickled`` / ``pickled_paths``: the values for the pickle part and where
    each sat (empty unless ``trust_pickle``).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    structure: dict[str, Any] = field(default_factory=dict)
    pickled: list[Any] = field(default_factory=list)
    pickled_paths: list[str] = field(default_factory=list)


def _name_of(path: str) -> str:
    """A tensor name from a key path: the path without its root (``checkpoint.state_dict.w`` -> ``state_dict.w``)."""
    return path[len(ROOT) + 1:] if path.startswith(ROOT + ".") else path[len(ROOT):] or "tensor"


def _view_key(t: torch.Tensor) -> tuple | None:
    """What makes two tensors the same view: device, storage address, offset, shape, strides, dtype; None for
    tensors that cannot alias (empty ones)."""
    if t.layout != torch.strided or t.numel() == 0 or t.is_meta:
        return None
    return (str(t.device), t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def dict_payload(obj: Any, *, trust_pickle: bool = False) -> DictPayload:
    """Split ``obj`` into tensors, exact JSON and (with ``trust_pickle``) values only pickle can hold.

    Args:
        obj: nested dicts / lists / tuples of tensors and plain values (what ``torch.save`` is given).
        trust_pickle: values the codec cannot store exactly go to the pickle part instead of raising.

    Returns:
        A :class:`DictPayload`; its tensors are the caller's own (no copies).

    Raises:
        TypeError: without ``trust_pickle``, a value that needs pickle (names its key path and type).
    """
    payload = DictPayload()
    seen: dict[tuple, tuple[str, torch.Tensor]] = {}  # view key -> (kept name, the first tensor object)
    same_object: list[str] = []
    devices: dict[str, str] = {}

    def sink(path: str, t: torch.Tensor) -> str:
        name = _unique(_name_of(path), payload.tensors, payload.aliases)
        key = _view_key(t)
        if key is not None and key in seen:
            kept, first = seen[key]
            payload.aliases[name] = kept
            if t is first:
                same_object.append(name)
            return name
        if key is not None:
            seen[key] = (name, t)
        payload.tensors[name] = t
        if t.device.type != "cpu":
            devices[name] = str(t.device)
        return name

    def fallback(path: str, value: Any) -> Any:
        if not trust_pickle:
            raise TypeError(
                f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which fastckpt cannot store "
                "exactly without pickle; convert it to plain values (dicts, lists, tuples, numbers, strings, "
                "tensors), or pass trust_pickle=True to write it to the checkpoint's pickle part"
            )
        payload.pickled.append(value)
        payload.pickled_paths.append(path)
        return {"__pickled__": len(payload.pickled) - 1}

    encoded = encode(obj, path=ROOT, tensor_sink=sink, exact=True, fallback=fallback)
    payload.structure = {
        "format": FORMAT,
        "version": VERSION,
        "object": encoded,
        "aliases": payload.aliases,
        "same_object": same_object,
        "devices": devices,
        "pickled": payload.pickled_paths,
    }
    return payload


def _unique(name: str, tensors: dict[str, Any], aliases: dict[str, str]) -> str:
    """``name``, or ``name~2``, ``name~3``... when another key path gave the same name (``{"a.b": t}`` beside
    ``{"a": {"b": t}}``, or the int key 0 beside the str key "0")."""
    if name not in tensors and name not in aliases:
        return name
    n = 2
    while f"{name}~{n}" in tensors or f"{name}~{n}" in aliases:
        n += 1
    return f"{name}~{n}"


def _str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def check_structure(structure: Any, where: str, tensor_names: set[str]) -> None:
    """``state.json`` has the fields :func:`dict_payload` writes, and its tensor references match the tensor file
    exactly (every stored tensor is referred to, every reference is stored): nothing is dropped silently.

    Raises:
        HeaderError: another format or version, a field of another type, an alias of a tensor the file lacks, or
            tensor names in the file that the structure does not refer to (names them).
    """
    if not isinstance(structure, dict) or structure.get("format") != FORMAT:
        raise HeaderError(f"{where}: not a fastckpt checkpoint-dict structure (format {FORMAT!r} expected)")
    if structure.get("version") != VERSION:
        raise HeaderError(f"{where}: version {structure.get('version')!r}, this fastckpt reads {VERSION}")
    aliases, devices = structure.get("aliases"), structure.get("devices")
    same, pickled = structure.get("same_object"), structure.get("pickled")
    if not _str_map(aliases) or not _str_map(devices) or "object" not in structure:
        raise HeaderError(f"{where}: 'aliases' and 'devices' must map names to names, and 'object' must be present")
    if not isinstance(same, list) or not all(isinstance(n, str) and n in aliases for n in same):
        raise HeaderError(f"{where}: 'same_object' must list alias names")
    if not isinstance(pickled, list) or not all(isinstance(p, str) for p in pickled):
        raise HeaderError(f"{where}: 'pickled' must list key paths")
    missing = sorted({v for v in aliases.values() if v not in tensor_names} | (set(devices) - tensor_names))
    clash = sorted(set(aliases) & tensor_names)
    if missing or clash:
        raise HeaderError(f"{where}: aliases or devices name tensors the tensor file does not hold ({missing[:5]}) "
                          f"or alias names the file also holds ({clash[:5]})")


def rebuild(structure: dict[str, Any], tensors: dict[str, torch.Tensor], *, where: str,
            pickled: Callable[[int], Any] | None = None) -> Any:
    """The object :func:`dict_payload` split, from the checked ``structure`` and the loaded ``tensors``.

    Aliases come back tied: the same object where they were one object, else a view of the kept tensor.

    Raises:
        HeaderError: a malformed value, a reference to a tensor neither stored nor aliased, or stored tensors that
            no key refers to.
    """
    aliases, same = structure["aliases"], set(structure["same_object"])
    used: set[str] = set()

    def resolve(name: Any) -> torch.Tensor:
        if not isinstance(name, str):
            raise HeaderError(f"{where}: a tensor reference must be a name, got {name!r}")
        if name in used:
            raise HeaderError(f"{where}: tensor {name!r} is referred to twice")
        used.add(name)
        if name in tensors:
            return tensors[name]
        if name in aliases:
            kept = tensors[aliases[name]]
            return kept if name in same else kept.view(kept.shape)
        raise HeaderError(f"{where}: refers to tensor {name!r}, which the tensor file does not hold")

    obj = decode_json(structure["object"], where, tensors=resolve, pickled=pickled)
    unused = sorted((set(tensors) | set(aliases)) - used)
    if unused:
        raise HeaderError(f"{where}: the tensor file holds {len(unused)} tensors no key refers to "
                          f"({', '.join(map(repr, unused[:5]))}); refusing to drop them")
    return obj

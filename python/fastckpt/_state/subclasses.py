"""Tensor subclasses in model state: traceable wrapper subclasses stored pickle-free, anything else refused.

A *traceable wrapper subclass* (``__tensor_flatten__`` / ``__tensor_unflatten__``: torchao's quantized weights such
as ``Int8Tensor`` / ``Float8Tensor``, quanto-style int8 + scale wrappers) has no storage of its own; it holds plain
inner tensors. It is stored the way transformers' torchao integration lays out a safetensors file:

- each inner tensor as an ordinary entry named ``{module}._{attribute}_{inner}`` (``0.weight`` with inner tensors
  ``qdata`` and ``scale`` -> ``0._weight_qdata``, ``0._weight_scale``; a top-level ``w`` -> ``_w_qdata``);
- one metadata entry per subclass tensor, its name -> JSON ``{"_type": "module.QualName", "_data": <the flatten
  context>, "_tensor_data_names": [...], "_shape": [...], "_dtype": "float32"}``, and ``"tensor_names"`` -> the JSON
  list of those names.

The flatten context is JSON from :func:`fastckpt._format.codec.encode` (enums as ``{"__enum__": [class, name]}``,
dataclasses as ``{"__dataclass__": [class, {field: value}]}``). Nothing is unpickled and no class is imported at
load: a load fills the live subclass's inner tensors in place (validated like any tensor: names, shapes, dtypes)
after checking that the live tensor has the stored class and flatten context, so the model must be quantized
the same way before it loads (``quantize_(model, config)``, then ``load_state``).

Any other tensor subclass (one with real storage whose type would be lost, e.g. a ``Parameter`` subclass carrying
quantization state in attributes, or a wrapper without ``__tensor_flatten__``) is refused with
:class:`~fastckpt.errors.TensorSubclassError` naming the tensor and its type, before anything is written.
``torch.Tensor`` and ``torch.nn.Parameter`` are plain; DTensors go through the sharded path.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fastckpt._format.codec import encode
from fastckpt.errors import TensorSubclassError

__all__ = ["TENSOR_NAMES", "is_plain", "inner_key", "flatten_subclasses", "stored_records", "expand_live",
           "refuse_subclasses"]

#: the metadata key listing the subclass tensors of a file (JSON list of names)
TENSOR_NAMES = "tensor_names"

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch build without distributed
        return False
    return isinstance(t, DTensor)


def is_plain(t: Any) -> bool:
    """True for a ``torch.Tensor`` / ``nn.Parameter`` (or a DTensor, handled elsewhere): stored as it is."""
    return type(t) in _PLAIN or _is_dtensor(t)


def inner_key(name: str, inner: str) -> str:
    """The entry an inner tensor is stored under: ``a.b.weight``, ``qdata`` -> ``a.b._weight_qdata``."""
    module, _, attr = name.rpartition(".")
    return f"{module}._{attr}_{inner}" if module else f"_{attr}_{inner}"


def _context_fallback(path: str, value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return {"__enum__": [_qualname(type(value)), value.name]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: encode(getattr(value, f.name), path=f"{path}.{f.name}", fallback=_context_fallback)
                  for f in dataclasses.fields(value)}
        return {"__dataclass__": [_qualname(type(value)), fields]}
    raise TypeError(f"{path} is a {_qualname(type(value))}, which fastckpt cannot store as JSON")


def _context_json(name: str, t: torch.Tensor, ctx: Any) -> Any:
    try:
        return encode(ctx, path="context", fallback=_context_fallback)
    except TypeError as exc:
        raise TensorSubclassError(
            f"{name!r} is a {_qualname(type(t))} whose flatten context cannot be stored without pickle ({exc}); "
            "fastckpt stores a tensor subclass as its inner tensors plus that context as JSON"
        ) from None


def _refuse(name: str, t: Any, why: str) -> TensorSubclassError:
    return TensorSubclassError(
        f"{name!r} is a {_qualname(type(t))} ({why}); fastckpt stores plain tensors and traceable wrapper subclasses "
        "(__tensor_flatten__ / __tensor_unflatten__, e.g. torchao's quantized tensors) without pickle; convert it "
        "to a plain tensor (e.g. dequantize) or to such a subclass before saving"
    )


def _flatten_one(name: str, t: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    inner_names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner: dict[str, torch.Tensor] = {}
    for attr in inner_names:
        value = getattr(t, attr)
        if not isinstance(value, torch.Tensor) or not is_plain(value) or _is_dtensor(value):
            raise _refuse(name, t, f"its inner tensor {attr!r} is a {_qualname(type(value))}: nested subclasses "
                                   "are not stored")
        inner[inner_key(name, attr)] = value.detach()
    record = {"_type": _qualname(type(t)), "_data": _context_json(name, t, ctx), "_tensor_data_names": list(inner_names),
              "_shape": list(t.shape), "_dtype": str(t.dtype).removeprefix("torch.")}
    return inner, record


def flatten_subclasses(state_dict: Mapping[str, Any], *, owner: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Replace each traceable wrapper subclass of ``state_dict`` by its inner tensors; refuse other subclasses.

    Args:
        state_dict: ``{name: tensor}`` (plain tensors pass through, in order).
        owner: what the state belongs to, for messages (``"Linear"``).

    Returns:
        ``(tensors, metadata)``: the state dict with inner tensors in place of each subclass tensor, and the
        metadata entries (one JSON record per subclass tensor plus :data:`TENSOR_NAMES`; empty when there are none).

    Raises:
        TensorSubclassError: a tensor subclass that is not a traceable wrapper, a nested one, one whose flatten
            context JSON cannot hold, or an inner name that collides with another entry (names tensor and type).
    """
    out: dict[str, Any] = {}
    records: dict[str, Any] = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor) or is_plain(t):
            out[name] = t
            continue
        if not is_traceable_wrapper_subclass(t):
            raise _refuse(name, t, f"a tensor subclass of {owner} without __tensor_flatten__, whose type and "
                                   "attributes a plain tensor entry would lose")
        inner, records[name] = _flatten_one(name, t)
        for key, value in inner.items():
            if key in state_dict or key in out:
                raise _refuse(name, t, f"its inner tensor would be stored as {key!r}, which {owner} already has")
            out[key] = value
    if not records:
        return out, {}
    metadata = {name: json.dumps(record, sort_keys=True) for name, record in records.items()}
    metadata[TENSOR_NAMES] = json.dumps(list(records))
    return out, metadata


def stored_records(files: list[Any]) -> dict[str, tuple[Any, dict[str, Any]]]:
    """``{tensor name: (file, record)}`` of the subclass tensors the opened files' metadata lists."""
    found: dict[str, tuple[Any, dict[str, Any]]] = {}
    for f in files:
        metadata = f.metadata() or {}
        if TENSOR_NAMES not in metadata:
            continue
        for name in json.loads(metadata[TENSOR_NAMES]):
            found[name] = (f, json.loads(metadata[name]))
    return found


def expand_live(live: Mapping[str, Any], records: Mapping[str, tuple[Any, dict[str, Any]]], *, owner: str,
                stored: set[str], canonical: Any = str) -> dict[str, Any]:
    """The live state dict with each wrapper subclass replaced by its inner tensors (filled in place by a load),
    after checking it against the stored record.

    Args:
        live: ``module.state_dict(keep_vars=True)``.
        records: :func:`stored_records` of the files, by (canonical) name.
        owner: the module's class name, for messages.
        stored: the tensor names the files hold (a plain entry under a subclass's name is a mismatch).
        canonical: maps a live name to the name it is stored under (``records`` and ``stored`` use those).

    Raises:
        TensorSubclassError: the stored tensor is a subclass and the live one is not, or the reverse, or their
            classes or flatten contexts differ (names the file, the tensor and both sides); another subclass.
    """
    out: dict[str, Any] = {}
    for name, t in live.items():
        rec = records.get(canonical(name))
        if isinstance(t, torch.Tensor) and not is_plain(t):
            if not is_traceable_wrapper_subclass(t):
                raise _refuse(name, t, f"a tensor subclass of {owner} without __tensor_flatten__, which fastckpt "
                                       "cannot fill")
            if rec is None:
                if canonical(name) in stored:
                    raise TensorSubclassError(
                        f"{name!r} is stored as a plain tensor but is a {_qualname(type(t))} in {owner}; load into "
                        "the model before quantizing it, then quantize")
                out[name] = t  # not in the files: reported as missing like any other name
                continue
            inner, record = _flatten_one(name, t)
            for key in ("_type", "_data", "_tensor_data_names"):
                if record[key] != rec[1].get(key):
                    raise TensorSubclassError(
                        f"{rec[0].path}: {name!r} was saved as a {rec[1].get('_type')} with {key} {rec[1].get(key)}; "
                        f"{owner} has a {record['_type']} with {key} {record[key]}; quantize the model the way "
                        "the saved one was (same class and settings) before loading")
            out.update(inner)
        elif rec is not None and isinstance(t, torch.Tensor):
            raise TensorSubclassError(
                f"{rec[0].path}: {name!r} was saved as a {rec[1].get('_type')} (inner tensors "
                f"{rec[1].get('_tensor_data_names')}); {owner} has a plain {t.dtype} tensor there; quantize the model "
                "the same way before loading")
        else:
            out[name] = t
    return out


def refuse_subclasses(metadata: Mapping[str, str], *, why: str) -> None:
    """Raise when a collected model state (``collect_model_state``'s metadata) holds subclass tensors that the
    requested save cannot record (``why`` says which save and what to do instead).

    Raises:
        TensorSubclassError: naming the subclass tensors and their types.
    """
    if TENSOR_NAMES not in metadata:
        return
    names = json.loads(metadata[TENSOR_NAMES])
    kinds = ", ".join(f"{n!r} ({json.loads(metadata[n])['_type']})" for n in names)
    raise TensorSubclassError(f"tensor subclass(es) {kinds}: {why}")

"""Pickle-free, exact JSON for the non-tensor parts of a training state (scheduler, param_groups, RNG extras).

Plain JSON covers str, int, bool, None and finite floats (Python's float repr round-trips exactly). Everything
else torch's ``state_dict`` methods produce is written as a one-key tagged object:

============================  ===========================================================
value                         JSON
============================  ===========================================================
inf, -inf, nan                ``{"__float__": "inf"}``
tuple / set / frozenset       ``{"__tuple__": [...]}`` / ``{"__set__": [...]}``
dict with non-str keys        ``{"__dict__": [[key, value], ...]}``
collections.Counter           ``{"__counter__": [[key, count], ...]}`` (MultiStepLR's milestones)
numpy scalar / array          ``{"__numpy__": [dtype, value]}`` / ``{"__ndarray__": [dtype, shape, base64]}``
torch.Tensor                  ``{"__tensor__": key}`` (stored in a safetensors file) or inline bytes
torch.dtype                   ``{"__torch_dtype__": "float32"}``
bytes                         ``{"__bytes__": base64}``
============================  ===========================================================

Callables are skipped as torch's own ``state_dict`` methods skip them (a dict entry is left out, a list item
becomes ``null``). Any other object raises ``TypeError`` naming its path: fastckpt never falls back to pickle.
"""

from __future__ import annotations

import base64
import collections
import math
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["encode", "decode"]

_TAGS = ("__float__", "__tuple__", "__set__", "__dict__", "__counter__", "__numpy__", "__ndarray__",
         "__tensor__", "__tensor_bytes__", "__torch_dtype__", "__bytes__")

TensorSink = Callable[[str, torch.Tensor], str]
"""Called with (path, tensor); stores the tensor elsewhere and returns the key to record."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def encode(value: Any, *, path: str = "state", tensor_sink: TensorSink | None = None) -> Any:
    """Turn ``value`` into JSON-serializable data that :func:`decode` turns back into an equal value.

    Args:
        value: a state_dict-like value.
        path: where ``value`` sits, for error messages (``"scheduler.last_epoch"``).
        tensor_sink: where tensors go; without it tensors are inlined as base64 bytes.

    Raises:
        TypeError: an object JSON cannot hold without pickle (names its path and type).
    """
    if isinstance(value, np.generic):  # before float: np.float64 subclasses float
        return {"__numpy__": [value.dtype.str, encode(value.item(), path=path)]}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"__float__": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.Tensor):
        if tensor_sink is not None:
            return {"__tensor__": tensor_sink(path, value)}
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor_bytes__": [str(t.dtype).removeprefix("torch."), list(t.shape), _b64(raw)]}
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        return {"__ndarray__": [arr.dtype.str, list(arr.shape), _b64(arr.tobytes())]}
    if isinstance(value, torch.dtype):
        return {"__torch_dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": _b64(bytes(value))}
    if isinstance(value, collections.Counter):
        return {"__counter__": [[encode(k, path=f"{path}[{k!r}]"), encode(v, path=f"{path}[{k!r}]")]
                                for k, v in value.items()]}
    if isinstance(value, dict):
        items = [(k, v) for k, v in value.items() if not callable(v) or isinstance(v, (torch.Tensor, type))]
        if all(isinstance(k, str) for k, _ in items) and not (len(items) == 1 and items[0][0] in _TAGS):
            return {k: encode(v, path=f"{path}.{k}", tensor_sink=tensor_sink) for k, v in items}
        return {"__dict__": [[encode(k, path=path), encode(v, path=f"{path}[{k!r}]", tensor_sink=tensor_sink)]
                             for k, v in items]}
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        out = [None if callable(v) and not isinstance(v, torch.Tensor)
               else encode(v, path=f"{path}[{i}]", tensor_sink=tensor_sink) for i, v in enumerate(seq)]
        if isinstance(value, tuple):
            return {"__tuple__": out}
        if isinstance(value, (set, frozenset)):
            return {"__set__": out}
        return out
    if callable(value):
        return None
    raise TypeError(
        f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which fastckpt cannot store without "
        "pickle; give it a state_dict() of plain values, tensors and containers"
    )


def _tensor_from_bytes(dtype: str, shape: list[int], data: str) -> torch.Tensor:
    torch_dtype = getattr(torch, dtype)
    raw = bytearray(base64.b64decode(data))
    if not raw:
        return torch.empty(shape, dtype=torch_dtype, device="cpu")
    return torch.frombuffer(raw, dtype=torch.uint8).view(torch_dtype).reshape(shape).clone()


def decode(data: Any, *, tensors: Callable[[str], torch.Tensor] | None = None) -> Any:
    """Inverse of :func:`encode`; ``tensors(key)`` returns the tensor a ``__tensor__`` tag refers to.

    Raises:
        ValueError: an unknown tag or a ``__tensor__`` reference without a ``tensors`` resolver.
    """
    if isinstance(data, list):
        return [decode(v, tensors=tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, body), = data.items()
        if tag in _TAGS:
            return _decode_tag(tag, body, tensors)
    return {k: decode(v, tensors=tensors) for k, v in data.items()}


def _decode_tag(tag: str, body: Any, tensors: Callable[[str], torch.Tensor] | None) -> Any:
    if tag == "__float__":
        return float(body)
    if tag == "__tuple__":
        return tuple(decode(v, tensors=tensors) for v in body)
    if tag == "__set__":
        return {decode(v, tensors=tensors) for v in body}
    if tag == "__dict__":
        return {_hashable(decode(k, tensors=tensors)): decode(v, tensors=tensors) for k, v in body}
    if tag == "__counter__":
        return collections.Counter({_hashable(decode(k)): decode(v) for k, v in body})
    if tag == "__numpy__":
        dtype, value = body
        return np.dtype(dtype).type(decode(value))
    if tag == "__ndarray__":
        dtype, shape, raw = body
        return np.frombuffer(base64.b64decode(raw), dtype=np.dtype(dtype)).reshape(shape).copy()
    if tag == "__tensor__":
        if tensors is None:
            raise ValueError(f"a tensor reference {body!r} was found where no tensor file is available")
        return tensors(body)
    if tag == "__tensor_bytes__":
        return _tensor_from_bytes(*body)
    if tag == "__torch_dtype__":
        return getattr(torch, body)
    if tag == "__bytes__":
        return base64.b64decode(body)
    raise ValueError(f"unknown tag {tag!r}")  # pragma: no cover - _TAGS and this function move together


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value

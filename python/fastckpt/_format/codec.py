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

``exact=True`` (plain checkpoint dicts, :mod:`fastckpt._state.plain_dict`) keeps every type as it was, with a few
more tags: ``{"__odict__": [[key, value], ...]}`` (OrderedDict), ``{"__frozenset__": [...]}``,
``{"__torch_size__": [...]}``, ``{"__torch_device__": "cuda:0"}``, ``{"__parameter__": [key, requires_grad]}``
(an ``nn.Parameter`` stored in the tensor file). A value whose type would change (a callable, a subclass of dict,
list, tuple, int, str or float such as a namedtuple or an enum, a tensor subclass, an object array) goes to
``fallback(path, value)``, which returns the JSON to record (``{"__pickled__": index}``, a value of the caller's
pickle part), or raises ``TypeError`` naming its path without one.
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
         "__tensor__", "__tensor_bytes__", "__torch_dtype__", "__bytes__", "__odict__", "__frozenset__",
         "__torch_size__", "__torch_device__", "__parameter__", "__pickled__")

TensorSink = Callable[[str, torch.Tensor], str]
"""Called with (path, tensor); stores the tensor elsewhere and returns the key to record."""

Fallback = Callable[[str, Any], Any]
"""Called with (path, value) for a value the codec cannot store exactly; returns the JSON to record."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _refuse(path: str, value: Any) -> Any:
    raise TypeError(
        f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which fastckpt cannot store without "
        "pickle; give it a state_dict() of plain values, tensors and containers"
    )


def encode(value: Any, *, path: str = "state", tensor_sink: TensorSink | None = None, exact: bool = False,
           fallback: Fallback | None = None) -> Any:
    """Turn ``value`` into JSON-serializable data that :func:`decode` turns back into an equal value.

    Args:
        value: a state_dict-like value.
        path: where ``value`` sits, for error messages (``"scheduler.last_epoch"``).
        tensor_sink: where tensors go; without it tensors are inlined as base64 bytes.
        exact: keep every type exactly (see the module docs); values whose type would change, callables included,
            go to ``fallback``.
        fallback: ``fallback(path, value)`` returns the JSON for a value the codec cannot store (with ``exact``:
            cannot store exactly); None raises ``TypeError``.

    Raises:
        TypeError: an object JSON cannot hold without pickle (names its path and type), without ``fallback``.
    """
    return _Encoder(tensor_sink, exact, fallback or _refuse).encode(value, path)


class _Encoder:
    def __init__(self, tensor_sink: TensorSink | None, exact: bool, fallback: Fallback) -> None:
        self.sink, self.exact, self.fallback = tensor_sink, exact, fallback

    def encode(self, value: Any, path: str) -> Any:
        if self.exact and not _exact_type(value):
            return self.fallback(path, value)
        if isinstance(value, np.generic):  # before float: np.float64 subclasses float
            return {"__numpy__": [value.dtype.str, self.encode(value.item(), path)]}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            if math.isfinite(value):
                return float(value)
            return {"__float__": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                return self.fallback(path, value)
            arr = np.ascontiguousarray(value)
            return {"__ndarray__": [arr.dtype.str, list(arr.shape), _b64(arr.tobytes())]}
        if isinstance(value, torch.dtype):
            return {"__torch_dtype__": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"__torch_device__": str(value)}
        if isinstance(value, (bytes, bytearray)):
            return {"__bytes__": _b64(bytes(value))}
        if isinstance(value, collections.Counter):
            return {"__counter__": [[self.encode(k, f"{path}[{k!r}]"), self.encode(v, f"{path}[{k!r}]")]
                                    for k, v in value.items()]}
        if isinstance(value, dict):
            return self._dict(value, path)
        if isinstance(value, torch.Size) and self.exact:
            return {"__torch_size__": [int(d) for d in value]}
        if isinstance(value, (list, tuple, set, frozenset)):
            return self._sequence(value, path)
        if callable(value):
            return None
        return self.fallback(path, value)

    def _tensor(self, value: torch.Tensor, path: str) -> Any:
        if self.sink is not None:
            key = self.sink(path, value)
            if self.exact and isinstance(value, torch.nn.Parameter):
                return {"__parameter__": [key, bool(value.requires_grad)]}
            return {"__tensor__": key}
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor_bytes__": [str(t.dtype).removeprefix("torch."), list(t.shape), _b64(raw)]}

    def _dict(self, value: dict, path: str) -> Any:
        keep_callables = self.exact  # exact: a callable value is not skipped but goes to the fallback
        items = [(k, v) for k, v in value.items()
                 if keep_callables or not callable(v) or isinstance(v, (torch.Tensor, type))]
        if self.exact and isinstance(value, collections.OrderedDict):
            return {"__odict__": [[self.encode(k, path), self.encode(v, _child(path, k))] for k, v in items]}
        if all(isinstance(k, str) for k, _ in items) and not (len(items) == 1 and items[0][0] in _TAGS):
            return {k: self.encode(v, f"{path}.{k}") for k, v in items}
        return {"__dict__": [[self.encode(k, path), self.encode(v, _child(path, k))] for k, v in items]}

    def _sequence(self, value: Any, path: str) -> Any:
        seq = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        out = [None if callable(v) and not isinstance(v, torch.Tensor) and not self.exact
               else self.encode(v, f"{path}[{i}]") for i, v in enumerate(seq)]
        if isinstance(value, tuple):
            return {"__tuple__": out}
        if isinstance(value, frozenset) and self.exact:
            return {"__frozenset__": out}
        if isinstance(value, (set, frozenset)):
            return {"__set__": out}
        return out


def _child(path: str, key: Any) -> str:
    return f"{path}.{key}" if isinstance(key, str) else f"{path}[{key!r}]"


#: types :func:`encode` with ``exact`` stores as they are (subclasses would come back as their base class)
_EXACT_TYPES = frozenset({type(None), bool, int, float, str, bytes, dict, collections.OrderedDict,
                          collections.Counter, list, tuple, set, frozenset, torch.Size, torch.device, torch.dtype,
                          torch.Tensor, torch.nn.Parameter, np.ndarray})


def _exact_type(value: Any) -> bool:
    if isinstance(value, np.generic):
        return value.dtype.kind in "biuf"  # real numbers and bools (no complex, datetimes, strings or objects)
    return type(value) in _EXACT_TYPES


def _torch_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _tensor_from_bytes(dtype: str, shape: list[int], data: str) -> torch.Tensor:
    torch_dtype = _torch_dtype(dtype)
    raw = bytearray(base64.b64decode(data))
    if not raw:
        return torch.empty(shape, dtype=torch_dtype, device="cpu")
    return torch.frombuffer(raw, dtype=torch.uint8).view(torch_dtype).reshape(shape).clone()


def decode(data: Any, *, tensors: Callable[[str], torch.Tensor] | None = None,
           pickled: Callable[[int], Any] | None = None) -> Any:
    """Inverse of :func:`encode`; ``tensors(key)`` returns the tensor a ``__tensor__`` tag refers to, ``pickled(i)``
    the value a ``__pickled__`` tag refers to.

    Raises:
        ValueError: an unknown tag, a ``__tensor__`` reference without a ``tensors`` resolver or a ``__pickled__``
            one without ``pickled``.
    """
    return _decode(data, tensors, pickled)


def _decode(data: Any, tensors: Callable[[str], torch.Tensor] | None, pickled: Callable[[int], Any] | None) -> Any:
    if isinstance(data, list):
        return [_decode(v, tensors, pickled) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, body), = data.items()
        if tag in _TAGS:
            return _decode_tag(tag, body, tensors, pickled)
    return {k: _decode(v, tensors, pickled) for k, v in data.items()}


def _decode_tag(tag: str, body: Any, tensors: Callable[[str], torch.Tensor] | None,
                pickled: Callable[[int], Any] | None) -> Any:
    def decode(v: Any, *, tensors: Any = tensors) -> Any:  # the resolvers are passed down
        return _decode(v, tensors, pickled)

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
        return _torch_dtype(body)
    if tag == "__torch_device__":
        if not isinstance(body, str):
            raise ValueError(f"a torch device is a string, got {body!r}")
        return torch.device(body)
    if tag == "__torch_size__":
        if not isinstance(body, list) or not all(type(d) is int for d in body):
            raise ValueError(f"a torch.Size is a list of ints, got {body!r}")
        return torch.Size(body)
    if tag == "__odict__":
        return collections.OrderedDict((_hashable(decode(k)), decode(v)) for k, v in body)
    if tag == "__frozenset__":
        return frozenset(decode(v) for v in body)
    if tag == "__parameter__":
        key, requires_grad = body
        if tensors is None or not isinstance(requires_grad, bool):
            raise ValueError(f"a parameter reference {body!r} needs a tensor file and a bool requires_grad")
        return torch.nn.Parameter(tensors(key), requires_grad=requires_grad)
    if tag == "__pickled__":
        if pickled is None:
            raise ValueError(f"a pickled value {body!r} was found where no pickle part is read")
        return pickled(body)
    if tag == "__bytes__":
        return base64.b64decode(body)
    raise ValueError(f"unknown tag {tag!r}")  # pragma: no cover - _TAGS and this function move together


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value

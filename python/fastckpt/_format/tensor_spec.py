"""safetensors' raw-memory API (``TensorSpec``, ``serialize``, ``serialize_file``, ``deserialize``), on our core.

``safetensors.torch`` re-exports these from its Rust module; tools that alias ``fastckpt.torch`` as
``safetensors.torch`` may call them. A :class:`TensorSpec` names memory by address (``data_ptr``, ``data_len``
bytes), as safetensors 0.8 does: the caller keeps that memory alive while a call runs. The bytes written are the
ones :func:`fastckpt.torch.save` writes (and safetensors' ``serialize``).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from fastckpt import _core
from fastckpt._format.dtypes import F4, to_safetensors_dtype
from fastckpt.errors import DtypeError

__all__ = ["TensorSpec", "serialize", "serialize_file", "deserialize", "metadata_pairs"]


def _dtype_name(dtype: str) -> str:
    import torch

    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(dt, torch.dtype):
        raise DtypeError(f"Unknown dtype {dtype!r}: TensorSpec takes torch-style names ('float32', 'bfloat16', ...)")
    return to_safetensors_dtype(dt, name="TensorSpec")


class TensorSpec:
    """One tensor given by raw memory: ``TensorSpec(dtype=, shape=, data_ptr=, data_len=)`` (keywords only).

    Args:
        dtype: a torch-style dtype name (``"float32"``, ``"bfloat16"``, ``"float4_e2m1fn_x2"``); ``.dtype`` is the
            safetensors name (``"F32"``).
        shape: the storage shape; for ``float4_e2m1fn_x2`` the last dimension is doubled (logical F4 shape).
        data_ptr: address of the first byte (host memory); ``data_len``: its length in bytes.

    Raises:
        fastckpt.DtypeError (a TypeError): an unknown dtype.
    """

    __slots__ = ("dtype", "shape", "data_ptr", "data_len")

    def __init__(self, *, dtype: str, shape: Sequence[int], data_ptr: int, data_len: int) -> None:
        self.dtype = _dtype_name(dtype)
        dims = [int(d) for d in shape]
        if self.dtype == F4 and dims:
            dims[-1] *= 2
        self.shape: List[int] = dims
        self.data_ptr = int(data_ptr)
        self.data_len = int(data_len)

    def __repr__(self) -> str:
        return (f"TensorSpec(dtype={self.dtype!r}, shape={self.shape}, data_ptr={self.data_ptr}, "
                f"data_len={self.data_len})")


def metadata_pairs(metadata: Dict[str, str] | None) -> List[Tuple[str, str]] | None:
    """``metadata`` as pairs for the core; None stays None (no ``__metadata__`` entry).

    Raises:
        TypeError: not a dict, or a key / value that is not a str (names the key).
    """
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of str -> str, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise TypeError(f"metadata keys must be str: got {type(key).__name__} {key!r}")
        if not isinstance(value, str):
            raise TypeError(
                f"metadata values must be str: key {key!r} holds {type(value).__name__} {value!r} "
                "(the safetensors header stores text only; convert it with str() or json.dumps())"
            )
    return list(metadata.items())


def _sources(tensor_dict: Dict[str, TensorSpec]) -> list:
    if not isinstance(tensor_dict, dict):
        raise TypeError(f"tensor_dict must be a dict of str -> TensorSpec, got {type(tensor_dict).__name__}")
    sources = []
    for name, spec in tensor_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r} ({type(name).__name__})")
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"tensor {name!r} is a {type(spec).__name__}, not a TensorSpec")
        data: Any = b""
        if spec.data_len:
            data = np.frombuffer((ctypes.c_uint8 * spec.data_len).from_address(spec.data_ptr), dtype=np.uint8)
        sources.append((name, spec.dtype, spec.shape, data, 0, None))
    return sources


def serialize(tensor_dict: Dict[str, TensorSpec], metadata: Dict[str, str] | None = None) -> bytes:
    """The safetensors bytes of ``tensor_dict`` (as safetensors' ``serialize``).

    Raises:
        TypeError: a non-str name or metadata entry, a value that is not a TensorSpec.
        ValueError / fastckpt.DtypeError: a size that does not match its shape and dtype, a reserved name.
    """
    return _core.serialize(_sources(tensor_dict), metadata_pairs(metadata))


def serialize_file(tensor_dict: Dict[str, TensorSpec], filename: str | os.PathLike[str],
                   metadata: Dict[str, str] | None = None) -> None:
    """Write :func:`serialize`'s bytes to ``filename`` (temp file + rename, fsynced). Raises as :func:`serialize`,
    and OSError."""
    _core.write_file(os.fspath(filename), _sources(tensor_dict), metadata_pairs(metadata))


def deserialize(data: bytes) -> List[Tuple[str, Dict[str, Any]]]:
    """``[(name, {"data": bytearray, "shape": [..], "dtype": "F32"})]`` in file order (safetensors' own order is
    that of a hash map: it differs between processes).

    Raises:
        fastckpt.HeaderError, fastckpt.TruncatedFileError, fastckpt.DtypeError: malformed bytes.
    """
    raw = bytes(data)
    _metadata, entries, start = _core.parse_header(raw)
    return [(name, {"data": bytearray(raw[start + begin:start + end]), "shape": list(shape), "dtype": dtype})
            for name, dtype, shape, begin, end in entries]

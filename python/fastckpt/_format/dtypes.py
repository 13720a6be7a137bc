"""The torch dtype <-> safetensors dtype name table (one place for both directions).

Names are those of the safetensors format (REFERENCE.md section 2). torch's ``float4_e2m1fn_x2`` packs two F4
values in a byte: a torch tensor of shape ``[..., n]`` is stored as F4 with shape ``[..., 2 n]``.
"""

from __future__ import annotations

import torch

from fastckpt.errors import DtypeError

__all__ = ["to_safetensors_dtype", "to_torch_dtype", "torch_shape", "stored_shape", "F4"]

F4 = "F4"

_PAIRS: list[tuple[str, str]] = [
    ("bool", "BOOL"),
    ("uint8", "U8"),
    ("int8", "I8"),
    ("uint16", "U16"),
    ("int16", "I16"),
    ("uint32", "U32"),
    ("int32", "I32"),
    ("uint64", "U64"),
    ("int64", "I64"),
    ("float16", "F16"),
    ("bfloat16", "BF16"),
    ("float32", "F32"),
    ("float64", "F64"),
    ("complex64", "C64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float4_e2m1fn_x2", F4),
]

_TO_NAME: dict[torch.dtype, str] = {}
_TO_TORCH: dict[str, torch.dtype] = {}
for _attr, _name in _PAIRS:
    _dtype = getattr(torch, _attr, None)
    if _dtype is not None:  # older torch builds lack some float8 / uint dtypes
        _TO_NAME[_dtype] = _name
        _TO_TORCH[_name] = _dtype


def to_safetensors_dtype(dtype: torch.dtype, *, name: str = "?") -> str:
    """Return the safetensors dtype name for a torch dtype.

    Raises:
        DtypeError: the format has no such dtype (complex128, quantized dtypes, ...); names tensor ``name``.
    """
    try:
        return _TO_NAME[dtype]
    except KeyError:
        raise DtypeError(
            f"tensor {name!r} has dtype {dtype}, which the safetensors format cannot store "
            f"(supported: {', '.join(str(d).removeprefix('torch.') for d in _TO_NAME)})"
        ) from None


def to_torch_dtype(dtype_name: str, *, name: str = "?", path: str = "?") -> torch.dtype:
    """Return the torch dtype for a safetensors dtype name.

    Raises:
        DtypeError: this torch build has no such dtype (e.g. F6_E2M3); names file and tensor.
    """
    try:
        return _TO_TORCH[dtype_name]
    except KeyError:
        raise DtypeError(
            f"{path}: tensor {name!r} has dtype {dtype_name}, which torch {torch.__version__} cannot represent"
        ) from None


def stored_shape(t: torch.Tensor) -> list[int]:
    """Shape as written in a safetensors header (F4's last dimension counts single values, not byte pairs)."""
    shape = list(t.shape)
    if _TO_NAME.get(t.dtype) == F4:
        if not shape:
            raise DtypeError("a 0-dim float4_e2m1fn_x2 tensor cannot be stored as F4")
        shape[-1] *= 2
    return shape


def torch_shape(dtype_name: str, shape: list[int], *, name: str = "?", path: str = "?") -> list[int]:
    """Inverse of :func:`stored_shape`: the torch shape of a stored tensor.

    Raises:
        DtypeError: an F4 tensor whose last dimension is odd (it does not fill whole bytes).
    """
    if dtype_name != F4:
        return list(shape)
    if not shape or shape[-1] % 2:
        raise DtypeError(
            f"{path}: F4 tensor {name!r} has shape {shape}; torch's float4_e2m1fn_x2 needs an even last dimension"
        )
    return [*shape[:-1], shape[-1] // 2]

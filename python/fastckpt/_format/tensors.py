"""The torch adapter: tensors -> tensor sources for the Rust writer, mapped bytes -> tensors.

A *tensor source* is what ``fastckpt._core`` writes from (see ``docs/CORE_API.md``): the tensor's whole storage
as a uint8 numpy array (a Python buffer, no copy), the byte offset of its first element, and its strides in
bytes when it is not C-contiguous, so the core gathers it in logical row-major order without a copy of the state
and without touching the live tensor. Only tensors on another device (CUDA) are copied to host memory first.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from fastckpt._format.dtypes import F4, stored_shape, to_safetensors_dtype, to_torch_dtype, torch_shape
from fastckpt.errors import DtypeError, MetaTensorError

__all__ = ["TensorSource", "CONVERTIBLE", "convert_target", "tensor_source", "tensor_sources", "tensor_from_buffer", "file_tensors", "destination_buffer"]

TensorSource = tuple[str, str, list[int], Any, int, "list[int] | None"]


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    """The whole untyped storage of ``t`` as a 1-D uint8 numpy array sharing its memory."""
    whole = torch.empty(0, dtype=torch.uint8, device="cpu").set_(t.untyped_storage())
    return whole.numpy()


#: Floating dtypes the core converts while writing (``save_state(..., dtype=...)``), by safetensors name.
CONVERTIBLE = ("F16", "BF16", "F32", "F64")


def convert_target(name: str, dtype_name: str, convert_to: str | None) -> str | None:
    """The dtype a tensor of ``dtype_name`` is stored as under ``convert_to`` (a safetensors floating dtype name):
    floating tensors convert, integer / bool / complex tensors are stored unchanged (None).

    Raises:
        DtypeError: a float8 / sub-byte floating tensor, which the core does not convert (names it).
    """
    if convert_to is None or dtype_name == convert_to:
        return None
    if dtype_name in CONVERTIBLE:
        return convert_to
    if dtype_name.startswith("F") and dtype_name != "F64":
        raise DtypeError(f"tensor {name!r} is {dtype_name}; fastckpt converts only F16, BF16, F32 and F64 while "
                         f"writing (to {convert_to}); save without dtype= or convert it first")
    return None


def tensor_source(name: str, tensor: torch.Tensor, convert_to: str | None = None) -> TensorSource:
    """Describe one tensor for the Rust writer without copying host memory.

    Args:
        name: the tensor's name in the file (an fqn such as ``"encoder.layer.0.weight"``).
        tensor: any dense tensor; non-contiguous, expanded and conjugate views are fine.
        convert_to: a safetensors floating dtype name (``"BF16"``, ``"F16"``, ``"F32"``): a floating tensor is
            stored in it, converted by the core while it is written (see :func:`convert_target`).

    Returns:
        ``(name, dtype, shape, buffer, byte_offset, byte_strides)`` as ``docs/CORE_API.md`` defines, with a
        seventh entry (the target dtype) when the tensor is converted.

    Raises:
        DtypeError: the dtype has no safetensors name (e.g. complex128), or cannot be converted.
        ValueError: a sparse or quantized tensor, or not a tensor.
        MetaTensorError (a NotImplementedError, as safetensors): a meta tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.is_quantized:
        raise ValueError(f"tensor {name!r} is quantized ({tensor.dtype}); save its int_repr() and scales instead")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor {name!r} has layout {tensor.layout}; only dense (strided) tensors can be saved")
    if tensor.is_meta:
        raise MetaTensorError(f"tensor {name!r} is on the meta device and has no data to save")
    t = tensor.detach()
    dtype_name = to_safetensors_dtype(t.dtype, name=name)
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if dtype_name == F4 and not t.is_contiguous():
        t = t.contiguous()  # packed sub-byte values cannot be gathered element by element
    shape = stored_shape(t)
    target = convert_target(name, dtype_name, convert_to)
    tail: tuple = () if target is None else (target,)
    if t.numel() == 0:
        return (name, dtype_name, shape, b"", 0, None, *tail)  # type: ignore[return-value]
    itemsize = t.element_size()
    strides = None if t.is_contiguous() else [s * itemsize for s in t.stride()]
    return (name, dtype_name, shape, _storage_bytes(t), t.storage_offset() * itemsize, strides,  # type: ignore[return-value]
            *tail)


def tensor_sources(state_dict: Mapping[str, torch.Tensor], convert_to: str | None = None) -> list[TensorSource]:
    """:func:`tensor_source` for every entry of a flat ``{name: tensor}`` mapping, in its order (floating tensors
    converted to ``convert_to`` while written, when given).

    Raises:
        ValueError: ``state_dict`` is not a mapping (as safetensors). TypeError: a name is not a str (as safetensors).
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"expected a dict of str -> torch.Tensor, got {type(state_dict).__name__}")
    sources = []
    for name, tensor in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r} ({type(name).__name__})")
        sources.append(tensor_source(name, tensor, convert_to))
    return sources


def tensor_from_buffer(
    buffer: Any, dtype_name: str, shape: list[int], begin: int, end: int, *, name: str = "?", path: str = "?"
) -> torch.Tensor:
    """A tensor viewing bytes ``[begin, end)`` of a writable buffer (a private file mapping), without a copy.

    ``begin`` and ``end`` are absolute byte offsets in ``buffer``. A tensor whose offset is not a multiple of its
    item size (legal in foreign files) is copied so that torch sees aligned memory.

    Raises:
        DtypeError: the dtype has no torch equivalent in this build, or an F4 shape with an odd last dimension.
    """
    dtype = to_torch_dtype(dtype_name, name=name, path=path)
    shape_t = torch_shape(dtype_name, shape, name=name, path=path)
    nbytes = end - begin
    if nbytes == 0:
        return torch.empty(shape_t, dtype=dtype, device="cpu")
    itemsize = dtype.itemsize
    if begin % itemsize == 0:
        flat = torch.frombuffer(buffer, dtype=dtype, count=nbytes // itemsize, offset=begin)
    else:
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=begin)
        flat = raw.clone().view(dtype)
    return flat.view(shape_t)


def file_tensors(file: Any) -> dict[str, torch.Tensor]:
    """Every tensor of an opened ``fastckpt._core.SafetensorsFile``, in file order, as zero-copy CPU views of its
    private mapping (``safetensors.torch.load_file``'s result, from a file already opened and validated).

    Raises:
        DtypeError: a dtype this torch build cannot represent (names the file and the tensor).
    """
    view, start = memoryview(file), file.data_start
    return {name: tensor_from_buffer(view, dtype_name, shape, start + begin, start + end, name=name, path=file.path)
            for name, dtype_name, shape, begin, end in file.tensors()}


def destination_buffer(tensor: torch.Tensor) -> np.ndarray | None:
    """The bytes of a CPU, C-contiguous tensor as a writable uint8 array (the read_into target), else None.

    The core then fills the live tensor straight from the file: no second copy of the state.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        return None
    if tensor.numel() == 0:
        return None
    t = tensor.detach()
    try:
        return t.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError) as exc:  # pragma: no cover - exotic dtypes numpy cannot view
        raise DtypeError(f"cannot expose {tensor.dtype} memory as bytes: {exc}") from exc

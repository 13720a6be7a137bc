"""Drop-in replacement for ``safetensors.torch`` (0.8): same functions, signatures and return values.

The whole public surface of ``safetensors.torch`` is here (``storage_ptr``, ``storage_size``, ``TensorSpec``,
``serialize``, ``serialize_file``, ``deserialize`` too), so ``sys.modules["safetensors.torch"] = fastckpt.torch``
keeps ``import transformers`` working.

Differences that only add: files are written by several threads straight from tensor memory and fsynced
(``durable=True``); non-contiguous tensors are written in logical order instead of refused (deliberately: the
official writer raises ValueError); ``load`` also reads F8_E8M0 and F4 (which the official bytes loader misses);
errors are :mod:`fastckpt.errors` classes that name the file, tensor and sizes (they still subclass the builtin
safetensors raises: ValueError / TypeError / KeyError / FileNotFoundError / NotImplementedError for meta tensors).

Example:
    >>> from fastckpt.torch import save_file, load_file
    >>> save_file({"embedding": torch.zeros(512, 1024)}, "model.safetensors")
    >>> load_file("model.safetensors")["embedding"].shape
    torch.Size([512, 1024])
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple, Union

import torch

from fastckpt import _core
from fastckpt._format.tensor_spec import TensorSpec, deserialize, metadata_pairs, serialize, serialize_file
from fastckpt._format.tensors import tensor_from_buffer, tensor_sources
from fastckpt._io.location import check_location
from fastckpt._io.safe_open import safe_open
from fastckpt._state.model import apply_module_load, find_aliases, plan_module_load

__all__ = [
    "save_file", "load_file", "save", "load", "safe_open", "save_model", "load_model",
    "storage_ptr", "storage_size", "TensorSpec", "serialize", "serialize_file", "deserialize",
]

PathLike = Union[str, "os.PathLike[str]"]
_metadata_pairs = metadata_pairs


def storage_ptr(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage (0 for a meta tensor), as ``safetensors.torch.storage_ptr``."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return 0


def storage_size(tensor: torch.Tensor) -> int:
    """The size in bytes of ``tensor``'s whole storage (for a meta tensor: its own size), as safetensors'."""
    try:
        return tensor.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        return tensor.nelement() * tensor.element_size()


def _refuse_shared(tensors: Dict[str, torch.Tensor]) -> None:
    """safetensors refuses tensors that share memory; so do we, naming every group (C5)."""
    if not isinstance(tensors, dict):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors).__name__}")
    groups = find_aliases(tensors, any_overlap=True)
    if groups:
        raise RuntimeError(
            "Some tensors share memory, this would store duplicate memory on disk and load as separate tensors: "
            f"{[sorted(g) for g in groups]}. Use fastckpt.torch.save_model (or clone() one of them)."
        )


def save_file(
    tensors: Dict[str, torch.Tensor],
    filename: PathLike,
    metadata: Dict[str, str] | None = None,
    *,
    durable: bool = True,
    threads: int = 0,
) -> None:
    """Save a dict of tensors to ``filename`` in safetensors format, byte-identical to ``safetensors.torch``.

    Args:
        tensors: ``{name: tensor}``; any dtype the format knows, any device, contiguous or not.
        filename: the file to write; it is replaced atomically (temp file in its folder + rename).
        metadata: text-only header metadata (``{str: str}``).
        durable: fsync the file and its folder before returning (default True).
        threads: writer threads; 0 picks min(8, cores).

    Raises:
        TypeError: a metadata value or a tensor name is not a str (names it).
        ValueError: ``tensors`` is not a dict; a reserved (``__metadata__``) or control-character name, a sparse
            tensor, a value that is not a tensor; a header over ``fastckpt._core.MAX_HEADER_BYTES`` (100 MB, what
            every safetensors reader refuses; nothing is written).
        fastckpt.MetaTensorError (a NotImplementedError, as safetensors): a meta tensor.
        RuntimeError: two tensors share memory (as safetensors).
        fastckpt.DtypeError: a dtype the format cannot store.
        OSError: the file cannot be written; the previous file, if any, is untouched.
    """
    check_location(filename, "filename")
    _refuse_shared(tensors)
    pairs = _metadata_pairs(metadata)
    _core.write_file(os.fspath(filename), tensor_sources(tensors), pairs, durable=durable, threads=threads)


def save(tensors: Dict[str, torch.Tensor], metadata: Dict[str, str] | None = None) -> bytes:
    """Serialize a dict of tensors to safetensors bytes (the same bytes :func:`save_file` writes)."""
    _refuse_shared(tensors)
    return _core.serialize(tensor_sources(tensors), _metadata_pairs(metadata))


def load_file(filename: PathLike, device: Union[str, int] = "cpu", *, backend: str = "mmap") -> Dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file (``{name: tensor}`` in file order), like ``safetensors.torch``.

    With ``backend="mmap"`` (default) CPU tensors view a private, writable mapping of the file: no copy, and
    writing to them never reaches the file. ``backend="pread"`` maps nothing and reads each tensor into its own
    memory by positional reads.

    Raises:
        FileNotFoundError, fastckpt.HeaderError, fastckpt.TruncatedFileError, fastckpt.DtypeError;
        ValueError: an unknown ``backend``.
    """
    with safe_open(filename, framework="pt", device=device, backend=backend) as f:
        return f.get_tensors()


def load(data: bytes) -> Dict[str, torch.Tensor]:
    """Load tensors from safetensors bytes (one copy of ``data``, then zero-copy views of it).

    Raises:
        fastckpt.HeaderError, fastckpt.TruncatedFileError, fastckpt.DtypeError: malformed bytes.
    """
    metadata, entries, data_start = _core.parse_header(bytes(data))
    del metadata
    buffer = bytearray(data)  # writable, so torch.frombuffer gives warning-free views
    return {
        name: tensor_from_buffer(buffer, dtype_name, shape, data_start + begin, data_start + end,
                                 name=name, path="<bytes>")
        for name, dtype_name, shape, begin, end in entries
    }


def save_model(model: torch.nn.Module, filename: PathLike, metadata: Dict[str, str] | None = None,
               force_contiguous: bool = True) -> None:
    """Save a module's state dict, storing tied (shared) tensors once, as ``safetensors.torch.save_model``.

    The name kept for a group of tied tensors is the sorted-first one covering the whole storage (safetensors'
    rule); each dropped name is recorded in the metadata as ``{dropped: kept}``.
    """
    check_location(filename, "filename")
    del force_contiguous  # fastckpt writes non-contiguous tensors in logical order anyway
    state_dict = model.state_dict()
    metadata = dict(metadata) if metadata is not None else None
    for group in find_aliases(state_dict):
        keep = sorted(group)[0]
        for dropped in sorted(group):
            if dropped != keep:
                metadata = {} if metadata is None else metadata
                metadata.setdefault(dropped, keep)
                del state_dict[dropped]
    save_file(state_dict, filename, metadata=metadata)


def load_model(model: torch.nn.Module, filename: PathLike, strict: bool = True,
               device: Union[str, int] = "cpu", *, backend: str = "mmap") -> Tuple[List[str], List[str]]:
    """Load a file written by :func:`save_model` into ``model``; tied tensors are understood.

    A file that stores separately, with different values, two names the model ties (``b.weight is a.weight``)
    reports the second as unexpected (safetensors' rule); byte-identical copies are accepted. Names saved from
    a ``torch.compile``'d model (``_orig_mod.``) match the plain model's, and the reverse. Under ``strict`` the
    model is left untouched when keys do not match.

    Returns:
        ``(missing, unexpected)``: lists of names, as ``safetensors.torch.load_model``.

    Raises:
        RuntimeError: ``strict`` and some names are missing or unexpected (as safetensors).
    """
    check_location(filename, "filename")
    del device  # tensors land on the device of the parameter they are loaded into
    if backend not in ("mmap", "pread"):
        raise ValueError(f'backend "{backend}" is invalid (expected one of: "mmap", "pread")')
    plan = plan_module_load(model, [_core.SafetensorsFile(os.fspath(filename))], strict=False)
    missing, unexpected = plan.missing_keys, plan.unexpected_keys
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(error)
    apply_module_load(plan)  # only a load that passed its checks changes the model
    return missing, unexpected

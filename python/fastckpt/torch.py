"""Drop-in replacement for ``safetensors.torch`` (0.8): same functions, signatures and return values.

Differences that only add: files are written by several threads straight from tensor memory and fsynced
(``durable=True``); non-contiguous tensors are written in logical order instead of refused; ``load`` also reads
F8_E8M0 and F4 (which the official bytes loader misses); errors are :mod:`fastckpt.errors` classes that name the
file, tensor and sizes (they still subclass ValueError / TypeError / KeyError / FileNotFoundError).

Example:
    >>> from fastckpt.torch import save_file, load_file
    >>> save_file({"embedding": torch.zeros(512, 1024)}, "model.safetensors")
    >>> load_file("model.safetensors")["embedding"].shape
    torch.Size([512, 1024])
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple, Union

import torch

from fastckpt import _core
from fastckpt._format.tensors import tensor_from_buffer, tensor_sources
from fastckpt._state.model import find_aliases, load_into_module
from fastckpt.errors import KeyMismatchError

__all__ = ["save_file", "load_file", "save", "load", "safe_open", "save_model", "load_model"]

PathLike = Union[str, "os.PathLike[str]"]


def _metadata_pairs(metadata: Dict[str, str] | None) -> List[Tuple[str, str]] | None:
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


def _refuse_shared(tensors: Dict[str, torch.Tensor]) -> None:
    """safetensors refuses tensors that share memory; so do we, naming every group (C5)."""
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
        TypeError: a metadata value is not a str (names the key).
        ValueError: a reserved (``__metadata__``) or control-character name, a sparse tensor.
        RuntimeError: two tensors share memory (as safetensors).
        fastckpt.DtypeError: a dtype the format cannot store.
        OSError: the file cannot be written; the previous file, if any, is untouched.
    """
    _refuse_shared(tensors)
    pairs = _metadata_pairs(metadata)
    _core.write_file(os.fspath(filename), tensor_sources(tensors), pairs, durable=durable, threads=threads)


def save(tensors: Dict[str, torch.Tensor], metadata: Dict[str, str] | None = None) -> bytes:
    """Serialize a dict of tensors to safetensors bytes (the same bytes :func:`save_file` writes)."""
    _refuse_shared(tensors)
    return _core.serialize(tensor_sources(tensors), _metadata_pairs(metadata))


class _Slice:
    """A lazily sliced tensor, as ``safe_open(...).get_slice(name)`` returns (``get_shape``, ``get_dtype``, ``[]``)."""

    def __init__(self, tensor: torch.Tensor, dtype_name: str, shape: List[int]) -> None:
        self._tensor = tensor
        self._dtype_name = dtype_name
        self._shape = shape

    def get_shape(self) -> List[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return self._dtype_name

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._tensor[index].clone()


class safe_open:  # noqa: N801 - the name safetensors users import
    """Open a safetensors file lazily: the header is validated, the data is mapped, nothing is read yet.

    Args:
        filename: path of a ``.safetensors`` file.
        framework: ``"pt"`` (``"torch"`` and ``"pytorch"`` are accepted too).
        device: where ``get_tensor`` puts tensors (``"cpu"``, ``"cuda:0"``, an int, a ``torch.device``).

    Raises:
        FileNotFoundError / PermissionError: the file cannot be opened.
        fastckpt.HeaderError, fastckpt.TruncatedFileError, fastckpt.DtypeError: the file is malformed.

    Example:
        >>> with safe_open("model.safetensors", framework="pt") as f:
        ...     w = f.get_tensor(f.keys()[0])
    """

    def __init__(self, filename: PathLike, framework: str = "pt", device: Union[str, int, torch.device] = "cpu",
                 **_ignored: Any) -> None:
        if framework not in ("pt", "torch", "pytorch"):
            raise ValueError(f"fastckpt.torch.safe_open only serves torch tensors (framework='pt'), got {framework!r}")
        self._path = os.fspath(filename)
        self._device = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
        self._file = _core.SafetensorsFile(self._path)
        self._view = memoryview(self._file)
        self._entries = {e[0]: e for e in self._file.tensors()}

    def __enter__(self) -> safe_open:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> List[str]:
        """Tensor names, sorted (as safetensors)."""
        return sorted(self._entries)

    def offset_keys(self) -> List[str]:
        """Tensor names in the order their bytes appear in the file."""
        return list(self._entries)

    def metadata(self) -> Dict[str, str] | None:
        """The header's ``__metadata__`` (``None`` when the file has none)."""
        return self._file.metadata()

    def _mapped(self, name: str) -> torch.Tensor:
        try:
            _, dtype_name, shape, begin, end = self._entries[name]
        except KeyError:
            raise KeyMismatchError(f"{self._path}: no tensor named {name!r} ({len(self._entries)} tensors)") from None
        start = self._file.data_start
        return tensor_from_buffer(self._view, dtype_name, shape, start + begin, start + end,
                                  name=name, path=self._path)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` on the requested device (on CPU: a zero-copy view of a private mapping)."""
        t = self._mapped(name)
        return t if self._device.type == "cpu" else t.to(self._device)

    def get_slice(self, name: str) -> _Slice:
        """A slice handle: ``f.get_slice("w")[:, 2:4]`` reads only what the slice covers."""
        t = self._mapped(name)
        _, dtype_name, shape, _, _ = self._entries[name]
        return _Slice(t if self._device.type == "cpu" else t.to(self._device), dtype_name, shape)

    def get_tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor, in file order."""
        return {name: self.get_tensor(name) for name in self._entries}


def load_file(filename: PathLike, device: Union[str, int] = "cpu", **_ignored: Any) -> Dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file (``{name: tensor}`` in file order), like ``safetensors.torch``.

    On CPU the tensors view a private, writable mapping of the file: no copy, and writing to them never
    reaches the file.

    Raises:
        FileNotFoundError, fastckpt.HeaderError, fastckpt.TruncatedFileError, fastckpt.DtypeError.
    """
    with safe_open(filename, framework="pt", device=device) as f:
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
               device: Union[str, int] = "cpu", **_ignored: Any) -> Tuple[List[str], List[str]]:
    """Load a file written by :func:`save_model` into ``model``; tied tensors are understood.

    Returns:
        ``(missing, unexpected)``: lists of names, as ``safetensors.torch.load_model``.

    Raises:
        RuntimeError: ``strict`` and some names are missing or unexpected (as safetensors).
    """
    del device  # tensors land on the device of the parameter they are loaded into
    missing, unexpected = load_into_module(model, os.fspath(filename), strict=False)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(error)
    return missing, unexpected

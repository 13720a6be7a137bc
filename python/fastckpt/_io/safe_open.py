"""``safe_open``: lazy access to one safetensors file, as ``safetensors.safe_open`` (0.8) serves it to torch.

Two backends, as in safetensors 0.8:

- ``"mmap"`` (default): the file is mapped privately and writably; CPU tensors are zero-copy views of the mapping
  (writes to them never reach the file).
- ``"pread"``: nothing is mapped; each tensor is read into its own memory by the core's positional reads, and a
  slice whose first index selects rows reads only those rows. Memory stays bounded by what the caller asks for.

Leaving the ``with`` block closes the handle: the file descriptor and the handle's reference to the mapping are
dropped (tensors already taken keep their memory), and every later call raises
:class:`~fastckpt.errors.ClosedFileError` ("File is closed"), as safetensors does.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Union

import torch

from fastckpt import _core
from fastckpt._format.dtypes import F4, to_torch_dtype, torch_shape
from fastckpt._format.tensors import destination_buffer, tensor_from_buffer
from fastckpt._io.location import check_location
from fastckpt.errors import ClosedFileError, KeyMismatchError

__all__ = ["safe_open", "BACKENDS"]

BACKENDS = ("mmap", "pread")


class _Slice:
    """A lazily sliced tensor, as ``safe_open(...).get_slice(name)`` returns (``get_shape``, ``get_dtype``, ``[]``)."""

    def __init__(self, owner: safe_open, name: str, dtype_name: str, shape: List[int]) -> None:
        self._owner = owner
        self._name = name
        self._dtype_name = dtype_name
        self._shape = shape

    def get_shape(self) -> List[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return self._dtype_name

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._owner._slice(self._name, index)


def _memory_bytes() -> int:
    """The machine's physical memory in bytes (what a prefetch is bounded by)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 32


def _row_window(index: Any, rows: int) -> tuple[int, int, Any] | None:
    """For an index whose first entry is an int or a slice: ``(first_row, end_row, index shifted to the window)``."""
    parts = index if isinstance(index, tuple) else (index,)
    if not parts:
        return None
    first = parts[0]
    if isinstance(first, bool) or not isinstance(first, (int, slice)):
        return None
    if isinstance(first, int):
        row = first + rows if first < 0 else first
        if not 0 <= row < rows:
            return None  # let torch raise its IndexError on the full shape
        return row, row + 1, (0, *parts[1:])
    start, stop, step = first.indices(rows)
    picked = range(start, stop, step)
    if step < 0 or len(picked) == 0:
        return None
    return start, picked[-1] + 1, (slice(0, picked[-1] + 1 - start, step), *parts[1:])


class safe_open:  # noqa: N801 - the name safetensors users import
    """Open a safetensors file lazily: the header is validated, nothing is read yet.

    Args:
        filename: path of a ``.safetensors`` file.
        framework: ``"pt"`` (``"torch"`` and ``"pytorch"`` are accepted too).
        device: where ``get_tensor`` puts tensors (``"cpu"``, ``"cuda:0"``, an int, a ``torch.device``).
        backend: ``"mmap"`` (default) or ``"pread"`` (no mapping; bounded-memory positional reads).

    Raises:
        FileNotFoundError / PermissionError: the file cannot be opened.
        fastckpt.HeaderError, fastckpt.TruncatedFileError, fastckpt.DtypeError: the file is malformed.
        ValueError: an unknown ``framework`` or ``backend``. TypeError: an unknown keyword.
        fastckpt.ClosedFileError (a ValueError): any call after the ``with`` block.

    Example:
        >>> with safe_open("model.safetensors", framework="pt", backend="pread") as f:
        ...     w = f.get_tensor(f.keys()[0])
    """

    def __init__(self, filename: Union[str, os.PathLike[str]], framework: str = "pt",
                 device: Union[str, int, torch.device] = "cpu", *, backend: str = "mmap") -> None:
        if framework not in ("pt", "torch", "pytorch"):
            raise ValueError(f"fastckpt.torch.safe_open only serves torch tensors (framework='pt'), got {framework!r}")
        if backend not in BACKENDS:
            raise ValueError(f'backend "{backend}" is invalid (expected one of: "mmap", "pread")')
        check_location(filename, "filename")
        self._path = os.fspath(filename)
        self._device = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
        self._backend = backend
        self._file: Any = _core.SafetensorsFile(self._path, mmap=backend == "mmap")
        self._view: Any = memoryview(self._file) if backend == "mmap" else None
        self._entries = {e[0]: e for e in self._file.tensors()}
        self._metadata = self._file.metadata()
        self._closed = False

    def __enter__(self) -> safe_open:
        self._check_open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Drop the file descriptor and this handle's mapping; tensors already taken stay valid."""
        if self._closed:
            return
        self._closed = True
        self._file.close()
        # drop our references only: a tensor taken from the mapping holds the memoryview (and through it the
        # mapping) itself, so the mapping goes away with the last such tensor, never under one
        self._file = self._view = None

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedFileError(f"{self._path}: File is closed (used after its `with` block)")

    def keys(self) -> List[str]:
        """Tensor names, sorted (as safetensors)."""
        self._check_open()
        return sorted(self._entries)

    def offset_keys(self) -> List[str]:
        """Tensor names in the order their bytes appear in the file."""
        self._check_open()
        return list(self._entries)

    def metadata(self) -> Dict[str, str] | None:
        """The header's ``__metadata__`` (``None`` when the file has none)."""
        self._check_open()
        return self._metadata

    def _entry(self, name: str) -> tuple:
        self._check_open()
        try:
            return self._entries[name]
        except KeyError:
            raise KeyMismatchError(f"{self._path}: no tensor named {name!r} ({len(self._entries)} tensors)") from None

    def _read(self, name: str) -> torch.Tensor:
        """The whole tensor on CPU: a view of the mapping (mmap) or freshly read memory (pread)."""
        _, dtype_name, shape, begin, end = self._entry(name)
        if self._backend == "mmap":
            start = self._file.data_start
            return tensor_from_buffer(self._view, dtype_name, shape, start + begin, start + end,
                                      name=name, path=self._path)
        t = torch.empty(torch_shape(dtype_name, shape, name=name, path=self._path),
                        dtype=to_torch_dtype(dtype_name, name=name, path=self._path))
        buf = destination_buffer(t)
        if buf is not None:
            self._file.read_into([(name, buf)])
        return t

    def _rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of a tensor, read by positional reads of only their bytes (pread backend)."""
        _, dtype_name, shape, _, _ = self._entry(name)
        full = torch_shape(dtype_name, shape, name=name, path=self._path)
        t = torch.empty([hi - lo, *full[1:]], dtype=to_torch_dtype(dtype_name, name=name, path=self._path))
        buf = destination_buffer(t)
        if buf is not None:
            row_bytes = buf.size // (hi - lo)
            self._file.read_ranges([(name, lo * row_bytes, buf)])
        return t

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._device.type == "cpu" else t.to(self._device)

    def _slice(self, name: str, index: Any) -> torch.Tensor:
        _, dtype_name, shape, _, _ = self._entry(name)
        window = None
        if self._backend == "pread" and dtype_name != F4 and not dtype_name.startswith("F6") and shape:
            window = _row_window(index, shape[0])
        if window is None:
            part = self._read(name)[index]
            return self._on_device(part.clone() if self._backend == "mmap" else part.contiguous())
        lo, hi, shifted = window
        return self._on_device(self._rows(name, lo, hi)[shifted].contiguous())

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` on the requested device (on CPU with mmap: a zero-copy view of a private mapping)."""
        return self._on_device(self._read(name))

    def get_slice(self, name: str) -> _Slice:
        """A slice handle: ``f.get_slice("w")[:, 2:4]``; with ``backend="pread"`` only the rows it covers are read."""
        _, dtype_name, shape, _, _ = self._entry(name)
        return _Slice(self, name, dtype_name, shape)

    def get_tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor, in file order: the mmap backend hands out zero-copy views of the private file mapping,
        after a ``posix_fadvise(WILLNEED)`` hint on a cold data section (the kernel reads the first ``read_ahead_kb``
        of it at once; touching the pages brings the rest by the kernel's fault readahead, overlapped with the
        touching); the pread backend reads every tensor in one parallel core call (file order, readahead-hinted).

        Why views and not a read into fresh memory (issue 26, measured cold on the 0.37 GB weights of gpt-1GB,
        2 shared cores): positional reads into a fresh anonymous buffer (16 x 8 MiB in flight, huge pages) took
        0.5-0.7 s against 0.16-0.25 s for the mapping; the read allocates every page twice (page cache and buffer)
        and copies every byte once more, which is CPU the two cores do not have (benches/RESULTS.md).
        """
        self._check_open()
        if self._backend == "mmap":
            self._file.prefetch(max_bytes=_memory_bytes() // 4)
            return {name: self.get_tensor(name) for name in self._entries}
        out, targets = {}, []
        for name, dtype_name, shape, _, _ in self._entries.values():
            t = torch.empty(torch_shape(dtype_name, shape, name=name, path=self._path),
                            dtype=to_torch_dtype(dtype_name, name=name, path=self._path))
            buf = destination_buffer(t)
            if buf is not None:
                targets.append((name, buf))
            out[name] = t
        self._file.read_into(targets)
        return {name: self._on_device(t) for name, t in out.items()}

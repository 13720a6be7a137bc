"""fastckpt's Rust core (``fastckpt._core``): the safetensors format, a parallel zero-copy writer, a private-mmap
reader and an atomic folder commit. The contract is docs/CORE_API.md.

Errors: ``HeaderError``, ``TruncatedFileError``, ``DtypeError``, ``KeyMismatchError``, ``IntegrityError`` from
:mod:`fastckpt.errors`; ``ValueError`` for invalid arguments; the builtin ``OSError`` subclass for the errno
(``FileNotFoundError``, ``PermissionError``, ...) for plain I/O failures, with the path as ``filename``.

Source buffers are read with the GIL released: do not resize or write to them while a call runs.
"""

import os
import sys
from collections.abc import Iterable, Sequence
from typing import TypeAlias, final

from typing_extensions import Buffer

__all__ = ["SafetensorsFile", "commit_dir", "parse_header", "serialize", "write_file", "write_files"]

#: ``(name, dtype, shape, buffer, byte_offset, byte_strides)``: a tensor of safetensors dtype ``dtype``
#: (``"F32"``, ``"BF16"``, ``"F4"``, ...) and logical ``shape`` whose first element is at ``byte_offset`` bytes
#: in ``buffer`` (any C-contiguous buffer, e.g. a uint8 numpy view of the tensor's whole storage).
#: ``byte_strides`` (bytes, >= 0) or ``None`` for C-contiguous; sub-byte dtypes (F4, F6_*) must be contiguous.
_TensorSource: TypeAlias = tuple[str, str, Sequence[int], Buffer, int, Sequence[int] | None]
#: ``(name, dtype, shape, begin, end)``; begin/end are byte offsets relative to the data section.
_TensorEntry: TypeAlias = tuple[str, str, list[int], int, int]
#: ``__metadata__`` as ordered pairs; ``None`` writes no ``__metadata__`` key, ``[]`` writes ``{}``.
_Metadata: TypeAlias = Sequence[tuple[str, str]] | None
_StrPath: TypeAlias = str | os.PathLike[str]

def write_file(
    path: _StrPath,
    tensors: Iterable[_TensorSource],
    metadata: _Metadata,
    *,
    durable: bool = True,
    threads: int = 0,
    chunk_bytes: int = 8 << 20,
) -> int:
    """Write one safetensors file, byte-identical to safetensors 0.8's ``save_file``.

    Args:
        path: the target file; written through a temp file in its folder, then renamed over it.
        tensors: the tensor sources, in any order (the file orders them by dtype rank, then name).
        metadata: ``__metadata__`` pairs, or None.
        durable: fsync the file, rename, fsync the folder. False: no fsync.
        threads: worker threads (0 = min(8, cores)).
        chunk_bytes: bytes per positional write.

    Returns:
        The file size in bytes.

    Raises:
        ValueError: a bad name (``__metadata__``, control characters, duplicates), shape, stride or offset.
        DtypeError: an unknown dtype, a strided sub-byte tensor, or a shape that is not a whole number of bytes.
        OSError: the I/O failed (the temp file is removed, the target untouched).
    """

def write_files(
    jobs: Iterable[tuple[_StrPath, Iterable[_TensorSource], _Metadata]],
    *,
    durable: bool = True,
    threads: int = 0,
    chunk_bytes: int = 8 << 20,
) -> list[int]:
    """Write several files in one parallel pass (all chunks share one worker pool).

    If any file fails, no target is touched and every temp file is removed. Returns each file's size in bytes.
    Raises as :func:`write_file`.
    """

def serialize(tensors: Iterable[_TensorSource], metadata: _Metadata) -> bytes:
    """The exact bytes :func:`write_file` would write, in memory. Raises as :func:`write_file`, less OSError."""

def parse_header(data: Buffer) -> tuple[dict[str, str] | None, list[_TensorEntry], int]:
    """Validate a whole in-memory safetensors file.

    Returns:
        ``(metadata, tensors, data_start)``: metadata or None, the tensors in offset order, 8 + header length.

    Raises:
        HeaderError, TruncatedFileError, DtypeError: see docs/CORE_API.md's validation rules.
    """

def commit_dir(staging: _StrPath, target: _StrPath, *, durable: bool = True) -> None:
    """Put the finished folder ``staging`` at ``target`` in one step.

    A rename when ``target`` does not exist; otherwise ``renameat2(RENAME_EXCHANGE)`` and removal of the old
    tree. ``durable``: fsync the parent folder. Raises ValueError when ``staging`` is not a folder, OSError.
    """

@final
class SafetensorsFile:
    """An opened, validated safetensors file, mapped privately and writably (copy-on-write: writes through
    views never reach the file). Supports the buffer protocol: ``memoryview(f)`` is the whole file as a
    writable 1-D uint8 buffer that keeps the mapping alive.

    Example:
        >>> f = SafetensorsFile("model.safetensors")
        >>> name, dtype, shape, begin, end = f.tensors()[0]
        >>> raw = memoryview(f)[f.data_start + begin : f.data_start + end]
    """

    def __new__(cls, path: _StrPath) -> SafetensorsFile:
        """Open and fully validate ``path``.

        Raises:
            HeaderError, TruncatedFileError, DtypeError: a malformed file. OSError: it cannot be opened.
        """

    @property
    def path(self) -> str:
        """The path it was opened with."""

    @property
    def file_size(self) -> int:
        """The file size in bytes."""

    @property
    def data_start(self) -> int:
        """8 + the header length: tensor offsets are relative to it."""

    def metadata(self) -> dict[str, str] | None:
        """``__metadata__`` (file order), or None when absent."""

    def tensors(self) -> list[_TensorEntry]:
        """``(name, dtype, shape, begin, end)`` in file (offset) order."""

    def read_into(self, targets: Sequence[tuple[str, Buffer]], *, threads: int = 0) -> None:
        """Fill each writable, C-contiguous buffer with its tensor's bytes by parallel positional reads of the
        file (not the mapping), GIL released. Buffers that overlap (aliases of one storage) are filled one after
        the other in list order, so the later target's bytes win where they overlap.

        Raises:
            KeyMismatchError: an unknown tensor name.
            ValueError: a buffer of the wrong size, read-only or non-contiguous, or the file was closed.
            TruncatedFileError, OSError: the file shrank or cannot be read.
        """

    def close(self) -> None:
        """Drop the file handle; the mapping and every view of it stay valid."""

    if sys.version_info >= (3, 12):
        def __buffer__(self, flags: int, /) -> memoryview: ...
        def __release_buffer__(self, buffer: memoryview, /) -> None: ...

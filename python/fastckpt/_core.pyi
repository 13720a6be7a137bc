"""fastckpt's Rust core (``fastckpt._core``): the safetensors format, a parallel zero-copy writer, a private-mmap
reader and an atomic folder commit. The contract is docs/CORE_API.md.

Errors: ``HeaderError``, ``TruncatedFileError``, ``DtypeError``, ``KeyMismatchError``, ``IntegrityError`` from
:mod:`fastckpt.errors`; ``ValueError`` for invalid arguments; the builtin ``OSError`` subclass for the errno
(``FileNotFoundError``, ``PermissionError``, ...) for plain I/O failures, with the path as ``filename``.

Source buffers are read with the GIL released: do not resize or write to them while a call runs.
"""

import builtins
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias, final

from typing_extensions import Buffer

__all__ = [
    "MAX_DCP_METADATA_BYTES", "MAX_DCP_RANK", "MAX_HEADER_BYTES", "MAX_INDEX_BYTES", "ObjectStore",
    "SafetensorsFile", "WriteProgress", "checksum_files", "commit_dir", "crc32c", "hash_files", "hash_pieces",
    "hash_tensors",
    "parse_header", "serialize", "write_assembled", "write_file", "write_files", "write_files_checked",
]

#: ``(name, dtype, shape, buffer, byte_offset, byte_strides)``: a tensor of safetensors dtype ``dtype``
#: (``"F32"``, ``"BF16"``, ``"F4"``, ...) and logical ``shape`` whose first element is at ``byte_offset`` bytes
#: in ``buffer`` (any C-contiguous buffer, e.g. a uint8 numpy view of the tensor's whole storage).
#: ``byte_strides`` (bytes, >= 0) or ``None`` for C-contiguous; sub-byte dtypes (F4, F6_*) must be contiguous.
#: An optional seventh entry names the dtype to store instead (``"BF16"``, ``"F16"``, ``"F32"``, ``"F64"``),
#: converted while written (F16/BF16/F32/F64 sources only, round to nearest even as torch's ``.to()``); ``None``
#: stores ``dtype`` as is.
_TensorSource: TypeAlias = (tuple[str, str, Sequence[int], Buffer, int, Sequence[int] | None]
                            | tuple[str, str, Sequence[int], Buffer, int, Sequence[int] | None, str | None])
#: ``(name, dtype, shape, begin, end)``; begin/end are byte offsets relative to the data section.
_TensorEntry: TypeAlias = tuple[str, str, list[int], int, int]
#: ``__metadata__`` as ordered pairs; ``None`` writes no ``__metadata__`` key, ``[]`` writes ``{}``.
_Metadata: TypeAlias = Sequence[tuple[str, str]] | None
_StrPath: TypeAlias = str | os.PathLike[str]

#: The readers' limits (``fastckpt_core::limits``); every writer refuses, before writing, what a reader refuses.
#: Bytes of a safetensors header (the JSON after the 8-byte length), as the official reader.
MAX_HEADER_BYTES: int
#: Bytes of a ``*.safetensors.index.json`` shard index.
MAX_INDEX_BYTES: int
#: Bytes of a DCP metadata file (``dcp_metadata.json``).
MAX_DCP_METADATA_BYTES: int
#: Dimensions of a tensor in a DCP metadata file.
MAX_DCP_RANK: int

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
    ready: Callable[[list[tuple[int, int]]], object] | None = None,
) -> list[int]:
    """Write several files in one parallel pass (all chunks share one worker pool).

    If any file fails, no target is touched and every temp file is removed. Returns each file's size in bytes.
    ``ready``, when given, is called by the writer threads (taking the GIL) before each chunk with the
    ``(address, length)`` of the source memory of its contiguous pieces, and must return once those bytes are final
    (a pinned buffer still receiving device-to-host copies); its exception stops the write and is re-raised.
    Raises as :func:`write_file`.
    """

#: ``(file_size, file_crc32c, [(tensor, crc32c)], [(tensor, hash)])``: a written file's size in bytes, the crc32c
#: (Castagnoli) of all its bytes, and of each tensor's data bytes, tensors in file (offset) order (an empty
#: tensor's crc32c is 0); and each tensor's content hash (xxh3-128 over 256 KiB blocks, 32 hex digits, see
#: :func:`hash_tensors`), in the same order.
_FileDigest: TypeAlias = tuple[int, int, list[tuple[str, int]], list[tuple[str, str]]]

def write_files_checked(
    jobs: Iterable[tuple[_StrPath, Iterable[_TensorSource], _Metadata]],
    *,
    durable: bool = True,
    threads: int = 0,
    chunk_bytes: int = 8 << 20,
    ready: Callable[[list[tuple[int, int]]], object] | None = None,
    progress: WriteProgress | None = None,
) -> list[_FileDigest]:
    """:func:`write_files`, also returning each file's crc32c checksums (a :data:`_FileDigest` per job).

    ``progress``: the writer reports there which tensors are written, and writes a tensor taken over with
    :meth:`WriteProgress.claim` from the copy given to :meth:`WriteProgress.provide`. Its tensors are numbered
    in the order of ``jobs``, each job's tensors in the order given; its sizes must match (ValueError otherwise).

    The sums are computed while the bytes are written, by the thread that writes each chunk (hardware crc32c,
    pieces combined with ``crc32c_combine``), so they cost no second pass and do not depend on ``threads`` or
    ``chunk_bytes``. Raises as :func:`write_file`.
    """

#: ``(name, dtype, shape, src_indices, src_offsets, dst_offsets, lengths)``: an output tensor filled by ranges:
#: ``lengths[i]`` bytes at absolute offset ``src_offsets[i]`` of ``sources[src_indices[i]]`` go to byte
#: ``dst_offsets[i]`` of the tensor's data; together the ranges cover its bytes exactly once.
_AssembledTensor: TypeAlias = tuple[str, str, Sequence[int], Sequence[int], Sequence[int], Sequence[int], Sequence[int]]

def write_assembled(
    path: _StrPath,
    sources: Sequence[_StrPath],
    tensors: Sequence[_AssembledTensor],
    metadata: _Metadata,
    *,
    durable: bool = True,
    threads: int = 0,
    chunk_bytes: int = 8 << 20,
) -> int:
    """Write one safetensors file whose tensors are copied from byte ranges of ``sources`` (consolidation).

    The header is the official writer's (tensors ordered by dtype rank then name, padded to 8 bytes), written
    through a temp file renamed over ``path``. Workers copy the ranges in pieces of at most ``chunk_bytes`` by
    positional reads and writes, GIL released: peak memory is ``threads * chunk_bytes``.

    Returns:
        The file size in bytes.

    Raises:
        ValueError: ranges that do not cover a tensor exactly once, a bad name or source index, range lists of
            different lengths. DtypeError: an unknown dtype or a shape that is not whole bytes.
        TruncatedFileError: a source is shorter than a range. OSError: the I/O failed (the target is untouched).
    """

@final
class WriteProgress:
    """Per-tensor progress of one write from live tensor memory, shared with Python (``fastckpt._io.async_save.stream``).

    Args:
        sizes: each tensor's size in bytes, numbered as :func:`write_files_checked` numbers them.

    A caller that must change live tensors while they are being written (an optimizer step during an async save)
    claims them, copies the unwritten ones and provides the copies; the writer writes the rest from the copies.
    Every wait releases the GIL.
    """

    def __new__(cls, sizes: Sequence[int]) -> WriteProgress: ...
    def __len__(self) -> int: ...
    def is_written(self, id: int) -> bool:
        """Whether every byte of tensor ``id`` is in its file. Raises ValueError for an unknown id."""
    def claim(self, ids: Sequence[int]) -> list[int]:
        """Take tensors over: no new read of their live memory starts; waits for the reads running, then returns
        the ids still not fully written (in the order given). Provide a copy of each, or :meth:`abort`."""
    def wait_written(self, ids: Sequence[int]) -> None:
        """Block until every tensor of ``ids`` is written (or the write is aborted)."""
    def provide(self, id: int, copy: Buffer) -> None:
        """Hand over the copy of claimed tensor ``id``: a C-contiguous buffer of exactly its bytes in logical order,
        not written to afterwards. Raises ValueError if ``id`` was not claimed or the size differs."""
    def abort(self, message: str) -> None:
        """Stop the write: chunks waiting for a copy, and later ones, fail naming ``message``."""

def checksum_files(
    paths: Sequence[_StrPath], *, threads: int = 0, chunk_bytes: int = 8 << 20
) -> list[tuple[int, int, list[tuple[str, int]] | None, str | None]]:
    """Sum files on disk in one parallel pass of positional reads (never through a mapping), GIL released.

    Returns:
        Per path, ``(file_size, file_crc32c, tensors, header_error)``: ``tensors`` as in :data:`_FileDigest` for
        a valid safetensors file; for any other file (a JSON file, a damaged header) ``tensors`` is None and
        ``header_error`` the validation message (only the whole-file crc32c is computed).

    Raises:
        OSError: a file cannot be opened or read (IsADirectoryError for a folder).
        HeaderError: a FIFO, socket or device (never opened for blocking reads).
        TruncatedFileError: a file shrank while it was read.
    """

def hash_tensors(tensors: Iterable[_TensorSource], *, threads: int = 0) -> list[str]:
    """The content hash of each tensor source as it would be written (converted when its seventh entry says so):
    xxh3-128 of the xxh3-128 of each 256 KiB block of its bytes followed by its byte count (32 hex digits), the
    same value :func:`write_files_checked` reports. Blocks are hashed in parallel, GIL released.

    Raises as :func:`write_file`, less OSError.
    """

def hash_pieces(tensors: Sequence[Sequence[Buffer]], *, threads: int = 0) -> list[str]:
    """The content hash (as :func:`hash_tensors`: 32 hex digits) of each tensor whose bytes are the concatenation
    of its C-contiguous buffers, in order; blocks of every tensor in parallel, GIL released. An async save hashes a
    live tensor whose first and last bytes come from copies made at the call this way.

    Raises:
        ValueError: a buffer that is not C-contiguous.
    """

def hash_files(
    paths: Sequence[_StrPath], *, threads: int = 0
) -> list[tuple[list[tuple[str, str]] | None, str | None]]:
    """The content hashes of the tensors of safetensors files on disk (positional reads, GIL released).

    Returns:
        Per path, ``(tensors, header_error)``: ``[(tensor, hash)]`` in offset order, or None and the header's
        validation message.

    Raises:
        OSError: a file cannot be opened or read.
    """

def crc32c(data: Buffer, value: int = 0) -> int:
    """The crc32c (Castagnoli) of ``data`` appended to ``value`` (0 to start): ``crc32c(b"123456789") ==
    0xE3069283`` and ``crc32c(b"6789", crc32c(b"12345"))`` is the same."""

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
    tree. When another process commits the same target at the same moment, a rename that meets a folder now there
    is retried as an exchange (and an exchange that finds the target gone as a rename): both succeed and the
    later one wins whole. ``durable``: fsync the parent folder. Raises ValueError when ``staging`` is not a
    folder, OSError.
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

    def __new__(cls, path: _StrPath, *, mmap: bool = True, open_path: _StrPath | None = None) -> SafetensorsFile:
        """Open and fully validate ``path`` (opened non-blocking: a FIFO never hangs the reader).

        ``mmap=False`` maps nothing: the tensors are read only by ``read_into`` / ``read_ranges`` (bounded memory),
        and the buffer protocol raises BufferError.
        ``open_path``: open this path instead and name the file ``path`` in errors and :attr:`path` (a path relative
        to a pinned folder handle, ``/proc/self/fd/N/name``: see :mod:`fastckpt._io.storage.local.folder`).

        Raises:
            HeaderError, TruncatedFileError, DtypeError: a malformed file, or one that is not a regular file (a
                FIFO, socket or device). OSError: it cannot be opened (IsADirectoryError for a folder).
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

    def read_into(self, targets: Sequence[tuple[str, Buffer]], *, threads: int = 0,
                  expect: Sequence[int | None] | None = None, recorded_in: str = "fastckpt.json") -> None:
        """Fill each writable, C-contiguous buffer with its tensor's bytes by parallel positional reads of the
        file (not the mapping), GIL released. Buffers that overlap (aliases of one storage) are filled one after
        the other in list order, so the later target's bytes win where they overlap.

        ``expect``: one recorded crc32c (or None: not compared) per target; each target's bytes are then summed
        as they are read (1 MiB at a time, while still in the CPU cache) and compared. The buffers hold what was
        read even when the sums differ, so use it for memory nothing else sees yet.

        Raises:
            IntegrityError: with ``expect``, a target's crc32c differs (names the file, every damaged tensor, both
                values and ``recorded_in``).
            KeyMismatchError: an unknown tensor name.
            ValueError: a buffer of the wrong size, read-only or non-contiguous, or the file was closed.
            TruncatedFileError, OSError: the file shrank or cannot be read.
        """

    def read_ranges(self, targets: Sequence[tuple[str, int, Buffer]], *, threads: int = 0) -> None:
        """Fill each ``(name, offset, buffer)`` target with bytes ``[offset, offset + len(buffer))`` of that
        tensor's data (a piece of a tensor, e.g. into a pinned bounce buffer), by parallel positional reads of the
        file, GIL released. Targets must not overlap each other.

        Raises:
            KeyMismatchError: an unknown tensor name.
            ValueError: a range past the tensor's end (names the tensor, its size and the range), a buffer that is
                read-only, non-contiguous or overlaps another target, or the file was closed.
            TruncatedFileError, OSError: the file shrank or cannot be read.
        """

    def looks_cached(self) -> bool:
        """Whether the data section looks cached: its pages at 1/5, 2/5, 3/5 and 4/5 are in the page cache (a cheap
        probe; its first pages prove nothing, the header's readahead brought them)."""
        ...
    def prefetch(self, *, max_bytes: int = ...) -> None:
        """Hint the kernel to read the tensors' bytes (at most ``max_bytes``) into the page cache without waiting
        (``posix_fadvise(WILLNEED)``; Linux reads one readahead window per hint); nothing when they look cached
        or the file is closed."""
        ...
    def verify(self, tensors: Sequence[tuple[str, int]], *, file_crc32c: int | None = None,
               recorded_in: str = "fastckpt.json", threads: int = 0,
               summed: Sequence[tuple[str, int]] | None = None) -> tuple[int, int]:
        """Sum the bytes of ``tensors`` (``(name, recorded crc32c)``; with ``file_crc32c`` also the header, so
        every byte of the file) by parallel positional reads of the file, GIL released, and compare them with
        the recorded values. ``summed``: ``(name, crc32c)`` of tensors already summed by ``read_into(expect=)``:
        not read again, their values enter the whole-file crc32c. Returns ``(bytes read, tensors compared)``.

        Raises:
            IntegrityError: a tensor's crc32c differs (names the file, every damaged tensor and both values), a
                recorded tensor is absent from the file, or only the whole-file crc32c differs (the header).
            ValueError: the file was closed. TruncatedFileError, OSError: the file shrank or cannot be read.
        """

    def close(self) -> None:
        """Drop the file handle; the mapping and every view of it stay valid."""

    if sys.version_info >= (3, 12):
        def __buffer__(self, flags: int, /) -> memoryview: ...
        def __release_buffer__(self, buffer: memoryview, /) -> None: ...

@final
class ObjectStore:
    """One bucket of an S3 API store (Rust: object_store + tokio), configured by the ``AWS_*`` environment and
    ``options`` (object_store's S3 keys, plus ``part_size``, ``concurrency``, ``max_retries``, ``retry_timeout``,
    ``retry_backoff``). Every request runs with the GIL released; failures after the bounded retries raise
    ``OSError`` naming the object (``FileNotFoundError`` for a missing one, ``FileExistsError`` when a
    ``create_only`` put lost, ``IntegrityError`` for bytes of another size, ``ValueError`` for a bad option)."""

    def __new__(cls, bucket: str, options: Sequence[tuple[str, str]] = ...) -> ObjectStore: ...
    @property
    def transfer(self) -> tuple[int, int]:
        """``(part_size in bytes, concurrency)``."""
    def url(self, key: str) -> str: ...
    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, data: bytes, *, create_only: bool = False) -> None: ...
    def list(self, prefix: str) -> builtins.list[tuple[str, int]]: ...
    def list_dirs(self, prefix: str) -> builtins.list[str]: ...
    def delete(self, keys: Sequence[str]) -> None: ...
    def abort_upload(self, key: str, upload_id: str) -> None: ...
    def upload_files(self, jobs: Sequence[tuple[_StrPath, str]]) -> builtins.list[tuple[int, int]]:
        """Upload each ``(local file, key)`` (parallel multipart parts); ``[(size, crc32c)]`` in order."""
    def upload_tensors(
        self, jobs: Iterable[tuple[str, Iterable[_TensorSource], _Metadata]], *, threads: int = 0
    ) -> builtins.list[_FileDigest]:
        """Upload each ``(key, tensors, metadata)`` as the safetensors object :func:`write_files_checked` would write
        for it, straight from the tensors' memory: parallel multipart parts, each copied (strided tensors gathered)
        into its request body once it holds one of ``concurrency`` request permits, so about
        ``concurrency * part_size`` bytes are buffered at a time. Returns a :data:`_FileDigest` per job (crc32c
        summed as the parts are built; content hashes on ``threads`` workers). The tensors must not change until it
        returns (GIL released). Raises as :func:`write_file` for a bad source (nothing sent), OSError naming the
        object when the store fails (a started multipart upload is aborted)."""
    def download_files(self, jobs: Sequence[tuple[str, _StrPath, int]]) -> builtins.list[int]:
        """Download each ``(key, local file, size)`` by ranged parallel reads; ``[crc32c]`` in order."""

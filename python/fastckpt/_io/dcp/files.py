"""The files of a DCP-format folder (:mod:`fastckpt._format.dcp_metadata`): read the metadata, open and check every
chunk file against it before anything is read, and fill boxes of stored chunks by positional reads.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._format.dcp_boxes import box_runs
from fastckpt._format.dcp_index import INDEX_FILE, ChunkIndex
from fastckpt._format.dcp_metadata import METADATA_FILE, ChunkLocation, ParsedMetadata, parse_metadata
from fastckpt._format.dtypes import F4
from fastckpt._io.storage.local.file_size import recorded_size_problem
from fastckpt._io.storage.local.layout import MANIFEST, read_manifest
from fastckpt.errors import HeaderError, IntegrityError, MissingStateError

__all__ = ["read_dcp_metadata", "read_dcp_index", "open_chunk_files", "open_located_chunks", "verify_chunks", "BoxRead", "read_boxes", "is_dcp_folder"]


def is_dcp_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a DCP-format save (its ``dcp_metadata.json``)."""
    return (folder / METADATA_FILE).is_file()


def read_dcp_metadata(folder: Path) -> ParsedMetadata:
    """Read and check ``folder/dcp_metadata.json``.

    Raises:
        MissingStateError: no metadata file (not a DCP-format folder, or a save that did not finish).
        HeaderError: malformed metadata (see :func:`fastckpt._format.dcp_metadata.parse_metadata`).
    """
    path = folder / METADATA_FILE
    try:
        with open(path, "rb") as f:
            text = f.read(1_000_000_001)
    except FileNotFoundError:
        raise MissingStateError(f"{folder}: no {METADATA_FILE}; not a fastckpt DCP checkpoint, or a save that "
                                "did not finish") from None
    except IsADirectoryError:
        raise HeaderError(f"{path}: is a folder, not a metadata file") from None
    return parse_metadata(text, str(path))


def read_dcp_index(folder: Path) -> ChunkIndex:
    """Open ``folder/dcp_index.bin`` (mapped: only its header and the columns looked up are read) and check its
    header.

    Raises:
        MissingStateError: no index. HeaderError: a malformed or damaged index (names the file).
    """
    path = folder / INDEX_FILE
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except FileNotFoundError:
        raise MissingStateError(f"{folder}: no {INDEX_FILE}") from None
    except IsADirectoryError:
        raise HeaderError(f"{path}: is a folder, not an index file") from None
    return ChunkIndex(data, str(path))


def open_chunk_files(folder: Path, parsed: ParsedMetadata, *, records: dict[str, Any] | None = None,
                     only: set[str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Open every file the metadata names and check each chunk against its header; nothing is read yet.

    Args:
        records: the files' checksums as a manifest records them (``{file name: {"bytes", "crc32c", "tensors"}}``,
            a sharded save hands its part's down); None: read ``folder/fastckpt.json`` when there is one.
        only: open and check these files alone (the ones a rank reads from; None: every file): a reader that
            fetched only those from object storage, whose listing was checked against its manifest already.

    Returns:
        ``({file name: _core.SafetensorsFile}, records)``: ``records`` as given or as read (``{}`` without a
        manifest).

    Raises:
        MissingStateError: a file the metadata names is missing (names it; checked first).
        HeaderError: a file's header is malformed, or a chunk is absent from it, or has another dtype or shape
            than the metadata records (names the file, the tensor and both values).
        IntegrityError: a file has another size than the manifest records (when the folder has one).
    """
    chunks: dict[tuple[str, tuple[int, ...]], tuple[ChunkLocation, str, list[int]]] = {}
    for fqn, md in parsed.metadata.state_dict_metadata.items():
        for chunk in getattr(md, "chunks", ()):
            offsets = tuple(int(o) for o in chunk.offsets)
            loc = parsed.chunks[(fqn, offsets)]
            if only is None or loc.file in only:
                chunks[(fqn, offsets)] = (loc, parsed.dtypes[fqn], [int(s) for s in chunk.sizes])
    return open_located_chunks(folder, chunks, records=records)


def open_located_chunks(folder: Path, chunks: dict[tuple[str, tuple[int, ...]], tuple[ChunkLocation, str, list[int]]],
                        *, records: dict[str, Any] | None = None,
                        opened: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Open the files holding ``chunks`` (``{(fqn, offsets): (location, safetensors dtype, sizes)}``: the chunks a
    rank reads, or every chunk) and check each of those chunks against its file's header; nothing is read yet.

    ``opened``: files opened (and checked) before, kept. Returns and raises as :func:`open_chunk_files`.
    """
    files: dict[str, Any] = dict(opened or {})
    for (fqn, _offsets), (loc, _dtype, _sizes) in chunks.items():
        if loc.file not in files and not (folder / loc.file).exists():
            raise MissingStateError(f"{folder / loc.file}: holds chunks of {fqn!r} per {METADATA_FILE} but is missing")
    if records is None:
        records = read_manifest(folder).get("files", {}) if (folder / MANIFEST).is_file() else {}
    wanted = {loc.file for loc, _, _ in chunks.values()} - files.keys()
    for name in wanted:
        info = records.get(name)
        if isinstance(info, dict):
            problem = recorded_size_problem(folder / name, info.get("bytes"), MANIFEST)
            if problem is not None:
                raise IntegrityError(problem)
    for (fqn, _offsets), (loc, _dtype, _sizes) in chunks.items():
        if loc.file not in files:
            path = folder / loc.file
            try:
                files[loc.file] = _core.SafetensorsFile(str(path))
            except FileNotFoundError:
                raise MissingStateError(f"{path}: holds chunks of {fqn!r} per {METADATA_FILE} but is missing") from None
            except IsADirectoryError:
                raise HeaderError(f"{path}: is a folder, not a safetensors file") from None
    headers = {name: {t[0]: t for t in files[name].tensors()} for name in {loc.file for loc, _, _ in chunks.values()}}
    for (fqn, offsets), (loc, want_dtype, sizes) in chunks.items():
        path = folder / loc.file
        entry = headers[loc.file].get(loc.name)
        if entry is None:
            raise HeaderError(f"{path}: has no tensor {loc.name!r} (chunk of {fqn!r} at {list(offsets)})")
        _, dtype, shape, _begin, _end = entry
        want_shape = list(sizes)
        if want_dtype == F4 and want_shape:
            want_shape[-1] *= 2
        if dtype != want_dtype or list(shape) != want_shape:
            raise HeaderError(
                f"{path}: tensor {loc.name!r} is {dtype} {list(shape)}; {METADATA_FILE} records the chunk of "
                f"{fqn!r} at {list(offsets)} as {want_dtype} {want_shape}"
            )
    return files, records


def verify_chunks(files: dict[str, Any], records: dict[str, Any], wanted: dict[str, set[str]], *,
                  threads: int = 0) -> None:
    """Sum the stored chunks ``wanted`` names (``{file name: {tensor name}}``: every chunk a box is read from, whole)
    and compare each with the crc32c ``records`` holds for it; a file without a record is not checked.

    Raises:
        IntegrityError: a chunk differs (names the file, the tensor and both values).
    """
    for file, names in wanted.items():
        tensors = records.get(file, {}).get("tensors") if isinstance(records.get(file), dict) else None
        if isinstance(tensors, dict):
            files[file].verify([(n, int(tensors[n], 16)) for n in sorted(names) if n in tensors],
                               recorded_in=MANIFEST, threads=threads)


@dataclass
class BoxRead:
    """One box of a stored chunk into a C-contiguous destination buffer of the box's bytes."""

    file: str
    name: str  # tensor name in the file
    chunk_sizes: Sequence[int]
    offsets: Sequence[int]  # the box in the chunk
    lengths: Sequence[int]
    itemsize: int
    dest: Any  # writable C-contiguous buffer of prod(lengths) * itemsize bytes


def read_boxes(files: dict[str, Any], reads: Sequence[BoxRead], *, threads: int = 0) -> None:
    """Fill every ``BoxRead.dest`` by parallel positional reads (one core call per file, GIL released).

    Raises:
        ValueError: a destination of the wrong size. TruncatedFileError, OSError: the file shrank or failed.
    """
    by_file: dict[str, list[tuple[str, int, Any]]] = {}
    for r in reads:
        starts, run = box_runs(r.chunk_sizes, r.offsets, r.lengths, r.itemsize)
        view = memoryview(r.dest).cast("B")
        if len(view) != len(starts) * run:
            raise ValueError(f"{r.file}: a destination of {len(view)} bytes for a box of {len(starts) * run} bytes "
                             f"of {r.name!r}")
        targets = by_file.setdefault(r.file, [])
        for i, start in enumerate(starts.tolist()):
            targets.append((r.name, start, view[i * run:(i + 1) * run]))
    for file, targets in by_file.items():
        if targets:
            files[file].read_ranges(targets, threads=threads)

"""The coordinator's ``dcp_metadata.json`` / ``dcp_index.bin`` writer as it was before it wrote from columns (one
dict per chunk, ``json.dumps`` of the document; a ``(fqn, offsets)`` dict of ``ChunkLocation``s built from the write
results): the reference the column writer must equal byte for byte (tests/format/test_dcp_writer_columns.py)."""

from __future__ import annotations

import json
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fastckpt import _core
from fastckpt._format.codec import encode
from fastckpt._format.dcp_index import _PREFIX, FORMAT, MAGIC, MAX_TAIL, chunk_name, shard_file_name
from fastckpt._format.dcp_metadata import FORMAT as METADATA_FORMAT
from fastckpt._format.dcp_metadata import FORMAT_VERSION, METADATA_FILE, ChunkLocation, storage_meta_json
from fastckpt._format.dtypes import to_safetensors_dtype


def reference_files_and_text(metadata: Metadata, results: list) -> tuple[bytes, bytes]:
    """``(dcp_metadata.json, dcp_index.bin)`` as ``StorageWriter._metadata_text`` made them before."""
    chunks: dict = {}
    objects: dict = {}
    for rank_results in results:
        for r in rank_results:
            data = r.storage_data
            if "object" in data:
                objects[r.index.fqn] = data["object"]
            else:
                chunks[(r.index.fqn, tuple(r.index.offset or ()))] = ChunkLocation(data["file"], data["name"])
    text = reference_metadata_json(metadata, chunks, objects).encode("utf-8")
    return text, reference_index_bytes(metadata, chunks, objects, len(results), text)


def reference_metadata_json(metadata: Metadata, chunks: dict[tuple[str, tuple[int, ...]], ChunkLocation],
                  objects: dict[str, Any]) -> str:
    """The JSON text for ``metadata``.

    Args:
        metadata: the global plan's metadata (``finish`` receives it).
        chunks: ``{(fqn, offsets): ChunkLocation}`` for every stored tensor chunk.
        objects: ``{fqn: codec-encoded value}`` for every non-tensor entry.

    Raises:
        DtypeError: a tensor dtype the safetensors format cannot store.
        TypeError: ``planner_data`` holds an object that needs pickle (names its path).
        KeyError: a chunk or object of ``metadata`` was not written by any rank.
        ValueError: a tensor of more than ``_core.MAX_DCP_RANK`` dimensions, or a text over
            ``_core.MAX_DCP_METADATA_BYTES``: what :func:`parse_metadata` refuses is never written.
    """
    entries: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            out_chunks = []
            for chunk in md.chunks:  # torch.Size: ints, hashing and comparing as their tuple
                loc = chunks[(fqn, tuple(chunk.offsets))]
                out_chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes),
                                   "file": loc.file, "name": loc.name})
            if len(md.size) > _core.MAX_DCP_RANK:
                raise ValueError(f"tensor {fqn!r} has {len(md.size)} dimensions, over the {_core.MAX_DCP_RANK} the "
                                 f"{METADATA_FILE} reader accepts; nothing was committed")
            entries[fqn] = {"tensor": {"dtype": to_safetensors_dtype(md.properties.dtype, name=fqn),
                                       "size": [int(s) for s in md.size], "chunks": out_chunks}}
        else:
            entries[fqn] = {"object": objects[fqn]}
    doc = {
        "format": METADATA_FORMAT,
        "format_version": FORMAT_VERSION,
        "dcp_version": getattr(metadata, "version", None),
        "state_dict": entries,
        "planner_data": encode(metadata.planner_data, path="planner_data"),
        "storage_meta": storage_meta_json(metadata),
    }
    text = json.dumps(doc, allow_nan=False)
    if len(text) > _core.MAX_DCP_METADATA_BYTES:  # what parse_metadata would refuse: not committed
        raise ValueError(f"{METADATA_FILE} would be {len(text)} characters ({len(entries)} entries), over the "
                         f"{_core.MAX_DCP_METADATA_BYTES} its reader accepts; nothing was committed")
    return text



_FIRST = itemgetter(0)
_SECOND = itemgetter(1)
_FILE = attrgetter("file")
_NAME = attrgetter("name")


def _column(values: np.ndarray, body: list[bytes], at: list[int]) -> dict[str, Any]:
    n = len(values)
    if n == 0 or (values == values[0]).all():
        return {"c": int(values[0]) if n else 0}
    step = int(values[1] - values[0])
    off = np.flatnonzero(values != values[0] + step * np.arange(n, dtype=np.int64))
    if not len(off):
        return {"a": [int(values[0]), step]}
    if n - int(off[0]) <= MAX_TAIL:  # torch.chunk's uneven split: a run, then a short tail (the last blocks)
        return {"t": [int(values[0]), step, values[int(off[0]):].tolist()]}
    data = values.astype("<i8").tobytes()
    entry = {"e": [at[0], f"{_core.crc32c(data):08x}"]}
    body.append(data)
    at[0] += len(data)
    return entry


def reference_build_index(tensors: dict[str, tuple[str, list[int], list[tuple[tuple[int, ...], tuple[int, ...]]]]],
                locations: dict[tuple[str, tuple[int, ...]], ChunkLocation], world: int, *, objects: dict[str, Any],
                planner_data: Any, storage_meta: Any, dcp_version: Any, metadata_crc32c: str) -> bytes:
    """The bytes of ``dcp_index.bin``.

    Args:
        tensors: ``{fqn: (safetensors dtype, size, [(offsets, sizes) of each chunk])}``.
        locations: ``{(fqn, offsets): ChunkLocation}`` of every chunk.
        world: the ranks of the save (file ``shard-{r}-of-{world}`` is file id r).
        objects, planner_data, storage_meta, dcp_version: as in ``dcp_metadata.json`` (already encoded).
        metadata_crc32c: the crc32c of the ``dcp_metadata.json`` written beside it (hex).
    """
    extra: dict[str, int] = {}
    ids: dict[str, int] = {}
    names: dict[str, int] = {}
    aliases: dict[str, int] = {}
    body: list[bytes] = []
    at = [0]
    entries: dict[str, Any] = {}
    for fqn, (dtype, size, chunks) in tensors.items():
        ndim = len(size)
        n = len(chunks)
        offs = np.fromiter(chain.from_iterable(map(_FIRST, chunks)), np.int64, n * ndim).reshape(n, ndim)
        sizes = np.fromiter(chain.from_iterable(map(_SECOND, chunks)), np.int64, n * ndim).reshape(n, ndim)
        sweep = max(range(ndim), key=lambda d: len(np.unique(offs[:, d]))) if ndim and n else 0
        order = np.lexsort([offs[:, d] for d in reversed(range(ndim)) if d != sweep] + [offs[:, sweep]]) \
            if ndim else np.arange(n)
        offs, sizes = offs[order], sizes[order]
        locs = [locations[(fqn, chunks[k][0])] for k in order.tolist()]
        files = list(map(_FILE, locs))
        for f in dict.fromkeys(files):  # each file's id once (a shard's, or one past the ranks)
            if f not in ids:
                ids[f] = _file_id(f, world, extra)
        file_ids = np.fromiter(map(ids.__getitem__, files), np.int64, n)
        whole = [fqn] if n == 1 and ndim and sizes[0].tolist() == list(size) and not offs.any() else None
        template = fqn.replace("%", "%%") + "@" + ",".join(["%d"] * ndim)  # chunk_name's, formatted per chunk
        canonical = whole or (list(map(template.__mod__, map(tuple, offs.tolist()))) if ndim else [fqn] * n)
        stored = list(map(_NAME, locs))
        name_ids = np.full(n, -1, dtype=np.int64) if stored == canonical else np.array(
            [-1 if name == c else _name_id(name, fqn, chunks[k], size, names, aliases, locations)
             for name, c, k in zip(stored, canonical, order.tolist())], dtype=np.int64)
        columns = [_column(offs[:, d], body, at) for d in range(ndim)]
        columns += [_column(sizes[:, d], body, at) for d in range(ndim)]
        columns += [_column(file_ids, body, at), _column(name_ids, body, at)]
        entries[fqn] = {"dtype": dtype, "size": [int(s) for s in size], "n": n, "sweep": sweep,
                        "reach": int(sizes[:, sweep].max()) if ndim and n else 0, "columns": columns}
    header = json.dumps({
        "format": FORMAT, "format_version": 1, "metadata_crc32c": metadata_crc32c, "dcp_version": dcp_version,
        "planner_data": planner_data, "storage_meta": storage_meta, "objects": objects,
        "files": {"world": world, "extra": list(extra)}, "names": list(names), "aliases": list(aliases),
        "tensors": entries}, allow_nan=False).encode("utf-8")
    header += b" " * (-len(header) % 8)
    return _PREFIX.pack(MAGIC, 1, _core.crc32c(header), len(header)) + header + b"".join(body)


def _file_id(file: str, world: int, extra: dict[str, int]) -> int:
    if file.startswith("shard-") and file.endswith(f"-of-{world:05d}.safetensors"):
        digits = file[len("shard-"):-len(f"-of-{world:05d}.safetensors")]
        if digits.isdigit() and int(digits) < world and shard_file_name(int(digits), world) == file:
            return int(digits)
    return world + extra.setdefault(file, len(extra))


def _name_id(name: str, fqn: str, chunk: tuple, size: list[int], names: dict[str, int], aliases: dict[str, int],
             locations: dict) -> int:
    if name == chunk_name(fqn, chunk[0], chunk[1], size):
        return -1
    base = name.split("@", 1)[0]
    if base != fqn and (base, tuple(int(o) for o in chunk[0])) in locations \
            and name == chunk_name(base, chunk[0], chunk[1], size):
        return -2 - aliases.setdefault(base, len(aliases))
    return names.setdefault(name, len(names))


def reference_index_bytes(metadata: Metadata, chunks: dict[tuple[str, tuple[int, ...]], ChunkLocation],
                objects: dict[str, Any], world: int, text: bytes) -> bytes:
    """The ``dcp_index.bin`` (:mod:`fastckpt._format.dcp_index`) of the save whose ``dcp_metadata.json`` is
    ``text`` (from :func:`metadata_json` on the same arguments; ``world``: the ranks that wrote)."""
    tensors = {fqn: (to_safetensors_dtype(md.properties.dtype, name=fqn), [int(s) for s in md.size],
                     [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
               for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    return reference_build_index(tensors, chunks, world, objects={k: objects[k] for k in metadata.state_dict_metadata
                                                        if k not in tensors},
                       planner_data=encode(metadata.planner_data, path="planner_data"),
                       storage_meta=storage_meta_json(metadata), dcp_version=getattr(metadata, "version", None),
                       metadata_crc32c=f"{_core.crc32c(text):08x}")

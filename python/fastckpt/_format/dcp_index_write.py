"""Writing ``dcp_index.bin`` (the coordinator's side of :mod:`fastckpt._format.dcp_index`, whose docstring has
the layout): each tensor's chunks sorted along their sweep dimension and stored as columns, a column that is a
constant, an arithmetic run (or a run and a short tail) kept in the header, any other one stored as int64s in the
body with its crc32c."""

from __future__ import annotations

import json
from operator import attrgetter
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fastckpt import _core
from fastckpt._format.codec import encode
from fastckpt._format.dcp_index import _PREFIX, FORMAT, MAGIC, MAX_TAIL, chunk_name, shard_rank
from fastckpt._format.dcp_metadata import ChunkLocation, storage_meta_json
from fastckpt._format.dcp_metadata_write import TensorColumns, make_columns
from fastckpt._format.dtypes import to_safetensors_dtype

__all__ = ["build_index", "build_index_columns", "index_bytes"]

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


def build_index(tensors: dict[str, tuple[str, list[int], list[tuple[tuple[int, ...], tuple[int, ...]]]]],
                locations: dict[tuple[str, tuple[int, ...]], ChunkLocation], world: int, **header: Any) -> bytes:
    """:func:`build_index_columns` of chunks given as ``{fqn: (safetensors dtype, size, [(offsets, sizes)])}`` and
    their ``{(fqn, offsets): ChunkLocation}`` (the same keyword arguments)."""
    columns = {}
    for fqn, (dtype, size, chunks) in tensors.items():
        n, ndim = len(chunks), len(size)
        locs = [locations[(fqn, tuple(o))] for o, _ in chunks]
        columns[fqn] = (dtype, size, make_columns(
            fqn, size, np.array([o for o, _ in chunks], dtype=np.int64).reshape(n, ndim),
            np.array([s for _, s in chunks], dtype=np.int64).reshape(n, ndim),
            list(map(_FILE, locs)), list(map(_NAME, locs))))
    return build_index_columns(columns, world, **header)


def build_index_columns(tensors: dict[str, tuple[str, list[int], TensorColumns]], world: int, *,
                        objects: dict[str, Any], planner_data: Any, storage_meta: Any, dcp_version: Any,
                        metadata_crc32c: str) -> bytes:
    """The bytes of ``dcp_index.bin``.

    Args:
        tensors: ``{fqn: (safetensors dtype, size, TensorColumns of its chunks)}``.
        world: the ranks of the save (file ``shard-{r}-of-{world}`` is file id r).
        objects, planner_data, storage_meta, dcp_version: as in ``dcp_metadata.json`` (already encoded).
        metadata_crc32c: the crc32c of the ``dcp_metadata.json`` written beside it (hex).
    """
    extra: dict[str, int] = {}
    ids: dict[str, int] = {}
    names: dict[str, int] = {}
    aliases: dict[str, int] = {}
    stored_keys: set[tuple[str, tuple[int, ...]]] = set()  # (fqn, offsets) of every chunk, when a name needs it
    body: list[bytes] = []
    at = [0]
    entries: dict[str, Any] = {}
    for fqn, (dtype, size, col) in tensors.items():
        ndim = len(size)
        n = len(col.files)
        offs, sizes = col.offsets, col.sizes
        sweep = max(range(ndim), key=lambda d: len(np.unique(offs[:, d]))) if ndim and n else 0
        order = np.lexsort([offs[:, d] for d in reversed(range(ndim)) if d != sweep] + [offs[:, sweep]]) \
            if ndim else np.arange(n)
        new = [f for f in dict.fromkeys(col.files) if f not in ids]
        if any(shard_rank(f, world) is None for f in new):  # extra files are numbered as met in the sorted order
            new = [f for f in dict.fromkeys(map(col.files.__getitem__, order.tolist())) if f not in ids]
        for f in new:
            rank = shard_rank(f, world)
            ids[f] = world + extra.setdefault(f, len(extra)) if rank is None else rank
        file_ids = np.fromiter(map(ids.__getitem__, col.files), np.int64, n)[order]
        if col.canonical:
            name_ids = np.full(n, -1, dtype=np.int64)
        else:
            if not stored_keys:
                stored_keys.update((k, tuple(o)) for k, (_, _, c) in tensors.items() for o in c.offsets.tolist())
            chunks = list(zip(map(tuple, offs.tolist()), map(tuple, sizes.tolist())))
            # in the sorted order: names and aliases are numbered as they are first met
            name_ids = np.array([_name_id(col.names[k], fqn, chunks[k], size, names, aliases, stored_keys)
                                 for k in order.tolist()], dtype=np.int64)
        offs, sizes = offs[order], sizes[order]
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


def _name_id(name: str, fqn: str, chunk: tuple, size: list[int], names: dict[str, int], aliases: dict[str, int],
             stored_keys: set) -> int:
    if name == chunk_name(fqn, chunk[0], chunk[1], size):
        return -1
    base = name.split("@", 1)[0]
    if base != fqn and (base, tuple(int(o) for o in chunk[0])) in stored_keys \
            and name == chunk_name(base, chunk[0], chunk[1], size):
        return -2 - aliases.setdefault(base, len(aliases))
    return names.setdefault(name, len(names))


def index_bytes(metadata: Metadata, columns: dict[str, TensorColumns], objects: dict[str, Any], world: int,
                text: bytes) -> bytes:
    """The ``dcp_index.bin`` (:mod:`fastckpt._format.dcp_index`) of the save whose ``dcp_metadata.json`` is
    ``text`` (from :func:`~fastckpt._format.dcp_metadata_write.metadata_text` on the same arguments; ``world``:
    the ranks that wrote)."""
    tensors = {fqn: (to_safetensors_dtype(md.properties.dtype, name=fqn), [int(s) for s in md.size], columns[fqn])
               for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    return build_index_columns(tensors, world, objects={k: objects[k] for k in metadata.state_dict_metadata
                                                        if k not in tensors},
                               planner_data=encode(metadata.planner_data, path="planner_data"),
                               storage_meta=storage_meta_json(metadata),
                               dcp_version=getattr(metadata, "version", None),
                               metadata_crc32c=f"{_core.crc32c(text):08x}")

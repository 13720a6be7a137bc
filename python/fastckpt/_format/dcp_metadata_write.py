"""Writing ``dcp_metadata.json`` (the format is in :mod:`fastckpt._format.dcp_metadata`) from columns.

The coordinator of a save at N ranks writes N chunks per tensor. Each tensor's chunks arrive here as
:class:`TensorColumns` (offsets and sizes as int64 arrays, file and name as lists of str, in the order of DCP's
``TensorStorageMetadata.chunks``) and their JSON is built by formatting whole rows, without a dict per chunk or
``json.dumps`` walking them: the text is the one ``json.dumps(doc, allow_nan=False)`` gives for the document
(same separators, same escaping of names by the same C encoder), byte for byte.
"""

from __future__ import annotations

import json
from itertools import chain
from json.encoder import encode_basestring_ascii as _quote
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fastckpt import _core
from fastckpt._format.codec import encode
from fastckpt._format.dcp_metadata import FORMAT, FORMAT_VERSION, METADATA_FILE, storage_meta_json
from fastckpt._format.dtypes import to_safetensors_dtype

__all__ = ["TensorColumns", "metadata_text", "columns_of"]

_OFFSETS = attrgetter("offsets")
_SIZES = attrgetter("sizes")


class TensorColumns(NamedTuple):
    """One tensor's stored chunks as columns, in the order of its ``TensorStorageMetadata.chunks``.

    ``offsets`` and ``sizes`` are int64 arrays ``[n, ndim]`` (torch's elements); ``files[i]`` / ``names[i]``: chunk
    i is tensor ``names[i]`` of file ``files[i]`` in the folder."""

    offsets: np.ndarray
    sizes: np.ndarray
    files: list[str]
    names: list[str]


def columns_of(md: TensorStorageMetadata, files: list[str], names: list[str]) -> TensorColumns:
    """The columns of ``md``'s chunks located in ``files`` / ``names`` (one each per chunk, in chunk order)."""
    chunks = md.chunks
    n, ndim = len(chunks), len(md.size)
    if ndim == 0:
        empty = np.zeros((n, 0), dtype=np.int64)
        return TensorColumns(empty, empty, files, names)
    offsets = np.fromiter(chain.from_iterable(map(_OFFSETS, chunks)), np.int64, n * ndim).reshape(n, ndim)
    sizes = np.fromiter(chain.from_iterable(map(_SIZES, chunks)), np.int64, n * ndim).reshape(n, ndim)
    return TensorColumns(offsets, sizes, files, names)


def _tensor_text(fqn: str, md: TensorStorageMetadata, col: TensorColumns) -> str:
    ndim = len(md.size)
    if ndim > _core.MAX_DCP_RANK:
        raise ValueError(f"tensor {fqn!r} has {ndim} dimensions, over the {_core.MAX_DCP_RANK} the "
                         f"{METADATA_FILE} reader accepts; nothing was committed")
    dtype = to_safetensors_dtype(md.properties.dtype, name=fqn)
    ints = ", ".join(["%d"] * ndim)
    row = '{"offsets": [' + ints + '], "sizes": [' + ints + '], "file": %s, "name": %s}'
    quoted_files = {f: _quote(f) for f in dict.fromkeys(col.files)}
    rows = np.concatenate([col.offsets, col.sizes], axis=1).tolist() if ndim else [[] for _ in col.files]
    for values, file, name in zip(rows, col.files, col.names):
        values.append(quoted_files[file])
        values.append(_quote(name))
    chunks = ", ".join(map(row.__mod__, map(tuple, rows)))
    size = ", ".join(map(str, map(int, md.size)))
    return f'{_quote(fqn)}: {{"tensor": {{"dtype": {_quote(dtype)}, "size": [{size}], "chunks": [{chunks}]}}}}'


def metadata_text(metadata: Metadata, columns: dict[str, TensorColumns], objects: dict[str, Any]) -> bytes:
    """The bytes of ``dcp_metadata.json`` for ``metadata``.

    Args:
        metadata: the global plan's metadata (``finish`` receives it).
        columns: ``{fqn: TensorColumns}`` of every tensor of ``metadata`` (its chunks' locations).
        objects: ``{fqn: codec-encoded value}`` for every non-tensor entry.

    Returns:
        UTF-8 (ASCII) JSON: ``json.dumps`` of the document :mod:`fastckpt._format.dcp_metadata` describes.

    Raises:
        DtypeError: a tensor dtype the safetensors format cannot store.
        TypeError: ``planner_data`` holds an object that needs pickle (names its path).
        KeyError: a tensor or object of ``metadata`` was not written by any rank.
        ValueError: a tensor of more than ``_core.MAX_DCP_RANK`` dimensions, a NaN or infinity in a value, or a
            text over ``_core.MAX_DCP_METADATA_BYTES``: what ``parse_metadata`` refuses is never written.

    Example:
        >>> text = metadata_text(metadata, {"w": columns_of(md_w, files, names)}, {})  # doctest: +SKIP
    """
    entries = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            entries.append(_tensor_text(fqn, md, columns[fqn]))
        else:
            entries.append(f'{_quote(fqn)}: {{"object": {json.dumps(objects[fqn], allow_nan=False)}}}')
    head = json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION,
                       "dcp_version": getattr(metadata, "version", None)}, allow_nan=False)
    tail = json.dumps({"planner_data": encode(metadata.planner_data, path="planner_data"),
                       "storage_meta": storage_meta_json(metadata)}, allow_nan=False)
    text = f'{head[:-1]}, "state_dict": {{{", ".join(entries)}}}, {tail[1:]}'
    if len(text) > _core.MAX_DCP_METADATA_BYTES:  # what parse_metadata would refuse: not committed
        raise ValueError(f"{METADATA_FILE} would be {len(text)} characters ({len(entries)} entries), over the "
                         f"{_core.MAX_DCP_METADATA_BYTES} its reader accepts; nothing was committed")
    return text.encode("utf-8")

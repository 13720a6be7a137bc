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
from fastckpt._format.dcp_index import shard_rank
from fastckpt._format.dcp_metadata import FORMAT, FORMAT_VERSION, METADATA_FILE, storage_meta_json
from fastckpt._format.dtypes import to_safetensors_dtype

__all__ = ["TensorColumns", "metadata_text", "columns_of", "make_columns"]

_OFFSETS = attrgetter("offsets")
_SIZES = attrgetter("sizes")


class TensorColumns(NamedTuple):
    """One tensor's stored chunks as columns, in the order of its ``TensorStorageMetadata.chunks``.

    ``offsets`` and ``sizes`` are int64 arrays ``[n, ndim]`` (torch's elements); ``files[i]`` / ``names[i]``: chunk
    i is tensor ``names[i]`` of file ``files[i]`` in the folder; ``canonical``: every name is the chunk's
    :func:`~fastckpt._format.dcp_index.chunk_name` (no tied weight, no renamed view)."""

    offsets: np.ndarray
    sizes: np.ndarray
    files: list[str]
    names: list[str]
    canonical: bool


def make_columns(fqn: str, size: Any, offsets: np.ndarray, sizes: np.ndarray, files: list[str],
                 names: list[str]) -> TensorColumns:
    """:class:`TensorColumns` of tensor ``fqn`` of global ``size`` (``canonical`` found here)."""
    n, ndim = len(files), len(size)
    if n == 0:
        canonical = True
    elif n == 1 and (ndim == 0 or (sizes[0].tolist() == list(size) and not offsets.any())):
        canonical = names == [fqn]  # a whole tensor is stored under its own name
    elif ndim == 0:
        canonical = names == [fqn] * n
    else:  # chunk_name's fqn@o0,o1,...: a constant offset written into the template once
        parts = [fqn.replace("%", "%%"), "@"]
        args = []
        for d in range(ndim):
            column = offsets[:, d]
            parts += [","] if d else []
            if (column == column[0]).all():
                parts.append(str(int(column[0])))
            else:
                parts.append("%d")
                args.append(column.tolist())
        template = "".join(parts)
        if not args:
            canonical = names == [template % ()] * n
        elif len(args) == 1:
            canonical = names == list(map(template.__mod__, args[0]))
        else:
            canonical = names == list(map(template.__mod__, zip(*args)))
    return TensorColumns(offsets, sizes, files, names, canonical)


def columns_of(fqn: str, md: TensorStorageMetadata, files: list[str], names: list[str]) -> TensorColumns:
    """The columns of ``md``'s chunks located in ``files`` / ``names`` (one each per chunk, in chunk order).

    Raises:
        ValueError: a chunk whose offsets or sizes have another length than the tensor's dimensions.
    """
    chunks = md.chunks
    n, ndim = len(chunks), len(md.size)
    if n and {ndim} != set(map(len, map(_OFFSETS, chunks))) | set(map(len, map(_SIZES, chunks))):
        raise ValueError(f"tensor {fqn!r} of {ndim} dimensions has a chunk of other dimensions; nothing was "
                         "committed")
    offsets = np.fromiter(chain.from_iterable(map(_OFFSETS, chunks)), np.int64, n * ndim).reshape(n, ndim)
    sizes = np.fromiter(chain.from_iterable(map(_SIZES, chunks)), np.int64, n * ndim).reshape(n, ndim)
    return make_columns(fqn, md.size, offsets, sizes, files, names)


def _tensor_text(fqn: str, md: TensorStorageMetadata, col: TensorColumns, world: int, ranks: dict[str, int]) -> str:
    ndim = len(md.size)
    if ndim > _core.MAX_DCP_RANK:
        raise ValueError(f"tensor {fqn!r} has {ndim} dimensions, over the {_core.MAX_DCP_RANK} the "
                         f"{METADATA_FILE} reader accepts; nothing was committed")
    dtype = to_safetensors_dtype(md.properties.dtype, name=fqn)
    size = ", ".join(map(str, map(int, md.size)))
    head = f'{_quote(fqn)}: {{"tensor": {{"dtype": {_quote(dtype)}, "size": [{size}], "chunks": ['
    n = len(col.files)
    for f in dict.fromkeys(col.files):
        if f not in ranks:
            rank = shard_rank(f, world)
            ranks[f] = -1 if rank is None else rank
    file_ranks = np.fromiter(map(ranks.__getitem__, col.files), np.int64, n)
    offsets = [col.offsets[:, d] for d in range(ndim)]
    # a row: literal strings and columns ((format, int64 array) or (None, [str already quoted]))
    row: list[Any] = ['{"offsets": [', *_joined(offsets, ", "), '], "sizes": [',
                      *_joined([col.sizes[:, d] for d in range(ndim)], ", "), '], "file": ']
    if (file_ranks >= 0).all():  # every chunk in a rank's shard file
        row += ['"shard-', ("%05d", file_ranks), f'-of-{world:05d}.safetensors"']
    else:
        quoted = {f: _quote(f) for f in dict.fromkeys(col.files)}
        row.append((None, list(map(quoted.__getitem__, col.files))))
    row.append(', "name": ')
    if col.canonical and ndim and n > 1:  # fqn@o0,o1,...: the offsets again
        row += [_quote(fqn)[:-1] + "@", *_joined(offsets, ","), '"']
    else:
        row.append((None, list(map(_quote, col.names))))
    row.append("}")
    return head + _format_rows(row, n) + "]}}"


def _joined(columns: list[np.ndarray], sep: str) -> list[Any]:
    out: list[Any] = []
    for d, c in enumerate(columns):
        out += [sep, ("%d", c)] if d else [("%d", c)]
    return out


def _format_rows(row: list[Any], n: int) -> str:
    """The n rows joined by ``", "``: a constant column is written into the template once, the others are
    formatted per row (``%`` over the columns zipped)."""
    template: list[str] = []
    args: list[list[Any]] = []
    for part in row:
        if isinstance(part, str):
            template.append(part.replace("%", "%%"))
            continue
        spec, values = part
        if spec is None:
            template.append("%s")
            args.append(values)
        elif n and (values == values[0]).all():
            template.append((spec % int(values[0])).replace("%", "%%"))
        else:
            template.append(spec)
            args.append(values.tolist())
    text = "".join(template)
    if not args:
        return ", ".join([text % ()] * n)
    return ", ".join(map(text.__mod__, zip(*args)))


def metadata_text(metadata: Metadata, columns: dict[str, TensorColumns], objects: dict[str, Any],
                  world: int) -> bytes:
    """The bytes of ``dcp_metadata.json`` for ``metadata``.

    Args:
        metadata: the global plan's metadata (``finish`` receives it).
        columns: ``{fqn: TensorColumns}`` of every tensor of ``metadata`` (its chunks' locations).
        objects: ``{fqn: codec-encoded value}`` for every non-tensor entry.
        world: the ranks of the save (their shard files are ``shard-{rank}-of-{world}.safetensors``).

    Returns:
        UTF-8 (ASCII) JSON: ``json.dumps`` of the document :mod:`fastckpt._format.dcp_metadata` describes.

    Raises:
        DtypeError: a tensor dtype the safetensors format cannot store.
        TypeError: ``planner_data`` holds an object that needs pickle (names its path).
        KeyError: a tensor or object of ``metadata`` was not written by any rank.
        ValueError: a tensor of more than ``_core.MAX_DCP_RANK`` dimensions, a NaN or infinity in a value, or a
            text over ``_core.MAX_DCP_METADATA_BYTES``: what ``parse_metadata`` refuses is never written.

    Example:
        >>> text = metadata_text(metadata, {"w": columns_of("w", md_w, files, names)}, {}, 2)  # doctest: +SKIP
    """
    entries = []
    ranks: dict[str, int] = {}  # file -> the rank whose shard file it is, or -1
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            entries.append(_tensor_text(fqn, md, columns[fqn], world, ranks))
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

"""torch.distributed.checkpoint's global ``Metadata`` as JSON (no pickle), and its strict parser.

``dcp_metadata.json`` of a folder written by :class:`fastckpt.dcp.StorageWriter`::

    {"format": "fastckpt-dcp", "format_version": 1, "dcp_version": "1.0.0",
     "state_dict": {
        "model.w": {"tensor": {"dtype": "F32", "size": [8, 4],
                               "chunks": [{"offsets": [0, 0], "sizes": [4, 4],
                                           "file": "shard-00000-of-00002.safetensors", "name": "model.w@0,0"}, ...]}},
        "step":    {"object": 3}},
     "planner_data": {...}, "storage_meta": {"checkpoint_id": null, "save_id": "...", "load_id": null, "modules": []}}

``size``, ``offsets`` and ``sizes`` are in torch's elements, as DCP counts them (a ``float4_e2m1fn_x2`` element is
one byte holding two F4 values; its safetensors header shape doubles the last dimension). ``dtype`` is the
safetensors name. ``file``/``name`` locate each chunk: the tensor ``name`` of ``file`` in the same folder (tied
weights point at one stored chunk). Non-tensor values and ``planner_data`` are written with the pickle-free codec
(:mod:`fastckpt._format.codec`). :func:`parse_metadata` treats the file as hostile input: anything malformed is a
:class:`~fastckpt.errors.HeaderError` naming the file and the entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fastckpt import _core
from fastckpt._format.dtypes import to_torch_dtype
from fastckpt._format.json_input import decode_json, load_json
from fastckpt.errors import DtypeError, HeaderError

__all__ = ["METADATA_FILE", "FORMAT", "ChunkLocation", "ParsedMetadata", "parse_metadata",
           "is_plain_file_name", "storage_meta_json"]

METADATA_FILE = "dcp_metadata.json"
FORMAT = "fastckpt-dcp"
FORMAT_VERSION = 1

#: DCP's ``Metadata`` has a ``version`` field in newer torch (2.13); torch 2.7's has none (written as null, not passed)
_METADATA_HAS_VERSION = "version" in {f.name for f in fields(Metadata)}


@dataclass(frozen=True)
class ChunkLocation:
    """Where one stored chunk lives: tensor ``name`` of ``file`` (a file name in the folder)."""

    file: str
    name: str


@dataclass
class ParsedMetadata:
    """A parsed ``dcp_metadata.json``: DCP's ``Metadata``, every chunk's location keyed by
    ``(fqn, offsets)``, the safetensors dtype name per tensor fqn, and the decoded non-tensor values."""

    metadata: Metadata
    chunks: dict[tuple[str, tuple[int, ...]], ChunkLocation]
    dtypes: dict[str, str]
    objects: dict[str, Any]


def is_plain_file_name(name: Any) -> bool:
    """A file name inside the folder: a non-empty str without separators, ``..`` or control characters."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and not any(ord(c) < 32 for c in name))


def storage_meta_json(metadata: Metadata) -> dict[str, Any] | None:
    """``metadata.storage_meta`` as the JSON object ``dcp_metadata.json`` and the index record (or None)."""
    meta = metadata.storage_meta
    return None if meta is None else {
        "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
        "save_id": meta.save_id, "load_id": meta.load_id, "modules": list(meta.modules),
    }


def _ints(value: Any, where: str, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in value):
        raise HeaderError(f"{where}: {what} must be a list of non-negative integers, got {str(value)[:200]}")
    if len(value) > _core.MAX_DCP_RANK:
        raise HeaderError(f"{where}: {what} has {len(value)} dimensions (at most {_core.MAX_DCP_RANK})")
    return value


def _opt_str(value: Any, where: str, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise HeaderError(f"{where}: {what} must be a string or null, got {type(value).__name__}")
    return value


def _check_cover(at: str, size: list[int], chunks: list[ChunkStorageMetadata]) -> None:
    """The chunks tile the tensor: no two overlap and their volumes add up to its size (else a load would leave
    part of a destination unfilled without an error).

    A sweep along the first dimension: each chunk is compared only with the chunks whose rows it meets, so the
    N row blocks of an N-rank ``Shard(0)`` tensor cost O(N log N), not O(N^2) (every rank parses the file).
    """
    total = sum(math.prod(c.sizes) for c in chunks)
    if total != math.prod(size):
        raise HeaderError(f"{at}: its chunks hold {total} elements, its size {size} has {math.prod(size)}")
    if not size:
        return
    boxes = sorted((list(c.offsets), list(c.sizes)) for c in chunks if math.prod(c.sizes))
    active: list[tuple[list[int], list[int]]] = []  # boxes whose rows reach past the current box's first row
    for o1, s1 in boxes:
        active = [(o2, s2) for o2, s2 in active if o2[0] + s2[0] > o1[0]]
        for o2, s2 in active:
            if all(a < b + m and b < a + n for a, n, b, m in zip(o1, s1, o2, s2)):
                raise HeaderError(f"{at}: chunks at {o2} and {o1} overlap")
        active.append((o1, s1))


def _parse_tensor(fqn: str, body: Any, where: str, parsed: ParsedMetadata) -> TensorStorageMetadata:
    at = f"{where}: state_dict[{fqn!r}]"
    if not isinstance(body, dict) or set(body) != {"dtype", "size", "chunks"}:
        raise HeaderError(f"{at}: a tensor entry needs exactly 'dtype', 'size' and 'chunks'")
    dtype_name = body["dtype"]
    if not isinstance(dtype_name, str):
        raise HeaderError(f"{at}: dtype must be a string")
    try:
        dtype = to_torch_dtype(dtype_name, name=fqn, path=where)
    except DtypeError as exc:
        raise HeaderError(str(exc)) from None
    size = _ints(body["size"], at, "size")
    if not isinstance(body["chunks"], list):
        raise HeaderError(f"{at}: chunks must be a list")
    out = []
    for i, chunk in enumerate(body["chunks"]):
        cat = f"{at}: chunk {i}"
        if not isinstance(chunk, dict) or set(chunk) != {"offsets", "sizes", "file", "name"}:
            raise HeaderError(f"{cat}: needs exactly 'offsets', 'sizes', 'file' and 'name'")
        offsets = _ints(chunk["offsets"], cat, "offsets")
        sizes = _ints(chunk["sizes"], cat, "sizes")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise HeaderError(f"{cat}: offsets {offsets} and sizes {sizes} must have {len(size)} entries like "
                              f"the tensor's size {size}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise HeaderError(f"{cat}: offsets {offsets} + sizes {sizes} reach past the tensor's size {size}")
        if not is_plain_file_name(chunk["file"]):
            raise HeaderError(f"{cat}: file {str(chunk['file'])[:200]!r} is not a file name inside the folder")
        if not isinstance(chunk["name"], str):
            raise HeaderError(f"{cat}: name must be a string")
        key = (fqn, tuple(offsets))
        if key in parsed.chunks:
            raise HeaderError(f"{cat}: a second chunk at offsets {offsets}")
        parsed.chunks[key] = ChunkLocation(chunk["file"], chunk["name"])
        out.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    _check_cover(at, size, out)
    parsed.dtypes[fqn] = dtype_name
    return TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(size), chunks=out)


def parse_metadata(text: str | bytes, where: str) -> ParsedMetadata:
    """Parse and check ``dcp_metadata.json`` (hostile input).

    Raises:
        HeaderError: not JSON, another format or version, a field of the wrong type, a chunk outside its tensor,
            a file name outside the folder, an unknown dtype or codec tag; the message names ``where`` and the entry.
    """
    if len(text) > _core.MAX_DCP_METADATA_BYTES:
        raise HeaderError(f"{where}: {len(text)} bytes, more than the {_core.MAX_DCP_METADATA_BYTES} a metadata file "
                          "may have")
    doc = load_json(text, where)
    if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise HeaderError(f"{where}: not a {FORMAT} version {FORMAT_VERSION} metadata file "
                          f"(format {str(doc.get('format'))[:50]!r}, version {str(doc.get('format_version'))[:20]})")
    extra = set(doc) - {"format", "format_version", "dcp_version", "state_dict", "planner_data", "storage_meta"}
    if extra:
        raise HeaderError(f"{where}: unknown fields {sorted(extra)[:5]}")
    entries = doc.get("state_dict")
    if not isinstance(entries, dict):
        raise HeaderError(f"{where}: 'state_dict' must be an object")
    parsed = ParsedMetadata(Metadata(state_dict_metadata={}), {}, {}, {})
    md: dict[str, Any] = {}
    for fqn, entry in entries.items():
        if not isinstance(entry, dict) or len(entry) != 1 or next(iter(entry)) not in ("tensor", "object"):
            raise HeaderError(f"{where}: state_dict[{fqn[:200]!r}] must be {{'tensor': ...}} or {{'object': ...}}")
        kind, body = next(iter(entry.items()))
        if kind == "tensor":
            md[fqn] = _parse_tensor(fqn, body, where, parsed)
        else:
            parsed.objects[fqn] = decode_json(body, f"{where}: state_dict[{fqn[:200]!r}]")
            md[fqn] = BytesStorageMetadata()
    planner_data = decode_json(doc.get("planner_data"), f"{where}: planner_data")
    storage_meta = None
    sm = doc.get("storage_meta")
    if sm is not None:
        if not isinstance(sm, dict) or not isinstance(sm.get("modules", []), list) \
                or not all(isinstance(m, str) for m in sm.get("modules", [])):
            raise HeaderError(f"{where}: 'storage_meta' must be an object with a list of str 'modules'")
        storage_meta = StorageMeta(
            checkpoint_id=_opt_str(sm.get("checkpoint_id"), where, "checkpoint_id"),
            save_id=_opt_str(sm.get("save_id"), where, "save_id"),
            load_id=_opt_str(sm.get("load_id"), where, "load_id"),
            modules=list(sm.get("modules", [])),
        )
    version = _opt_str(doc.get("dcp_version"), where, "dcp_version")
    storage_data = {MetadataIndex(fqn, offsets): loc for (fqn, offsets), loc in parsed.chunks.items()}
    parsed.metadata = Metadata(state_dict_metadata=md, planner_data=planner_data, storage_data=storage_data,
                               storage_meta=storage_meta, **({"version": version} if _METADATA_HAS_VERSION else {}))
    return parsed

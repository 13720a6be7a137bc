"""DCP's ``Metadata`` over a chunk index (:mod:`fastckpt._format.dcp_index`): each rank plans with the chunks its
own boxes overlap, not with every chunk of every tensor.

:func:`indexed_metadata` gives the ``Metadata`` a :class:`fastckpt.dcp.StorageReader` returns when the folder has a
``dcp_index.bin``: every entry of the save (dtypes, sizes, non-tensor values, ``planner_data``) from the index's
small header, each tensor's entry an :class:`IndexedTensorMetadata` whose ``chunks`` are read from the index only
when something asks for them (a planner that does not know the index: DCP's own ``DefaultLoadPlanner`` gets the
same plan as from ``dcp_metadata.json``). :func:`narrowed` is what :class:`fastckpt.dcp.LoadPlanner` plans with:
the same metadata, each tensor of the state dict holding only the chunks its local boxes overlap (a binary search
per box), so DCP's planning on a rank costs the same at 8 and at 8192 ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fastckpt._format.dcp_index import ChunkIndex, Found
from fastckpt._format.dcp_metadata import _METADATA_HAS_VERSION, ChunkLocation
from fastckpt._format.dtypes import to_torch_dtype
from fastckpt._format.json_input import decode_json
from fastckpt.errors import HeaderError

__all__ = ["IndexedTensorMetadata", "indexed_metadata", "narrowed", "Catalog"]


def _chunks(found: Found) -> list[ChunkStorageMetadata]:
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
            for o, s in zip(found.offsets.tolist(), found.sizes.tolist())]


class IndexedTensorMetadata(TensorStorageMetadata):
    """A ``TensorStorageMetadata`` whose ``chunks`` come from a :class:`~fastckpt._format.dcp_index.ChunkIndex` the
    first time they are read (every chunk of the tensor; :meth:`narrow` gives the ones some boxes overlap)."""

    def __init__(self, index: ChunkIndex, fqn: str) -> None:  # noqa: D107 - not the dataclass's __init__
        entry = index.tensors[fqn]
        self.properties = TensorProperties(dtype=to_torch_dtype(entry["dtype"], name=fqn, path=index.where))
        self.size = torch.Size(entry["size"])
        self.index = index
        self.fqn = fqn
        self._all: list[ChunkStorageMetadata] | None = None

    @property  # type: ignore[override]
    def chunks(self) -> list[ChunkStorageMetadata]:
        if self._all is None:
            self._all = _chunks(self.index.all_chunks(self.fqn))
        return self._all

    @chunks.setter
    def chunks(self, value: list[ChunkStorageMetadata]) -> None:
        self._all = value

    def narrow(self, boxes: list[ChunkStorageMetadata]) -> TensorStorageMetadata:
        """A plain ``TensorStorageMetadata`` with the stored chunks ``boxes`` overlap (each chunk once).

        Raises:
            HeaderError: the chunks found do not fill a box exactly (the index is inconsistent).
        """
        seen: set[tuple[int, ...]] = set()
        out: list[ChunkStorageMetadata] = []
        for box in boxes:
            if not all(int(n) for n in box.sizes) and len(box.sizes):
                continue
            found = self.index.overlapping(self.fqn, box.offsets, box.sizes)
            if not self.index.covers(self.fqn, box.offsets, box.sizes, found):
                raise HeaderError(f"{self.index.where}: the chunks of {self.fqn!r} do not fill the box at "
                                  f"{list(box.offsets)} of {list(box.sizes)} exactly")
            for chunk in _chunks(found):
                key = tuple(int(o) for o in chunk.offsets)
                if key not in seen:
                    seen.add(key)
                    out.append(chunk)
        return TensorStorageMetadata(properties=self.properties, size=self.size, chunks=out)


def indexed_metadata(index: ChunkIndex) -> tuple[Metadata, dict[str, Any]]:
    """``(DCP's Metadata, {fqn: decoded non-tensor value})`` of an index (see the module docs).

    Raises:
        HeaderError: a malformed entry (names the file and the entry).
    """
    where = index.where
    md: dict[str, Any] = {fqn: IndexedTensorMetadata(index, fqn) for fqn in index.tensors}
    objects = {fqn: decode_json(value, f"{where}: objects[{fqn[:200]!r}]") for fqn, value in index.objects.items()}
    md.update({fqn: BytesStorageMetadata() for fqn in objects})
    doc = index.doc
    sm = doc.get("storage_meta")
    storage_meta = None
    if sm is not None:
        if not isinstance(sm, dict) or not all(isinstance(sm.get(k), (str, type(None)))
                                               for k in ("checkpoint_id", "save_id", "load_id")) \
                or not isinstance(sm.get("modules", []), list):
            raise HeaderError(f"{where}: a malformed 'storage_meta'")
        storage_meta = StorageMeta(checkpoint_id=sm.get("checkpoint_id"), save_id=sm.get("save_id"),
                                   load_id=sm.get("load_id"), modules=[str(m) for m in sm.get("modules", [])])
    version = doc.get("dcp_version")
    if version is not None and not isinstance(version, str):
        raise HeaderError(f"{where}: 'dcp_version' must be a string or null")
    planner_data = decode_json(doc.get("planner_data"), f"{where}: planner_data")
    metadata = Metadata(state_dict_metadata=md, planner_data=planner_data, storage_data=None,
                        storage_meta=storage_meta, **({"version": version} if _METADATA_HAS_VERSION else {}))
    return metadata, objects


def narrowed(metadata: Metadata, state_dict: dict[str, Any]) -> Metadata | None:
    """``metadata`` with each indexed tensor of ``state_dict`` holding only the chunks its local boxes overlap;
    None when ``metadata`` holds no indexed tensor (nothing to narrow)."""
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

    entries = metadata.state_dict_metadata
    if not any(isinstance(m, IndexedTensorMetadata) for m in entries.values()):
        return None
    out = dict(entries)
    for fqn, obj in state_dict.items():
        md = entries.get(fqn)
        if not isinstance(md, IndexedTensorMetadata) or not isinstance(obj, torch.Tensor):
            continue
        mesh = getattr(obj, "device_mesh", None)
        if mesh is not None and mesh.get_coordinate() is None:
            continue  # not on this rank's mesh: DCP plans nothing for it
        if tuple(obj.size()) != tuple(md.size):
            continue  # DCP raises its size mismatch on the full entry
        out[fqn] = md.narrow(_create_chunk_list(obj))
    return Metadata(state_dict_metadata=out, planner_data=metadata.planner_data, storage_data=metadata.storage_data,
                    storage_meta=metadata.storage_meta,
                    **({"version": metadata.version} if _METADATA_HAS_VERSION else {}))


class Catalog:
    """Where a reader finds each stored chunk, its dtype and the non-tensor values: over ``dcp_metadata.json``
    (:meth:`from_parsed`) or over the index (:meth:`from_index`, lookups by binary search)."""

    def __init__(self, metadata: Metadata, objects: dict[str, Any], dtypes: dict[str, str], *,
                 parsed: Any = None, index: ChunkIndex | None = None) -> None:
        self.metadata, self.objects, self.dtypes = metadata, objects, dtypes
        self.parsed, self.index = parsed, index
        self._sizes: dict[tuple[str, tuple[int, ...]], list[int]] | None = None

    @classmethod
    def from_parsed(cls, parsed: Any) -> Catalog:
        return cls(parsed.metadata, parsed.objects, parsed.dtypes, parsed=parsed)

    @classmethod
    def from_index(cls, index: ChunkIndex) -> Catalog:
        metadata, objects = indexed_metadata(index)
        return cls(metadata, objects, {fqn: e["dtype"] for fqn, e in index.tensors.items()}, index=index)

    def locate(self, fqn: str, offsets: tuple[int, ...]) -> tuple[ChunkLocation, list[int]]:
        """``(location, sizes)`` of the chunk of ``fqn`` stored at ``offsets``."""
        if self.index is not None:
            return self.index.find(fqn, offsets)
        if self._sizes is None:
            self._sizes = {(f, tuple(int(o) for o in c.offsets)): [int(s) for s in c.sizes]
                           for f, md in self.metadata.state_dict_metadata.items() for c in getattr(md, "chunks", ())}
        return self.parsed.chunks[(fqn, offsets)], self._sizes[(fqn, offsets)]

"""The coordinator's merge of every rank's write results into columns, for ``dcp_metadata.json`` and the index.

``StorageWriter.finish`` receives one ``WriteResult`` per stored chunk from every rank (N chunks per tensor at N
ranks). :func:`merge_results` puts each chunk's file and name at its place in its tensor's
``TensorStorageMetadata.chunks``, found by the result's index hint (``MetadataIndex.index``: DCP's global plan sets
it to that place, and it comes back in the result), without a dict keyed by ``(fqn, offsets)`` or an object per
chunk. The hints are checked in bulk (every place filled once, the offsets at each place the chunk's); results
whose hints do not place them (a planner that sets none) are placed by ``(fqn, offsets)`` instead, with the same
outcome.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from fastckpt._format.dcp_metadata_write import TensorColumns, columns_of
from fastckpt._io.storage.local.integrity import digest_entry

__all__ = ["merge_results"]


def merge_results(metadata: Metadata, results: list[list[WriteResult]]
                  ) -> tuple[dict[str, TensorColumns], dict[str, Any], dict[str, dict[str, Any]]]:
    """``(columns, objects, files)`` of a save: ``{fqn: TensorColumns}`` of every tensor of ``metadata``,
    ``{fqn: codec value}`` of its non-tensor entries and ``{file: manifest entry}`` of the ranks' files.

    Args:
        metadata: the global plan's metadata.
        results: every rank's write results (``finish``'s argument; storage data ``{"file", "name", "digests"}``
            for a chunk, ``{"object", "digests"}`` for a value).

    Raises:
        KeyError: a chunk of ``metadata`` no result locates (names it).
    """
    md = metadata.state_dict_metadata
    places: dict[str, tuple[list, list, list]] = {
        fqn: ([None] * len(v.chunks), [None] * len(v.chunks), [None] * len(v.chunks))
        for fqn, v in md.items() if isinstance(v, TensorStorageMetadata)}
    objects: dict[str, Any] = {}
    files: dict[str, dict[str, Any]] = {}
    stray: list[WriteResult] = []  # results no hint places
    for rank_results in results:
        last_digests = None
        for r in rank_results:  # no function call per result: subscripts and tests only
            data = r.storage_data
            digests = data["digests"] if "digests" in data else ()
            if digests is not last_digests:  # a rank's results share one list: its files, entered once
                last_digests = digests
                for name, digest in digests:
                    files[name] = {"bytes": digest[0], **digest_entry(digest)}
            index = r.index
            if "object" in data:
                objects[index.fqn] = data["object"]
                continue
            hint = index.index
            try:
                if hint is None or hint < 0:
                    raise IndexError(hint)
                offsets, where, names = places[index.fqn]
                offsets[hint] = index.offset  # IndexError past the tensor's chunks
            except (KeyError, IndexError, TypeError):
                stray.append(r)
                continue
            where[hint] = data["file"]
            names[hint] = data["name"]
    columns: dict[str, TensorColumns] = {}
    found: dict[tuple[str, tuple[int, ...]], dict[str, Any]] | None = None
    for fqn, (offsets, where, names) in places.items():
        chunks = md[fqn].chunks
        if stray or offsets != [c.offsets for c in chunks]:  # torch.Size compares as its tuple (None: unfilled)
            if found is None:
                found = _by_offsets(results)
            where, names = _located(fqn, chunks, found)
        columns[fqn] = columns_of(fqn, md[fqn], where, names)
    return columns, objects, files


def _by_offsets(results: list[list[WriteResult]]) -> dict[tuple[str, tuple[int, ...]], dict[str, Any]]:
    """Every chunk result's storage data by ``(fqn, offsets)`` (the last result for a chunk wins)."""
    return {(r.index.fqn, tuple(r.index.offset or ())): r.storage_data for rank_results in results
            for r in rank_results if "object" not in r.storage_data}


def _located(fqn: str, chunks: list[Any], found: dict) -> tuple[list[str], list[str]]:
    located = []
    for chunk in chunks:
        data = found.get((fqn, tuple(chunk.offsets)))
        if data is None:
            raise KeyError(f"no rank wrote the chunk of {fqn!r} at offsets {list(chunk.offsets)}")
        located.append(data)
    return [d["file"] for d in located], [d["name"] for d in located]

"""``fastckpt.dcp.StorageWriter``: DCP's storage writer on the Rust core, atomic and pickle-free."""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import StorageWriter as _DCPStorageWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from fastckpt._format.codec import encode
from fastckpt._format.dcp_index import INDEX_FILE, chunk_name, shard_file_name
from fastckpt._format.dcp_index_write import index_bytes
from fastckpt._format.dcp_metadata import METADATA_FILE
from fastckpt._format.dcp_metadata_write import metadata_text
from fastckpt._io.storage import resolve
from fastckpt._io.storage.base import PartSave, PartStorage
from fastckpt._io.storage.local.integrity import text_entry
from fastckpt._io.storage.local.layout import manifest_dict
from fastckpt.dcp.gc_pause import gc_paused
from fastckpt.dcp.results import merge_results

__all__ = ["StorageWriter", "shard_file_name"]


_chunk_name = chunk_name


def _view_key(t: torch.Tensor) -> tuple | None:
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _encode_object(fqn: str, obj: Any) -> Any:
    if callable(obj) and not isinstance(obj, torch.Tensor):
        raise TypeError(f"{fqn} is a {type(obj).__module__}.{type(obj).__qualname__} (a callable), which fastckpt "
                        "cannot store without pickle")
    return encode(obj, path=fqn)


class StorageWriter(_DCPStorageWriter):
    """Writes a ``torch.distributed.checkpoint`` save as safetensors files through fastckpt's Rust core.

    Each rank writes its chunks into one file ``shard-{rank}-of-{world}.safetensors`` (parallel positional writes
    straight from tensor memory, GIL released, crc32c while writing); the coordinator writes
    ``dcp_metadata.json`` (see :mod:`fastckpt._format.dcp_metadata`) and, with ``commit=True``, the manifest
    ``fastckpt.json``, then puts the folder in place in one step. Where the files go is the storage ``path``
    names, resolved once (:func:`fastckpt._io.storage.resolve`): the coordinator opens a save there at planning
    time (:meth:`~fastckpt._io.storage.base.PartStorage.begin_part`), every rank joins it from the plan and writes
    its own file, the coordinator writes the metadata and commits (:class:`~fastckpt._io.storage.base.PartSave`).

    Args:
        path: the checkpoint folder. With ``commit=True`` (default) it is replaced whole and atomically: the ranks
            write into a staging folder beside it that the coordinator creates at planning time (its name reaches
            the other ranks through the plan's ``storage_data``), and ``finish`` commits it; a save that fails or
            is killed on any rank leaves the previous folder as it was. With ``commit=False`` the files go
            straight into ``path`` (created if missing; every rank must see the same folder), no manifest is
            written and nothing is committed: for a folder inside a checkpoint an outer save is staging
            (``fastckpt.save_state``), which commits everything at once. :attr:`files` then holds the manifest
            entries of what was written.
        threads: writer threads per rank (0 = min(8, cores)).
        durable: fsync every file and folder (and the parent after the commit).
        commit: see ``path``.
        storage_options: for an ``s3://bucket/prefix`` ``path`` (see :func:`fastckpt.save_state`): every rank uploads
            its chunks under the save's prefix straight from tensor memory (crc32c summed as the parts go out; a
            large rank's data split over a few objects: :mod:`fastckpt._io.storage.object.parts`); the coordinator
            uploads ``dcp_metadata.json`` and commits by creating the manifest object last. With ``commit=False`` the ``s3://`` path is a prefix inside a
            save an outer save commits (``s3://bucket/ckpt/save-{n}-{id}/model``, ``fastckpt.save_state`` under
            FSDP2): every rank uploads its objects straight under it, the coordinator puts ``dcp_metadata.json``
            there, and nothing is committed (:attr:`files` as for a local folder).

    Raises (inside ``dcp.save``, wrapped by DCP in its ``CheckpointException``; :func:`fastckpt.dcp.save`
    re-raises the original):
        TypeError: a non-tensor value that needs pickle (names its key).
        DtypeError: a tensor dtype the safetensors format cannot store.
        ValueError / NotADirectoryError: ``path`` is the root, a parent of the working directory, or a file.
        OSError: the disk failed (names the file); the previous checkpoint is intact.
    """

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 0, durable: bool = True,
                 commit: bool = True, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.storage_options = storage_options
        self.commit = commit
        self._set_path(path, "path")
        self.threads = threads
        self.durable = durable
        #: after ``finish`` on the coordinator: ``{file name: manifest entry}`` (bytes, crc32c, tensors) of every
        #: file written into the folder (``dcp_metadata.json`` included); names are relative to ``path``.
        self.files: dict[str, dict[str, Any]] = {}
        self.is_coordinator = False
        self._save: PartSave | None = None  # the coordinator's save (commit=True): opened at planning time
        self._save_id = ""

    def __getstate__(self) -> dict[str, Any]:  # the process checkpointer pickles the writer (before any save)
        state = self.__dict__.copy()
        state["_save"] = None
        return state

    # -- DCP's protocol --------------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self._set_path(checkpoint_id, "checkpoint_id")
        self.abort()
        self.files = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # DCP calls reset() only when dcp.save gets a checkpoint_id: start every save from a clean slate here
        self.abort()
        self.files = {}
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta | None:
        self._save_id = uuid.uuid4().hex  # DCP asks once per save, first thing
        return StorageMeta(checkpoint_id=self.storage.location, save_id=self._save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def _set_path(self, path: Any, what: str) -> None:
        """The storage ``path`` names, resolved once (a folder or an ``s3://`` URL)."""
        storage = resolve(path, storage_options=self.storage_options, what=what)
        assert isinstance(storage, PartStorage)
        if not self.commit:  # refuses, before any save, a location that cannot be written so (ValueError)
            storage.begin_part(commit=False)
        self.storage: PartStorage = storage
        self.path = Path(storage.location)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: open the save every rank writes into (a staging folder, or a new save id in object storage;
        none with ``commit=False``) and tell each rank how to join it and its file name."""
        n = len(plans)
        token = None
        if self.commit:
            self._save = self.storage.begin_part(commit=True)
            token = self._save.token
        return [dataclasses.replace(p, storage_data={"part": token, "file": shard_file_name(i, n)})
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Every rank: encode the non-tensor values, then write this rank's chunks in one parallel pass."""
        info = plan.storage_data
        file = info["file"]
        # commit=False: this writer's own location on every rank (a cached plan's token is the last save's);
        # commit=True: the save the coordinator opened, joined from the plan
        save = self.storage.join_part(info["part"] if self.commit else None)
        results: list[WriteResult] = []
        tensors: dict[str, torch.Tensor] = {}
        tensor_items = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                lookup = getattr(planner, "lookup_object", None)
                if lookup is None:
                    raise TypeError(f"{item.index.fqn}: the planner {type(planner).__name__} has no lookup_object(); "
                                    "fastckpt needs the raw value to store it without pickle")
                value = _encode_object(item.index.fqn, lookup(item.index))
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data={"object": value}))
            else:
                tensor_items.append(item)
        names: dict[tuple, str] = {}
        for item in tensor_items:
            t = planner.resolve_data(item)
            if not isinstance(t, torch.Tensor):  # pragma: no cover - DCP resolves tensor items to tensors
                raise TypeError(f"{item.index.fqn}: the planner resolved a tensor item to {type(t).__name__}")
            t = t.detach()
            chunk = item.tensor_data.chunk if item.tensor_data is not None else None
            offsets = item.index.offset or torch.Size([0] * t.dim())
            full = item.tensor_data.size if item.tensor_data is not None else t.shape
            if chunk is not None and tuple(t.shape) != tuple(chunk.sizes):
                raise ValueError(f"{item.index.fqn}: the planner resolved a chunk of shape {list(t.shape)}, "
                                 f"its plan says {list(chunk.sizes)}")
            key = _view_key(t)
            name = names.get(key) if key is not None else None
            if name is None:  # a tied weight's second name points at the first one's bytes
                name = _chunk_name(item.index.fqn, offsets, t.shape, full)
                while name in tensors:
                    name += "'"
                tensors[name] = t
                if key is not None:
                    names[key] = name
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                                       storage_data={"file": file, "name": name}))
        written = save.write_tensors(file, tensors, durable=self.durable, threads=self.threads)
        where = {name: f for f, held, _ in written for name in held}  # a backend may split them over files
        digests = [(f, digest) for f, _, digest in written]
        results = [dataclasses.replace(r, storage_data={**r.storage_data, "digests": digests,
                                                        **({"file": where[r.storage_data["name"]]}
                                                           if "name" in r.storage_data else {})})
                   for r in results]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write ``dcp_metadata.json`` (and the manifest), fsync, commit in one step."""
        with gc_paused():  # every rank's results: millions of small objects at thousands of ranks
            text, index, files = self._metadata_text(metadata, results)
        self._finish(text, index, files)

    def _metadata_text(self, metadata: Metadata, results: list[list[WriteResult]]) -> tuple[bytes, bytes, dict]:
        """``(dcp_metadata.json, dcp_index.bin, {file: manifest entry})`` of the save (coordinator), written from
        columns (:mod:`fastckpt.dcp.results`)."""
        columns, objects, files = merge_results(metadata, results)
        text = metadata_text(metadata, columns, objects, len(results))
        return text, index_bytes(metadata, columns, objects, len(results), text), files

    def _finish(self, text: bytes, index: bytes, files: dict[str, dict[str, Any]]) -> None:
        """Write the index, then ``dcp_metadata.json`` (last: a folder with it is complete), then commit the save
        with the manifest last (``commit=False``: the outer save commits)."""
        files[INDEX_FILE] = {"bytes": len(index), **text_entry(index)}
        files[METADATA_FILE] = {"bytes": len(text), **text_entry(text)}
        self.files = files
        save = self._save if self.commit else self.storage.begin_part(commit=False)
        assert save is not None, "finish before prepare_global_plan"
        save.write_texts({INDEX_FILE: index, METADATA_FILE: text}, durable=self.durable)
        if not self.commit:
            return
        sizes = {name: entry["bytes"] for name, entry in files.items()}
        checksums = {name: {k: v for k, v in entry.items() if k != "bytes"} for name, entry in files.items()}
        save.commit(files, manifest_dict("dcp", sizes, {"layout": "dcp"}, 0, checksums=checksums),
                    durable=self.durable)
        self._save = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- fastckpt's own --------------------------------------------------------------------------------------
    def save_planner(self, cache_key: str) -> Any:
        """The DCP save planner for saves through this writer: :class:`fastckpt.dcp.SavePlanner` caching its plans
        under ``cache_key`` with ``commit=False`` (the folder is the writer's own path, not the plan's), without
        caching with ``commit=True`` (each save's staging folder reaches the ranks through the plan)."""
        from fastckpt.dcp.planner import SavePlanner as _FastckptSavePlanner

        return _FastckptSavePlanner(cache_key=None if self.commit else cache_key)

    def abort(self) -> None:
        """Drop the staged save of a save that did not finish (a local staging folder is removed; DCP does not
        tell the writer when another rank failed; the next ``reset`` and :func:`fastckpt.dcp.save` call this).
        Idempotent."""
        if self._save is not None:
            self._save.abort()
        self._save = None

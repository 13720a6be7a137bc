"""``fastckpt.dcp.StorageWriter``: DCP's storage writer on the Rust core, atomic and pickle-free."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import StorageWriter as _DCPStorageWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from fastckpt import _core
from fastckpt._format.codec import encode
from fastckpt._format.dcp_index import INDEX_FILE, chunk_name, shard_file_name
from fastckpt._format.dcp_index_write import index_bytes
from fastckpt._format.dcp_metadata import METADATA_FILE
from fastckpt._format.dcp_metadata_write import metadata_text
from fastckpt._format.tensors import tensor_sources
from fastckpt._io.location import check_location
from fastckpt._io.storage.local.commit import check_target, fsync_dir, write_text
from fastckpt._io.storage.local.integrity import text_entry
from fastckpt._io.storage.local.layout import MANIFEST, manifest_dict
from fastckpt._io.storage.local.staging import OwnedPath, clean_leftovers
from fastckpt._io.storage.object.commit import commit_save, new_save, upload_tensor_objects, upload_texts
from fastckpt._io.storage.object.store import OBJECT_SCHEMES, ObjectUrl, open_store, remote_url
from fastckpt.dcp.gc_pause import gc_paused
from fastckpt.dcp.results import merge_results

__all__ = ["StorageWriter", "shard_file_name"]


def object_groups(sizes: dict[str, int], part_size: int, concurrency: int) -> list[list[str]]:
    """The tensors ``{name: bytes}`` of one rank's s3 save split into objects, in order: each closes before the
    tensor that would take it past ``max(part_size, total / concurrency)`` bytes (a larger tensor is an object of
    its own). A rank's data below ``concurrency`` parts so goes as parallel single PUTs of about one part each
    (no multipart upload to assemble); more data gives at most about ``2 * concurrency`` multipart objects."""
    limit = max(part_size, -(-sum(sizes.values()) // concurrency))
    groups: list[list[str]] = [[]]
    held = 0
    for name, n in sizes.items():
        if groups[-1] and held + n > limit:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += n
    return groups


def _object_file(file: str, k: int) -> str:
    """``shard-00000-of-00002.safetensors`` -> ``shard-00000-of-00002.00001.safetensors``: the rank's ``k``-th
    further object of an s3 save."""
    return f"{file.removesuffix('.safetensors')}.{k:05d}.safetensors"


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
    ``fastckpt.json``, then puts the folder in place in one step.

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
        storage_options: for an ``s3://bucket/prefix`` ``path`` (see :func:`fastckpt.save_state`): every rank writes
            its shard file in a private local folder and uploads it under the save's prefix (crc32c checked against
            the writer's); the coordinator uploads ``dcp_metadata.json`` and commits by creating the manifest object
            last (:mod:`fastckpt._io.storage.object.commit`). With ``commit=False`` the ``s3://`` path is a prefix inside a
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
        self._remote: tuple[int, str] | None = None  # the coordinator's (manifest number, save id) of an s3 save
        self._owner: OwnedPath | None = None
        self._finalizer: Any = None
        self._save_id = ""

    def __getstate__(self) -> dict[str, Any]:  # the process checkpointer pickles the writer (before any save)
        state = self.__dict__.copy()
        state["_owner"] = None
        state["_finalizer"] = None
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
        return StorageMeta(checkpoint_id=str(self.url or self.path), save_id=self._save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def _set_path(self, path: Any, what: str) -> None:
        check_location(path, what, supported=OBJECT_SCHEMES)
        self.url = remote_url(path, what)
        if self.url is not None and not self.commit and "/" not in self.url.prefix:
            raise ValueError(f"{what}={path!r}: commit=False writes under a prefix inside a save an outer save "
                             "commits (s3://bucket/checkpoint/save-id/part); pass that prefix, or commit=True")
        self.path = Path(path) if self.url is None else Path(str(self.url))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: create the folder every rank writes into and tell each rank its file name."""
        n = len(plans)
        if self.url is not None and not self.commit:  # under the outer save's prefix: no save of its own
            return [dataclasses.replace(p, storage_data={"folder": None, "file": shard_file_name(i, n)})
                    for i, p in enumerate(plans)]
        if self.url is not None:  # object storage: every rank uploads under one new save id
            number, save_id = self._remote = new_save(open_store(self.url.bucket, self.storage_options), self.url)
            return [dataclasses.replace(p, storage_data={"folder": None, "save_id": save_id,
                                                         "file": shard_file_name(i, n)})
                    for i, p in enumerate(plans)]
        if self.commit:
            target = check_target(self.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            clean_leftovers(target.parent)
            owner = OwnedPath(target.parent, target.name)
            owner.path.mkdir()
            self._owner = owner
            self._finalizer = weakref.finalize(self, owner.release)
            folder = owner.path
        else:
            folder = Path(os.path.abspath(self.path))
            folder.mkdir(parents=True, exist_ok=True)
        return [dataclasses.replace(p, storage_data={"folder": str(folder), "file": shard_file_name(i, n)})
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Every rank: encode the non-tensor values, then write this rank's chunks in one parallel pass."""
        info = plan.storage_data
        file = info["file"]
        # s3: no folder (uploaded from memory); commit=False: this writer's own path on every rank (a cached plan's
        # folder is the last save's, local or not); commit=True: the staging folder the coordinator made, in the plan
        folder = None
        if self.url is None:
            folder = Path(info["folder"]) if self.commit else Path(os.path.abspath(self.path))
            if not self.commit:  # a save written from cached plans (no prepare_global_plan) makes it here
                folder.mkdir(parents=True, exist_ok=True)
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
        digests: list[tuple[str, tuple]] = []
        if tensors and folder is None:  # s3: straight from the tensors' memory, crc32c summed as the parts go out
            assert self.url is not None
            store = open_store(self.url.bucket, self.storage_options)
            groups = object_groups({n: t.numel() * t.element_size() for n, t in tensors.items()}, *store.transfer)
            files = [file if k == 0 else _object_file(file, k) for k in range(len(groups))]
            where = {name: f for f, group in zip(files, groups) for name in group}
            results = [dataclasses.replace(r, storage_data={**r.storage_data, "file": where[r.storage_data["name"]]})
                       if "name" in r.storage_data else r for r in results]
            jobs = [(f, tensor_sources({n: tensors[n] for n in group}), [("format", "pt")])
                    for f, group in zip(files, groups)]
            found = upload_tensor_objects(store, *self._save_prefix(info), jobs, threads=self.threads)
            digests = list(zip(files, found))
        elif tensors:
            assert folder is not None
            digests = [(file, _core.write_files_checked([(str(folder / file), tensor_sources(tensors),
                                                          [("format", "pt")])],
                                                        durable=self.durable, threads=self.threads)[0])]
        results = [dataclasses.replace(r, storage_data={**r.storage_data, "digests": digests}) for r in results]
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
        files[INDEX_FILE] = {"bytes": len(index), **text_entry(index)}
        files[METADATA_FILE] = {"bytes": len(text), **text_entry(text)}
        self.files = files
        if self.url is not None:
            self._finish_remote(text, index, files)
            return
        folder = self._owner.path if self._owner is not None else Path(os.path.abspath(self.path))
        write_text(folder / INDEX_FILE, index, self.durable)
        write_text(folder / METADATA_FILE, text, self.durable)  # last: a folder with it is complete
        if not self.commit:
            if self.durable:
                fsync_dir(folder)
            return
        sizes = {name: entry["bytes"] for name, entry in files.items()}
        checksums = {name: {k: v for k, v in entry.items() if k != "bytes"} for name, entry in files.items()}
        manifest = manifest_dict("dcp", sizes, {"layout": "dcp"}, 0, checksums=checksums)
        write_text(folder / MANIFEST, json.dumps(manifest, indent=2), self.durable)
        if self.durable:
            fsync_dir(folder)
        target = check_target(self.path)
        _core.commit_dir(str(folder), str(target), durable=self.durable)
        self.abort()  # nothing is left at the staging path now: drops the lock file

    def _save_prefix(self, info: dict[str, Any]) -> tuple[ObjectUrl, str]:
        """``(url, save id)`` whose ``{url}/{save id}/`` the objects of an s3 save go under: the save the
        coordinator began (in the plan), or with ``commit=False`` this writer's own prefix (a cached plan holds the
        last save's ids), split at its last segment."""
        assert self.url is not None
        if self.commit:
            return self.url, info["save_id"]
        parent, _, leaf = self.url.prefix.rpartition("/")
        return ObjectUrl(self.url.bucket, parent), leaf

    def _finish_remote(self, text: bytes, index: bytes, files: dict[str, dict[str, Any]]) -> None:
        """Coordinator of an s3 save: upload ``dcp_metadata.json``, then commit the manifest object last (with
        ``commit=False`` only the upload: the outer save commits)."""
        assert self.url is not None
        store = open_store(self.url.bucket, self.storage_options)
        if not self.commit:
            upload_texts(store, *self._save_prefix({}), {INDEX_FILE: index, METADATA_FILE: text})
            return
        assert self._remote is not None
        number, save_id = self._remote
        upload_texts(store, self.url, save_id, {INDEX_FILE: index, METADATA_FILE: text})
        sizes = {name: entry["bytes"] for name, entry in files.items()}
        checksums = {name: {k: v for k, v in entry.items() if k != "bytes"} for name, entry in files.items()}
        manifest = manifest_dict("dcp", sizes, {"layout": "dcp"}, 0, checksums=checksums)
        commit_save(store, self.url, number, save_id,
                    {name: {"bytes": e["bytes"], "crc32c": e["crc32c"]} for name, e in files.items()}, manifest)
        self._remote = None

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
        """Remove the staging folder of a save that did not finish (DCP does not tell the writer when another rank
        failed; the next ``reset`` and :func:`fastckpt.dcp.save` call this). Idempotent."""
        if self._finalizer is not None:
            self._finalizer()  # releases the owner once
            self._finalizer = None
        self._owner = None

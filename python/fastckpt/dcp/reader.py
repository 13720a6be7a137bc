"""``fastckpt.dcp.StorageReader``: DCP's storage reader over a folder :class:`fastckpt.dcp.StorageWriter` wrote."""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader as _DCPStorageReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from fastckpt._format.dcp_index import INDEX_FILE
from fastckpt._format.dcp_metadata import METADATA_FILE
from fastckpt._format.dtypes import to_torch_dtype
from fastckpt._io.dcp.files import (
    open_chunk_files,
    open_located_chunks,
    read_dcp_index,
    read_dcp_metadata,
)
from fastckpt._io.location import check_location
from fastckpt._io.storage.local.layout import MANIFEST, read_manifest
from fastckpt._io.storage.object.fetch import RemoteCheckpoint
from fastckpt._io.storage.object.store import OBJECT_SCHEMES, open_store, remote_url
from fastckpt.dcp.boxes import read_own
from fastckpt.dcp.indexed import Catalog
from fastckpt.dcp.share import Exchange, PeerReadError, assign
from fastckpt.errors import DtypeError, HeaderError, MissingStateError, ShapeMismatchError

__all__ = ["StorageReader"]

def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class StorageReader(_DCPStorageReader):
    """Reads a folder written by :class:`fastckpt.dcp.StorageWriter` for ``dcp.load``, resharding to any world
    size and placement (DCP computes the overlaps; this reader serves boxes of stored chunks by parallel
    positional reads through the Rust core, straight into contiguous CPU destinations).

    Checks, before any tensor is filled: ``dcp_metadata.json`` is well-formed (:class:`~fastckpt.errors.HeaderError`
    otherwise), every file it names is present (:class:`~fastckpt.errors.MissingStateError`) with a valid header
    holding each chunk with the recorded dtype and shape (HeaderError naming the file), the manifest's sizes
    (:class:`~fastckpt.errors.IntegrityError`); and on each rank, before it reads, that every destination has the
    stored dtype (:class:`~fastckpt.errors.DtypeError` naming the key and both dtypes: DCP itself would cast) and
    shape; then, unless ``verify=False``, that every stored chunk this rank reads a box of has the crc32c the
    manifest records (the whole chunk is summed by the Rust core as it comes in, before any destination is filled:
    :class:`~fastckpt.errors.IntegrityError` naming the file and the chunk's tensor). Non-tensor values come back
    from JSON; nothing is unpickled.

    Args:
        path: the folder (``dcp_metadata.json`` in it), or an ``s3://bucket/prefix`` an s3 save committed: each
            rank lists the committed save (every object the manifest object names present with its size, nothing
            else there) and reads ``dcp_metadata.json``; while planning, it reads into memory the objects its own
            boxes come from, and only those (one in-memory file per object, filled by ranged parallel reads;
            nothing written to local disk), each checked against the manifest object (crc32c summed as the bytes
            come in, whatever ``verify`` says): a damaged object fails the planning, on every rank, before any
            destination is filled. :attr:`fetched` names the objects read.
        threads: reader threads (0 = min(8, cores)).
        verify: check the crc32c of every chunk read (a folder without a manifest records none: nothing to check).
        checksums: the folder's files as a manifest records them (``{file name: {"bytes", "crc32c", "tensors"}}``):
            given by a sharded ``load_state``, whose manifest sits one folder up; None reads ``path/fastckpt.json``.
        storage_options: for ``s3://`` (see :func:`fastckpt.save_state`).
        read_once: when several ranks load the same box of a stored chunk (replicated tensors: DDP, HSDP replicas,
            AdamW's ``step``), one rank reads it and sends it to the others over ``process_group``, while they read
            theirs (:mod:`fastckpt.dcp.share`); a rank that fails to read raises on every rank that waits on it.
            Local folders (an ``s3://`` load fetches per rank).
        process_group: the group ``dcp.load`` runs on (None: the default group).
    """

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 0, verify: bool = True,
                 checksums: dict[str, Any] | None = None, storage_options: dict[str, Any] | None = None,
                 read_once: bool = True, process_group: Any = None) -> None:
        super().__init__()
        self.storage_options = storage_options
        self._fetched = contextlib.ExitStack()
        self._remote: RemoteCheckpoint | None = None
        self._part = ""  # the part folder within the remote save this reader serves ("" : the whole save)
        self._set_path(path, "path")
        self.threads = threads
        self.verify = verify
        self._checksums = checksums
        self._records: dict[str, Any] | None = None
        self._parsed: Catalog | None = None
        self._stamp: tuple | None = None
        self._files: dict[str, Any] = {}
        #: use ``dcp_index.bin`` when the folder has one (False: parse ``dcp_metadata.json`` whole, as before)
        self.use_index = True
        #: a box several ranks load is read from storage by one of them and sent to the others (False: each reads)
        self.read_once = read_once
        #: the process group ``dcp.load`` runs on (None: the default group); the shared boxes travel over it
        self.process_group: Any = process_group
        #: bytes this reader read from storage into destinations, summed whole for verification, and received
        self.read_bytes = 0
        self.verified_bytes = 0
        self.received_bytes = 0
        #: the exception the last :meth:`read_metadata` raised (DCP reports it only as an AssertionError's text)
        self.metadata_error: BaseException | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self._set_path(checkpoint_id, "checkpoint_id")
        self._parsed = None
        self._stamp = None
        self._files = {}

    def _set_path(self, path: Any, what: str) -> None:
        check_location(path, what, supported=OBJECT_SCHEMES)
        self._fetched.close()
        self.url = remote_url(path, what)
        self.path = Path(path) if self.url is None else Path(str(self.url))
        self._remote, self._part = None, ""

    def attach_remote(self, remote: RemoteCheckpoint, part: str) -> None:
        """Serve the part folder ``part`` of an opened ``s3://`` checkpoint (a sharded ``load_state``: the outer
        save's objects ``{part}/...``): its ``dcp_metadata.json`` must be fetched already; the objects this rank's
        boxes come from are fetched while planning, as for an ``s3://`` ``path``. The remote stays the caller's."""
        self._fetched.close()
        self._remote, self._part = remote, part
        self.url = remote.url.child(part)
        self.path = Path(str(self.url))

    @property
    def fetched(self) -> list[str]:
        """The objects of an ``s3://`` checkpoint this reader has read (names within the save, in order; ``[]`` for
        a folder)."""
        return list(self._remote.fetched) if self._remote is not None else []

    def _folder(self) -> Path:
        """The local folder to read: ``path``, or the folder of the s3 checkpoint's objects fetched so far
        (``dcp_metadata.json`` first; removed, with their memory, when the reader goes or moves on)."""
        if self.url is None:
            return self.path
        if self._remote is None:
            store = open_store(self.url.bucket, self.storage_options)
            remote = RemoteCheckpoint(store, self.url)
            self._fetched.callback(remote.close)
            weakref.finalize(self, self._fetched.close)
            self._remote = remote
            first = INDEX_FILE if self.use_index and INDEX_FILE in remote.names else METADATA_FILE
            remote.fetch([first] if first in remote.names else [])
        return self._remote.folder / self._part if self._part else self._remote.folder

    def _has(self, name: str) -> bool:
        """Whether the folder (or the s3 checkpoint: fetched or not) holds ``name``."""
        if self._remote is not None:
            return (f"{self._part}/{name}" if self._part else name) in self._remote.names
        return (self._folder() / name).is_file()

    def _fetch_for(self, items: list[ReadItem]) -> None:
        """s3: read the objects holding the chunks ``items`` read from (those not read yet), then open and check
        their headers against the metadata."""
        assert self._parsed is not None and self._remote is not None
        needed = self._needed(items)
        if {loc.file for loc, _, _ in needed.values()} - self._files.keys():
            self._remote.fetch([f"{self._part}/{n}" if self._part else n
                                for n in {loc.file for loc, _, _ in needed.values()} - self._files.keys()])
            records = self._checksums  # the listing matched the manifest's sizes already: its records as they are
            if records is None:
                records = self._remote.manifest["manifest"].get("files", {})
                records = records if isinstance(records, dict) else {}  # each object was checked whole anyway
            self._files, self._records = open_located_chunks(self._folder(), needed, records=records,
                                                             opened=self._files)

    def _needed(self, items: list[ReadItem]) -> dict:
        """``{(fqn, offsets): (location, dtype, sizes)}`` of the stored chunks ``items`` read from."""
        assert self._parsed is not None
        needed = {}
        for item in items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            key = (item.storage_index.fqn, tuple(int(o) for o in (item.storage_index.offset or ())))
            if key not in needed:
                loc, sizes = self._parsed.locate(*key)
                needed[key] = (loc, self._parsed.dtypes[key[0]], sizes)
        return needed

    def _open_for(self, items: list[ReadItem]) -> None:
        """A local folder with an index: open the files ``items`` read from (not open yet) and check the chunks
        they read against the files' headers."""
        needed = self._needed(items)
        if {loc.file for loc, _, _ in needed.values()} - self._files.keys():
            self._files, self._records = open_located_chunks(self._folder(), needed, records=self._records,
                                                             opened=self._files)

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP would fall back to rank-local metadata
        """The folder's metadata: from ``dcp_index.bin`` when the folder has one (its header: one entry per tensor;
        each tensor's chunks are looked up in it as a planner needs them, see :mod:`fastckpt.dcp.indexed`), else
        ``dcp_metadata.json`` parsed whole. Read once per version of the files (a second call, as ``dcp.load``
        makes after fastckpt's own validation, reuses it while their inode, size and mtime are the same)."""
        self.metadata_error = None
        try:
            folder = self._folder()
            stamp = (_stamp(folder / INDEX_FILE), _stamp(folder / METADATA_FILE))
            if self._parsed is None or stamp == (None, None) or stamp != self._stamp:
                self._parsed = None
                self._parsed = self._read_catalog(folder)
                self._stamp = stamp
        except Exception as exc:
            self.metadata_error = exc
            raise
        return self._parsed.metadata

    def _read_catalog(self, folder: Path) -> Catalog:
        if not (self.use_index and self._has(INDEX_FILE)):
            self._records = self._checksums
            return Catalog.from_parsed(read_dcp_metadata(folder))
        if not self._has(METADATA_FILE):  # written last: without it the save did not finish
            raise MissingStateError(f"{folder}: no {METADATA_FILE}; not a fastckpt DCP checkpoint, or a save that "
                                    "did not finish")
        index = read_dcp_index(folder)
        records = self._checksums
        if records is None and self._remote is not None:
            records = self._remote.manifest["manifest"].get("files", {})
        elif records is None:  # sizes: of the files this rank opens, when it opens them
            records = read_manifest(folder, check_sizes=False, check_entries=False).get("files", {}) \
                if (folder / MANIFEST).is_file() else {}
        self._records = records if isinstance(records, dict) else {}
        recorded = self._records.get(METADATA_FILE)
        if isinstance(recorded, dict) and recorded.get("crc32c") != index.doc.get("metadata_crc32c"):
            raise HeaderError(f"{folder / INDEX_FILE}: describes a {METADATA_FILE} of crc32c "
                              f"{index.doc.get('metadata_crc32c')}, the manifest records {recorded.get('crc32c')} "
                              "(the index is not this save's)")
        return Catalog.from_index(index)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._parsed is None or self._parsed.metadata is not metadata:
            self._parsed = self._read_catalog(self._folder())
        if self.url is None and self._parsed.index is None:
            self._files, self._records = open_chunk_files(self._folder(), self._parsed.parsed, records=self._checksums)
        else:  # the files / objects this rank reads are opened once its plan is known (prepare_local_plan)
            self._files = {}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # s3: this rank's objects are read (and checked) now; with an index, this rank's files are opened and
        # checked now: inside DCP's planning round, so a failure on any rank reaches every rank before any reads
        if self.url is not None:
            self._fetch_for(plan.items)
        elif self._parsed is not None and self._parsed.index is not None:
            self._open_for(plan.items)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: with ``read_once``, a box several ranks load is read by one of them and sent to the others
        (:mod:`fastckpt.dcp.share`; a local folder, every rank of :attr:`process_group` in the load)."""
        import torch.distributed as dist

        if not self.read_once or self.url is not None or len(plans) < 2 or not dist.is_initialized() \
                or dist.get_world_size(self.process_group) != len(plans):
            return plans
        return assign(plans)

    def _check(self, item: ReadItem, dest: torch.Tensor) -> None:
        assert self._parsed is not None
        fqn = item.storage_index.fqn
        stored = to_torch_dtype(self._parsed.dtypes[fqn], name=fqn)  # type: ignore[union-attr]
        if dest.dtype != stored:
            raise DtypeError(f"{self.url or self.path}: {fqn!r} is stored as {stored}, the state_dict entry it loads into is "
                             f"{dest.dtype}; load into a {stored} template and cast it yourself")
        if list(dest.shape) != [int(n) for n in item.lengths]:
            raise ShapeMismatchError(f"{self.url or self.path}: {fqn!r}: a box of shape {list(item.lengths)} resolved to a "
                                     f"destination of shape {list(dest.shape)}")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """This rank's boxes: read from the files, or (the boxes another rank reads for it, see
        :mod:`fastckpt.dcp.share`) received from that rank while it reads its own."""
        assert self._parsed is not None
        share = plan.storage_data.get("share") if isinstance(plan.storage_data, dict) else None
        exchange = Exchange(share, self.process_group, str(self.url or self.path)) if share else None
        if exchange is None:
            self._read_own(plan, planner, set())
            fut: Future[None] = Future()
            fut.set_result(None)
            return fut
        exchange.start()
        error: BaseException | None = None
        own: dict[int, tuple[ReadItem, torch.Tensor]] = {}
        try:
            own = self._read_own(plan, planner, set(exchange.recvs))
            sources = {pos: own[pos][1].contiguous().reshape(-1).view(torch.uint8) for pos in exchange.reads}
        except BaseException as exc:  # the receivers hear of it (a status), then it is raised here
            error, sources = exc, None
        exchange.send(sources)
        buffers = {pos: torch.empty(math.prod(int(n) for n in plan.items[pos].lengths)
                                    * to_torch_dtype(self._parsed.dtypes[plan.items[pos].storage_index.fqn]).itemsize,
                                    dtype=torch.uint8) for pos in exchange.recvs}
        failed = exchange.receive(buffers)
        if error is not None:
            raise error
        if failed:
            raise PeerReadError(f"{self.url or self.path}: process {failed[0]} failed to read the boxes it reads for "
                                f"this process too ({len(exchange.recvs)} boxes shared); see its error", failed[0])
        for pos in exchange.recvs:
            item, dest = own[pos]
            dest.copy_(buffers[pos].view(dest.dtype).reshape(dest.shape))
            planner.commit_tensor(item, dest)
        self.received_bytes += sum(int(b.numel()) for b in buffers.values())
        fut = Future()
        fut.set_result(None)
        return fut

    def _read_own(self, plan: LoadPlan, planner: LoadPlanner, elsewhere: set[int]) -> dict:
        """Check every destination, then read the boxes not ``elsewhere`` (plan positions another rank reads) and
        commit them (:func:`fastckpt.dcp.boxes.read_own`); returns ``{position: (item, destination)}``."""
        assert self._parsed is not None
        if self.url is not None:  # a planner that changed the plan after planning: its objects are read here
            self._fetch_for(plan.items)
        elif self._parsed.index is not None:
            self._open_for(plan.items)
        return read_own(self, plan, planner, elsewhere)

    def load_planner(self) -> Any:
        """The DCP load planner for loads through this reader: :class:`fastckpt.dcp.LoadPlanner` (dtype check while
        planning; plans each rank's boxes with the chunk index's lookups)."""
        from fastckpt.dcp.planner import LoadPlanner as _FastckptLoadPlanner

        return _FastckptLoadPlanner()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


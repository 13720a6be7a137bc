"""The object-storage backend of :class:`~fastckpt._io.storage.base.Storage` (``s3://``): a checkpoint is a key
prefix, committed by creating its manifest object last (:mod:`.commit`); a load reads it into memory, every
object's crc32c checked as it comes in (:mod:`.fetch`), and hands the in-memory folder to the local loader.

An :class:`ObjectStorage` is either one named checkpoint (``s3://bucket/run/ckpt``) or a project prefix whose
checkpoints are numbered as a local project's are (:mod:`.project`). It wraps the calls' glue (:mod:`.api`).

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from fastckpt._format.dcp_index import INDEX_FILE
from fastckpt._format.dcp_metadata import METADATA_FILE
from fastckpt._io.group.distributed import Session
from fastckpt._io.storage.base import CheckpointView, Committed
from fastckpt._io.storage.local.folder import pinned
from fastckpt._io.storage.local.layout import peek_manifest
from fastckpt._io.storage.object.api import fetched, opened, pick_remote, save_remote
from fastckpt._io.storage.object.commit import committed_manifest, delete_checkpoint
from fastckpt._io.storage.object.fetch import RemoteCheckpoint
from fastckpt._io.storage.object.parts import ObjectPartSave, ObjectPartView
from fastckpt._io.storage.object.project import object_checkpoints, rotate_object_checkpoints
from fastckpt._io.storage.object.sharded import ObjectSave
from fastckpt._io.storage.object.store import ObjectUrl, open_store, parse_url

__all__ = ["ObjectStorage", "ObjectStagedSave"]


def _committed(url: ObjectUrl, found: dict[str, Any] | None, number: int | None) -> Committed:
    manifest = {} if found is None else found["manifest"]
    step = manifest.get("step")
    return Committed(str(url), number, step if isinstance(step, int) else None, manifest.get("mode") == "model_only")


class ObjectStagedSave:
    """An object-store save opened by :meth:`ObjectStorage.begin`: :meth:`commit` uploads every file under a new
    save-id prefix and then creates the manifest object (:func:`.api.save_remote`); nothing counts before that."""

    def __init__(self, storage: ObjectStorage, url: ObjectUrl | None, model_only: bool) -> None:
        self.storage = storage
        self.location = str(url if url is not None else storage.project)
        self.target = self.location  # how async saves in flight name it until the commit numbers it
        self.number = None
        self._url = url
        self._model_only = model_only
        self._write: tuple[Any, dict[str, Any]] | None = None

    def write(self, plan: Any, *, durable: bool = True, threads: int = 0,
              write_local: Callable[[Path], Any] | None = None, **options: Any) -> None:
        """Take ``plan`` (uploaded straight from its tensors' memory), or None with ``write_local(folder)``: a
        local save then uploaded (tensors off the CPU). ``options``: ``before_commit``."""
        self._write = (plan, dict(threads=threads, write=write_local, **options))

    def commit(self) -> Committed:
        """Upload, then create the manifest object. Raises ConcurrentSaveError / OSError: nothing committed."""
        if self._write is None:
            raise ValueError(f"{self.location}: nothing was written to commit")
        plan, options = self._write
        write = options.pop("write")
        url = save_remote(self._url, None if self._url is not None else self.storage.project,
                          write if write is not None else _no_local, plan=plan, model_only=self._model_only,
                          total_limit=None, storage_options=self.storage.storage_options, **options)
        self._write = None
        self.location = url
        return Committed(url, None, None, self._model_only)

    def abort(self) -> None:
        """Drop the plan (nothing was uploaded: the upload happens inside :meth:`commit`)."""
        self._write = None

    def share(self, link: Any, after_commit: Any) -> None:
        """``share_unchanged`` is not served over ``s3://`` (:meth:`ObjectStorage.check_save` refuses it first)."""
        raise ValueError(f"{self.location}: share_unchanged is not supported with s3:// yet")

    def returned(self, result: Any, *, total_limit: int | None = None) -> Any:
        """What the public call returns: ``result`` (the committed URL, or the async save's handle)."""
        return result


def _no_local(folder: Path) -> None:
    raise ValueError(f"{folder}: an object save without a plan needs write_local")


class ObjectStorage:
    """Checkpoints under an ``s3://`` prefix: one named checkpoint (``url``) or a project's numbered ones.

    Args:
        url: the checkpoint's :class:`~.store.ObjectUrl`, or None for automatic naming under ``project``.
        project: the project prefix (automatic naming); None with a named ``url``.
        storage_options: S3 settings (:func:`.store.open_store`).
    """

    tier = "remote"
    #: every async save is a snapshot: the upload (minutes, on a slow link) then reads only the copy
    snapshot_only: str | None = "over s3://"

    def __init__(self, url: ObjectUrl | None, project: ObjectUrl | None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        assert url is not None or project is not None
        self.url, self.project, self.storage_options = url, project, storage_options
        self.location = str(url if url is not None else project)
        self.root = Path(self.location)  # how async saves in flight name it

    @property
    def store(self) -> Any:
        """The bucket's ``_core.ObjectStore`` (built once per process and options)."""
        target = self.url if self.url is not None else self.project
        assert target is not None
        return open_store(target.bucket, self.storage_options)

    def begin(self, name: str | None = None, *, model_only: bool = False, step: int = 0) -> ObjectStagedSave:
        """A save of the named checkpoint, ``name`` under the project, or the next ``checkpoint_{n}`` (numbered
        when it commits)."""
        if name is not None:
            base = self.project if self.project is not None else self.url
            assert base is not None
            return ObjectStagedSave(self, base.child(name), model_only)
        return ObjectStagedSave(self, self.url, model_only)

    def check_save(self, *, sharded: bool, async_save: Any, share_unchanged: bool) -> None:
        """Raise ValueError for what an object-store save does not serve yet (before anything is written)."""
        if share_unchanged or (async_save and sharded):
            raise ValueError("share_unchanged, and async_save with sharded (DTensor / FSDP2) models, are not "
                             "supported with s3:// yet; save locally, or pass async_save=False / "
                             "share_unchanged=False")

    def list(self, *, model_only: bool = False, full_only: bool | None = None) -> list[Committed]:
        """The committed checkpoints of one kind (full ones: saved in full unless ``full_only=False``), oldest
        first; a named checkpoint lists itself when committed."""
        store = self.store
        if self.url is not None:
            found = committed_manifest(store, self.url)
            return [_committed(self.url, found, None)] if found is not None else []
        assert self.project is not None
        full_only = not model_only if full_only is None else full_only
        numbers = object_checkpoints(store, self.project, model_only=model_only, full_only=full_only)
        return [_committed(url, found, n) for n, (url, found) in sorted(numbers.items())]

    @contextlib.contextmanager
    def open(self, ref: Committed | None = None, *, model_only: bool = False, verify: bool = True,
             threads: int = 0) -> Iterator[CheckpointView]:
        """The checkpoint read into memory and checked (always, whatever ``verify`` says: see :mod:`.fetch`);
        errors and warnings raised inside name the URL, not the in-memory copy."""
        url = self.url if ref is None else _parse(ref.location)
        with (fetched(url, self.project if url is None else None, model_only=model_only,
                      storage_options=self.storage_options) as folder,
              pinned(folder, verify=False, threads=threads, defer=True) as handle):  # every crc32c already checked
            yield CheckpointView(location=self.location if ref is None else ref.location, folder=handle, path=folder,
                                 manifest=peek_manifest(handle), tier=self.tier, checked=True)

    @contextlib.contextmanager
    def as_local(self, ref: Committed | None = None, *, model_only: bool = False) -> Iterator[CheckpointView]:
        """The checkpoint read into memory, every object's size and crc32c checked against the manifest as it comes
        in (``view.copy``: errors and warnings raised inside name the URL, not the copy)."""
        url = self.url if ref is None else _parse(ref.location)
        with fetched(url, self.project if url is None else None, model_only=model_only,
                     storage_options=self.storage_options) as folder:
            yield CheckpointView(location=self.location if ref is None else ref.location, folder=folder, path=folder,
                                 tier=self.tier, checked=True, copy=True)

    @contextlib.contextmanager
    def open_shared(self, *, model_only: bool = False, timeout: float, what: str) -> Iterator[CheckpointView]:
        """The main process picks the committed save (the named checkpoint, or the latest under the project);
        every process opens that save (refusing another one) and reads its small files and each part's metadata
        into memory (a model-only save's files whole); every process agrees (an error on one raises on all) before
        this yields. ``parts(name)``: a part's view fetching its shard objects as its reader asks for them (a sharded
        save; None when every object was read here)."""
        session = Session(f"{what} from {self.location}", timeout)
        chosen, save_id = session.on_main(lambda: self._pick(model_only), step="find")
        with contextlib.ExitStack() as stack:
            error: BaseException | None = None
            remote: RemoteCheckpoint | None = None
            lazy = False
            try:
                remote = stack.enter_context(opened(parse_url(chosen, "input_dir"), None, model_only=model_only,
                                                    storage_options=self.storage_options, save_id=save_id))
                small, lazy = _eager_objects(remote)
                remote.fetch(small)
            except Exception as exc:  # every rank learns of it before anything changes anywhere
                error = exc
            session.agree(error, step="fetch")
            assert remote is not None
            yield CheckpointView(location=chosen, folder=remote.folder, path=remote.folder, tier=self.tier,
                                 checked=True, parts=_part_views(remote) if lazy else None)

    def _pick(self, model_only: bool) -> tuple[str, str]:
        found, save_id = pick_remote(self.url, self.project, model_only=model_only,
                                     storage_options=self.storage_options)
        return str(found), save_id

    def begin_shared(self, name: str | None = None, *, model_only: bool = False, step: int = 0) -> ObjectSave:
        """Main process: a save every process uploads its parts into (:class:`.sharded.ObjectSave`): the named
        checkpoint, ``name`` under the project, or the next ``checkpoint_{n}`` (picked now, over committed
        manifests); a new save id, nothing written yet."""
        url = self.url
        if name is not None:
            base = self.project if self.project is not None else self.url
            assert base is not None
            url = base.child(name)
        return ObjectSave.begin(url, self.project if url is None else None, model_only=model_only,
                                storage_options=self.storage_options)

    def join_shared(self, token: Any) -> ObjectSave:
        """Every other process: the save the main process began (from its ``token``)."""
        return ObjectSave.join(token, storage_options=self.storage_options)

    def _part_url(self) -> ObjectUrl:
        if self.url is None:
            raise ValueError(f"{self.location}: a part save or view needs a named checkpoint, not a project")
        return self.url

    def begin_part(self, *, commit: bool = True) -> ObjectPartSave:
        """A save of the named checkpoint every process uploads its own objects into (:class:`.parts.ObjectPartSave`:
        a new save id, the manifest object last; ``commit=False``: straight under the URL, a prefix inside a save
        an outer save commits)."""
        return ObjectPartSave(self._part_url(), self.storage_options, commit=commit)

    def join_part(self, token: Any) -> ObjectPartSave:
        """The part save another process began (its save id, from ``token``)."""
        return ObjectPartSave.join(self._part_url(), self.storage_options, token)

    def open_part(self) -> ObjectPartView:
        """The newest committed save of the named checkpoint, listed and checked; objects read into memory as
        asked (:class:`.parts.ObjectPartView`, released by its ``close``)."""
        return ObjectPartView(RemoteCheckpoint(self.store, self._part_url()), owned=True)

    def remove(self, ref: Committed) -> None:
        """Delete its manifests first (it stops counting at once), then its objects."""
        delete_checkpoint(self.store, _parse(ref.location))

    def rotate(self, total_limit: int, *, model_only: bool = False) -> list[str]:
        """:func:`.project.rotate_object_checkpoints` of the project (a named checkpoint is never rotated)."""
        if self.project is None:
            return []
        return [str(u) for u in rotate_object_checkpoints(self.store, self.project, total_limit,
                                                          model_only=model_only)]


def _part_views(remote: RemoteCheckpoint) -> Callable[[str], ObjectPartView]:
    """``parts(name)`` of an opened sharded save: the part's view over ``remote`` (which stays the opener's)."""
    return lambda name: ObjectPartView(remote, name)


def _eager_objects(remote: RemoteCheckpoint) -> tuple[list[str], bool]:
    """``(names, lazy)``: the objects every rank reads before planning: of a sharded save, everything but the
    parts' shard files (each part reader fetches the shards its boxes come from: ``lazy``); of a model-only save
    (Hugging Face files every rank reads in full), every object."""
    sharded = remote.manifest["manifest"].get("sharded")
    parts = sharded.get("parts") if isinstance(sharded, dict) else None
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        return remote.names, False

    names = set(remote.names)

    def before_planning(name: str) -> bool:  # a part's index when it has one (its metadata is for tools), else that
        part, _, rest = name.partition("/")
        return part not in parts or rest == INDEX_FILE or (rest == METADATA_FILE and f"{part}/{INDEX_FILE}" not in names)

    return [n for n in remote.names if before_planning(n)], True


def _parse(location: str) -> ObjectUrl:
    return parse_url(location, "checkpoint")

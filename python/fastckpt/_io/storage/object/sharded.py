"""The object-store side of a save whose objects several processes upload (a sharded FSDP2 / DTensor save to
``s3://``; :mod:`fastckpt._plan.sharded_save` runs the steps): the ``s3://``
:class:`~fastckpt._io.storage.base.SharedSave`.

The main process begins the save (:meth:`ObjectSave.begin`: the checkpoint URL, picked by automatic naming under a
project when asked, and the ``(number, save id)`` of :func:`~fastckpt._io.storage.object.commit.new_save`); every
process joins it from its :attr:`~ObjectSave.token` (:meth:`ObjectSave.join`) and uploads its own objects under
``{url}/{save id}/{part}/`` (:meth:`ObjectSave.part`: fastckpt.dcp's ``StorageWriter(commit=False)`` on that
prefix, straight from tensor memory, no local disk); the main process then uploads the small files and creates the
manifest object last (:meth:`ObjectSave.commit`). Until then nothing is committed; a save that fails is removed
(:meth:`ObjectSave.abort`, best effort: an upload still running elsewhere goes with the next committed save).

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastckpt._io.files import SavePlan
from fastckpt._io.storage.base import Committed
from fastckpt._io.storage.object.commit import commit_save, new_save, remove_save, upload_plan
from fastckpt._io.storage.object.project import next_object_checkpoint
from fastckpt._io.storage.object.store import ObjectUrl, open_store, parse_url

__all__ = ["ObjectSave"]


class ObjectSave:
    """One save to an ``s3://`` checkpoint made by every process (see the module docs): begun by the main process
    (:meth:`begin`), joined by the others (:meth:`join`).

    Args:
        url: the checkpoint's URL.
        number, save_id: the manifest number and save id the main process began.
        model_only: the kind of save (the manifest's mode).
        storage_options: see :func:`fastckpt.save_state`.
        opener: this process began it (it alone removes the objects of a save that failed).
    """

    #: the processes share no folder: a model-only save gathers the full state to the main process instead
    folder: Path | None = None

    def __init__(self, url: ObjectUrl, number: int, save_id: str, *, model_only: bool,
                 storage_options: Mapping[str, Any] | None, opener: bool = False) -> None:
        self.url, self.number, self.save_id = url, number, save_id
        self.location = str(url)
        self.model_only = model_only
        self.storage_options = dict(storage_options) if storage_options else None
        self.opener = opener
        self.committed = False

    @classmethod
    def begin(cls, url: ObjectUrl | None, project: ObjectUrl | None, *, model_only: bool,
              storage_options: Mapping[str, Any] | None) -> ObjectSave:
        """Main process: a new save of ``url``, or of the next ``checkpoint_{n}`` under ``project`` (counted over
        committed manifests); nothing is written yet.

        Raises:
            OSError: the store failed listing the checkpoint's manifests (or the project's checkpoints).
        """
        target = url if url is not None else project
        assert target is not None
        store = open_store(target.bucket, storage_options)
        if url is None:
            assert project is not None
            url = next_object_checkpoint(store, project, model_only=model_only)
        number, save_id = new_save(store, url)
        return cls(url, number, save_id, model_only=model_only, storage_options=storage_options, opener=True)

    @property
    def token(self) -> tuple[str, int, str, bool]:
        """What another process joins the save by: ``(checkpoint url, manifest number, save id, model_only)``."""
        return str(self.url), self.number, self.save_id, self.model_only

    @classmethod
    def join(cls, token: tuple[str, int, str, bool], *, storage_options: Mapping[str, Any] | None) -> ObjectSave:
        """Every other process: the save :meth:`begin` made on the main process."""
        return cls(parse_url(token[0], "output_dir"), token[1], token[2], model_only=token[3],
                   storage_options=storage_options)

    @property
    def store(self) -> Any:
        return open_store(self.url.bucket, self.storage_options)

    def part(self, name: str) -> str:
        """The ``s3://`` prefix the objects of part ``name`` (``model``, ``optimizer_1``, ...) go under."""
        return str(self.url.child(self.save_id, name))

    def commit(self, plan: SavePlan, sharded: dict[str, Any] | None, *, durable: bool = True, threads: int = 0,
               checksums: dict[str, dict[str, Any]] | None = None) -> Committed:
        """Main process: upload ``plan``'s files, then create the manifest object (listing them and the objects
        the processes uploaded, ``sharded["files"]``), holding the checkpoint manifest a local save writes
        (``sharded``: its ``"sharded"`` entry; None: a model-only save of full files).

        Raises:
            ConcurrentSaveError: another save committed the same manifest number first. OSError: the store failed
                (names the object). ValueError / DtypeError: a tensor the writer refuses. Nothing is committed.
        """
        store = self.store
        counts = None if sharded is None else {"sharded": sharded}
        uploaded, manifest = upload_plan(store, self.url, self.save_id, plan, threads=threads, counts=counts)
        objects = {} if sharded is None else sharded["files"]
        listed = {name: {"bytes": e["bytes"], "crc32c": e["crc32c"]} for name, e in objects.items()}
        commit_save(store, self.url, self.number, self.save_id, {**listed, **uploaded}, manifest)
        self.committed = True
        return Committed(str(self.url), None, plan.step, self.model_only)

    def abort(self) -> None:
        """The main process, after a failure: remove the save's objects (best effort; never raises). Nothing once
        committed, nothing on the other processes."""
        if self.opener and not self.committed:
            try:
                remove_save(self.store, self.url, self.save_id)
            except Exception:  # best effort: the next committed save collects what is left
                pass

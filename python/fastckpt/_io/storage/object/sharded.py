"""The object-store side of a save whose objects several processes upload (a sharded FSDP2 / DTensor
``save_state`` to ``s3://``; :mod:`fastckpt._plan.sharded_save` runs the steps).

The main process begins the save (:meth:`ObjectSave.begin`: the checkpoint URL, picked by automatic naming under a
project when asked, and the ``(number, save id)`` of :func:`~fastckpt._io.storage.object.commit.new_save`); every process
learns it (:meth:`ObjectSave.join`) and uploads its own objects under ``{url}/{save id}/{part}/``
(:meth:`ObjectSave.part`: fastckpt.dcp's ``StorageWriter(commit=False)`` on that prefix, straight from tensor
memory, no local disk); the main process then uploads the small files and creates the manifest object last
(:meth:`ObjectSave.commit`). Until then nothing is committed; a save that fails is removed
(:meth:`ObjectSave.discard`, best effort: an upload still running elsewhere goes with the next committed save).

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastckpt._io.files import SavePlan
from fastckpt._io.storage.object.commit import commit_save, new_save, remove_save, upload_plan
from fastckpt._io.storage.object.project import next_object_checkpoint, rotate_object_checkpoints
from fastckpt._io.storage.object.store import ObjectUrl, open_store, parse_url

__all__ = ["ObjectSave"]


class ObjectSave:
    """One save to an ``s3://`` checkpoint made by every process (see the module docs).

    Args:
        url: the checkpoint's URL; None: the next ``checkpoint_{n}`` under ``project`` (picked by the main process
            at :meth:`begin`, counted over committed manifests).
        project: the project prefix of automatic naming (None with ``url``).
        model_only: which kind automatic naming and rotation count (``model_only/`` or ``checkpoints/``).
        storage_options: see :func:`fastckpt.save_state`.
    """

    def __init__(self, url: ObjectUrl | None, project: ObjectUrl | None, *, model_only: bool,
                 storage_options: Mapping[str, Any] | None) -> None:
        assert url is not None or project is not None
        self.url = url
        self.project = project
        self.model_only = model_only
        self.storage_options = dict(storage_options) if storage_options else None
        self.number: int | None = None
        self.save_id: str | None = None
        self.committed = False

    def __str__(self) -> str:
        if self.url is not None:
            return str(self.url)
        return f"{self.project} (its next {'model_only' if self.model_only else 'checkpoints'}/checkpoint_N)"

    @property
    def store(self) -> Any:
        target = self.url if self.url is not None else self.project
        assert target is not None
        return open_store(target.bucket, self.storage_options)

    def begin(self) -> tuple[str, int, str]:
        """Main process: ``(checkpoint url, manifest number, save id)`` of a new save (nothing is written yet).

        Raises:
            OSError: the store failed listing the checkpoint's manifests (or the project's checkpoints).
        """
        store = self.store
        url = self.url
        if url is None:
            assert self.project is not None
            url = next_object_checkpoint(store, self.project, model_only=self.model_only)
        number, save_id = new_save(store, url)
        return str(url), number, save_id

    def join(self, begun: tuple[str, int, str]) -> None:
        """Every process: take the save :meth:`begin` made on the main process."""
        self.url = parse_url(begun[0], "output_dir")
        self.number, self.save_id = begun[1], begun[2]

    def part(self, name: str) -> str:
        """The ``s3://`` prefix the objects of part ``name`` (``model``, ``optimizer_1``, ...) go under."""
        assert self.url is not None and self.save_id is not None
        return str(self.url.child(self.save_id, name))

    def commit(self, plan: SavePlan, *, objects: dict[str, dict[str, Any]], counts: dict[str, Any] | None = None,
               threads: int = 0) -> None:
        """Main process: upload ``plan``'s files, then create the manifest object (listing them and ``objects``,
        the ``{name: {"bytes", "crc32c", ...}}`` the other processes uploaded), holding the checkpoint manifest a
        local save writes (``counts`` added: the ``"sharded"`` entry).

        Raises:
            ConcurrentSaveError: another save committed the same manifest number first. OSError: the store failed
                (names the object). ValueError / DtypeError: a tensor the writer refuses. Nothing is committed.
        """
        assert self.url is not None and self.number is not None and self.save_id is not None
        store = self.store
        uploaded, manifest = upload_plan(store, self.url, self.save_id, plan, threads=threads, counts=counts)
        listed = {name: {"bytes": e["bytes"], "crc32c": e["crc32c"]} for name, e in objects.items()}
        commit_save(store, self.url, self.number, self.save_id, {**listed, **uploaded}, manifest)
        self.committed = True

    def discard(self) -> None:
        """Main process, after a failure: remove the save's objects (best effort; never raises)."""
        if self.url is not None and self.save_id is not None and not self.committed:
            try:
                remove_save(self.store, self.url, self.save_id)
            except Exception:  # best effort: the next committed save collects what is left
                pass

    def rotate(self, total_limit: int) -> None:
        """Main process, after the commit, with automatic naming: keep the newest ``total_limit`` checkpoints of
        the kind saved."""
        if self.project is not None:
            rotate_object_checkpoints(self.store, self.project, total_limit, model_only=self.model_only)

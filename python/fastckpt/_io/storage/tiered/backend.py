"""The tiered backend of :class:`~fastckpt._io.storage.base.Storage`: local, then remote. A save commits in a local
folder first (the local backend), then that committed folder is uploaded to object storage and committed there by
its manifest object, in the background (:mod:`.upload`); a load reads the local tier when it holds a committed
checkpoint, else the remote one.

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastckpt._io.storage.base import CheckpointView, Committed
from fastckpt._io.storage.local.backend import LocalStagedSave, LocalStorage
from fastckpt._io.storage.object.backend import ObjectStorage
from fastckpt._io.storage.tiered.upload import TieredSave, finish_tiered, start_tiered

__all__ = ["TieredStorage", "TieredStagedSave"]


class TieredStagedSave:
    """A tiered save: the local tier's save; what the public call returns (:meth:`returned`) starts its upload."""

    def __init__(self, storage: TieredStorage, local: LocalStagedSave, model_only: bool) -> None:
        self.storage, self.local, self.model_only = storage, local, model_only
        self.upload: TieredSave | None = None

    @property
    def target(self) -> Path:
        """The local folder (async saves in flight are named by it)."""
        return self.local.target

    @property
    def location(self) -> str:
        return self.local.location

    @property
    def number(self) -> int | None:
        return self.local.number

    def renumber(self, number: int) -> None:
        """As the local tier's :meth:`~fastckpt._io.storage.local.backend.LocalStagedSave.renumber`."""
        self.local.renumber(number)

    def claim(self) -> None:
        """The local tier's :meth:`~fastckpt._io.storage.local.backend.LocalStagedSave.claim` (an async save's call)."""
        self.local.claim()

    def share(self, link: Any, after_commit: Any) -> None:
        """The local tier's :meth:`~fastckpt._io.storage.local.backend.LocalStagedSave.share`."""
        self.local.share(link, after_commit)

    def write(self, plan: Any, *, durable: bool = True, threads: int = 0, **options: Any) -> None:
        """The local tier's :meth:`~fastckpt._io.storage.local.backend.LocalStagedSave.write`."""
        self.local.write(plan, durable=durable, threads=threads, **options)

    def commit(self) -> Committed:
        """Commit locally (the upload starts from :meth:`returned`, which may hold an async save's handle)."""
        return self.local.commit()

    def abort(self) -> None:
        """Drop the local save (nothing was uploaded)."""
        self.local.abort()

    def returned(self, result: Path | Any, *, total_limit: int | None = None) -> TieredSave:
        """Upload the committed folder (or, for an async save, the one its handle commits) in the background;
        returns the upload's handle. ``total_limit`` rotates the remote tier after the upload's commit."""
        self.upload = self.storage.upload(result, model_only=self.model_only, total_limit=total_limit)
        return self.upload


class TieredStorage:
    """A local :class:`LocalStorage` in front of a remote :class:`ObjectStorage` (a checkpoint URL, or a project
    prefix when the local tier numbers its checkpoints)."""

    tier = "tiered"
    #: as the local tier
    snapshot_only: str | None = None

    def __init__(self, local: LocalStorage, remote: ObjectStorage) -> None:
        self.local, self.remote = local, remote
        self.location = local.location
        self.root = local.root

    def upload(self, folder: Path | Any, *, model_only: bool, total_limit: int | None) -> TieredSave:
        """Upload the committed (or committing: an async save's handle) local ``folder`` in the background."""
        auto = self.local.folder is None
        target = self.remote.project if self.remote.project is not None else self.remote.url
        assert target is not None
        return start_tiered(folder, target, project_root=self.local.project.absolute() if auto else None,
                            model_only=model_only, total_limit=total_limit,
                            storage_options=self.remote.storage_options)

    def begin(self, name: str | None = None, *, model_only: bool = False, step: int = 0) -> TieredStagedSave:
        """A local save whose handle (:meth:`TieredStagedSave.returned`) starts the upload; an earlier upload's
        error is raised first (it is waited for)."""
        finish_tiered()
        return TieredStagedSave(self, self.local.begin(name, model_only=model_only, step=step), model_only)

    def check_save(self, *, sharded: bool, async_save: Any, share_unchanged: bool) -> None:
        """Raise ValueError for a sharded save (the local tier would need a folder every process shares)."""
        if sharded:
            raise ValueError("a tiered save of sharded (DTensor / FSDP2) models is not supported (the local tier "
                             "would need a folder every process shares); save to output_dir='s3://...' directly: "
                             "every process uploads its own shards")

    def previous(self, save: TieredStagedSave) -> Committed | None:
        """The local tier's :meth:`~fastckpt._io.storage.local.backend.LocalStorage.previous`."""
        return self.local.previous(save.local)

    def list(self, *, model_only: bool = False, full_only: bool | None = None) -> list[Committed]:
        """The local tier's committed checkpoints (the remote tier holds those uploaded)."""
        return self.local.list(model_only=model_only, full_only=full_only)

    @contextlib.contextmanager
    def open(self, ref: Committed | None = None, *, model_only: bool = False, verify: bool = True,
             threads: int = 0) -> Iterator[CheckpointView]:
        """The local tier's checkpoint when it holds one, else the remote tier's."""
        tier = self.local if ref is not None or self.local.list(model_only=model_only) else self.remote
        with tier.open(ref, model_only=model_only, verify=verify, threads=threads) as view:
            yield view

    @contextlib.contextmanager
    def as_local(self, ref: Committed | None = None, *, model_only: bool = False) -> Iterator[CheckpointView]:
        """The local tier's files when it holds a committed checkpoint (or ``ref``), else the remote tier's copy."""
        tier = self.local if ref is not None or self.local.list(model_only=model_only) else self.remote
        with tier.as_local(ref, model_only=model_only) as view:
            yield view

    @contextlib.contextmanager
    def open_shared(self, *, model_only: bool = False, timeout: float, what: str) -> Iterator[CheckpointView]:
        """The local tier's :meth:`open_shared` (a sharded save is never tiered)."""
        with self.local.open_shared(model_only=model_only, timeout=timeout, what=what) as view:
            yield view

    def remove(self, ref: Committed) -> None:
        """Remove the local checkpoint (the remote one is rotated by the remote tier)."""
        self.local.remove(ref)

    def rotate(self, total_limit: int, *, model_only: bool = False) -> list[str]:
        """Rotate the local tier (a folder still uploading is kept until its upload ends)."""
        return self.local.rotate(total_limit, model_only=model_only)

"""One ``s3://`` checkpoint's objects written by several processes at once, and read object by object
(``fastckpt.dcp``'s writer and reader): the object-store side of :class:`~fastckpt._io.storage.base.PartSave` /
:class:`~fastckpt._io.storage.base.PartView`.

A committed part save begins a new save id (:func:`.commit.new_save`) on the opener; every process uploads its
tensors under ``{url}/{save id}/`` straight from their memory, split into objects by :func:`object_groups`; the
opener uploads the small files and creates the manifest object last (:func:`.commit.commit_save`). With
``commit=False`` the URL is a prefix inside a save an outer save commits: the objects go straight under it.
A view lists the committed save (:class:`.fetch.RemoteCheckpoint`) and reads objects into memory as a reader asks
for them, each crc32c checked as it comes in.

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastckpt._format.tensors import tensor_sources
from fastckpt._io.storage.object.commit import commit_save, new_save, upload_tensor_objects, upload_texts
from fastckpt._io.storage.object.fetch import RemoteCheckpoint
from fastckpt._io.storage.object.store import ObjectUrl, open_store

__all__ = ["ObjectPartSave", "ObjectPartView", "object_groups"]


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


class ObjectPartSave:
    """A save of the checkpoint ``url`` that every process uploads its own objects into (see the module docs).

    Args:
        url: the checkpoint's URL (``commit=False``: a prefix inside an outer save, ``.../save-id/part``).
        storage_options: S3 settings (:func:`.store.open_store`).
        commit: False: upload straight under ``url``, commit nothing.
        save_id: the save another process began (:meth:`join`); None: this process begins one.

    Raises:
        ValueError: ``commit=False`` with a URL of one segment (no outer save's prefix).
    """

    def __init__(self, url: ObjectUrl, storage_options: Mapping[str, Any] | None, *, commit: bool,
                 save_id: str | None = None) -> None:
        self.location = str(url)
        self.storage_options = storage_options
        self.number: int | None = None
        if not commit:
            if "/" not in url.prefix:
                raise ValueError(f"{url}: commit=False writes under a prefix inside a save an outer save commits "
                                 "(s3://bucket/checkpoint/save-id/part); pass that prefix, or commit=True")
            parent, _, save_id = url.prefix.rpartition("/")
            self.url = ObjectUrl(url.bucket, parent)
        else:
            self.url = url
            if save_id is None:  # the opener: one above the newest committed manifest, nothing written yet
                self.number, save_id = new_save(self.store, url)
        self.save_id: str = save_id
        self.token: Any = {"save_id": save_id} if commit else None

    @classmethod
    def join(cls, url: ObjectUrl, storage_options: Mapping[str, Any] | None, token: Any) -> ObjectPartSave:
        """The save another process began (``token``: its :attr:`token`; None: ``commit=False``)."""
        if token is None:
            return cls(url, storage_options, commit=False)
        return cls(url, storage_options, commit=True, save_id=token["save_id"])

    @property
    def store(self) -> Any:
        return open_store(self.url.bucket, self.storage_options)

    def write_tensors(self, file: str, tensors: Mapping[str, Any], *, durable: bool = True,
                      threads: int = 0) -> list[tuple[str, list[str], tuple]]:
        """``tensors`` as objects named after ``file`` (:func:`object_groups`), uploaded from their memory, crc32c
        summed as the parts go out."""
        if not tensors:
            return []
        store = self.store
        groups = object_groups({n: t.numel() * t.element_size() for n, t in tensors.items()}, *store.transfer)
        files = [file if k == 0 else _object_file(file, k) for k in range(len(groups))]
        jobs = [(f, tensor_sources({n: tensors[n] for n in group}), [("format", "pt")])
                for f, group in zip(files, groups)]
        found = upload_tensor_objects(store, self.url, self.save_id, jobs, threads=threads)
        return list(zip(files, groups, found))

    def write_texts(self, texts: Mapping[str, bytes], *, durable: bool = True) -> None:
        """Each small file put under the save's prefix."""
        upload_texts(self.store, self.url, self.save_id, dict(texts))

    def commit(self, files: Mapping[str, Mapping[str, Any]], manifest: Mapping[str, Any], *,
               durable: bool = True) -> None:
        """Create the manifest object last (listing every object's bytes and crc32c, holding ``manifest``)."""
        assert self.number is not None, "only the process that began the save commits it"
        commit_save(self.store, self.url, self.number, self.save_id,
                    {name: {"bytes": e["bytes"], "crc32c": e["crc32c"]} for name, e in files.items()}, dict(manifest))
        self.number = None

    def abort(self) -> None:
        """Nothing to do: an uncommitted save's objects go with the next committed save of the checkpoint."""


class ObjectPartView:
    """The part folder ``part`` ("" : the whole save) of the committed save ``remote``, its objects read into
    memory as a reader asks for them. ``owned``: :meth:`close` releases ``remote`` (else it stays its opener's)."""

    fetches = True

    def __init__(self, remote: RemoteCheckpoint, part: str = "", *, owned: bool = False) -> None:
        self.remote, self.part, self.owned = remote, part, owned
        self.location = str(remote.url.child(part) if part else remote.url)
        self.folder: Path = remote.folder / part if part else remote.folder

    def _name(self, name: str) -> str:
        return f"{self.part}/{name}" if self.part else name

    @property
    def fetched(self) -> list[str]:
        return list(self.remote.fetched)

    def has(self, name: str) -> bool:
        return self._name(name) in self.remote.names

    def fetch(self, names: Any) -> None:
        self.remote.fetch([self._name(n) for n in names])

    def records(self) -> dict[str, Any]:
        """The checkpoint manifest's file records (the listing matched their sizes when the save was opened)."""
        records = self.remote.manifest["manifest"].get("files", {})
        return records if isinstance(records, dict) else {}

    def close(self) -> None:
        if self.owned:
            self.remote.close()

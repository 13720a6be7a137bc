"""Reading a checkpoint committed under an object-store prefix (see :mod:`fastckpt._io.storage.object.commit` for
the layout and the commit).

A load takes the newest manifest, lists the save's prefix and refuses a missing object, one of another size or an
object the manifest does not list (:class:`~fastckpt.errors.IntegrityError` naming it); it reads every object
into an in-memory file of its own by ranged parallel reads (nothing is written to local disk), checks each crc32c
as the bytes come in (a mismatch names the object and the tensor), and hands a folder of links to those files to
the local loader, which reads fresh memory first and applies after, as for a local folder.

May import: layers 0-1, the shared ``_io`` modules, ``storage.local`` and the other modules of this package.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastckpt._io.log import logger
from fastckpt._io.storage.local.integrity import check_checkpoint, crc_hex
from fastckpt._io.storage.local.layout import MANIFEST
from fastckpt._io.storage.object.commit import MANIFESTS, RETRIES, committed_manifest
from fastckpt._io.storage.object.store import ObjectUrl
from fastckpt.errors import CheckpointChangedError, IntegrityError, MissingStateError

__all__ = ["memory_available", "fetched_checkpoint", "RemoteCheckpoint", "as_fetched"]


def memory_available() -> int | None:
    """Bytes of memory the kernel could give without swapping (``MemAvailable``), None when it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _MemoryFolder:
    """Where a fetched checkpoint lives: in memory, never on local disk.

    Each object is one anonymous in-memory file (``memfd_create``: pages of RAM, not bounded by a tmpfs mount's
    size), filled by the store's ranged parallel reads through ``/proc/self/fd/N``; the folder the local loader
    reads is a private directory of symlinks to them (on ``/dev/shm`` when it is there, else in the temp folder:
    links only, no data), so every path-based reader (mmap, the pinned folder handle) works unchanged and the
    bytes are written once, from the responses into the memory the loader maps. A checkpoint larger than the
    memory available (``MemAvailable``), or a system without ``memfd_create`` (not Linux), is read into plain
    files of a private temp folder instead (logged).
    """

    def __init__(self) -> None:
        self.can_map = hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")
        self.memory = False
        self.disk: Path | None = None  # the temp folder of objects not read into memory
        self.files = 0  # objects written there so far (their file names are numbered)
        self.roots: list[Path] = []
        self.fds: list[int] = []

    def folder(self, where: str) -> Path:
        """A new empty folder for the checkpoint at ``where`` (its URL, for the log): links on ``/dev/shm`` when it
        is there (no data is written to it), else in the temp folder."""
        shm = "/dev/shm"
        scratch = shm if self.can_map and os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
        self.roots.append(Path(tempfile.mkdtemp(prefix="fastckpt-s3-", dir=scratch)))
        return self.roots[-1] / "checkpoint"

    def reserve(self, nbytes: int, where: str) -> None:
        """Before reading ``nbytes`` more bytes: in memory while the kernel has them available, else into plain
        files of a private temp folder (logged)."""
        available = memory_available() if self.can_map else None
        self.memory = self.can_map and (available is None or nbytes <= available)
        if self.can_map and not self.memory:
            logger.warning("%s: %d bytes, more than the %d bytes of memory available: read into a local temp "
                           "folder instead", where, nbytes, available)

    def forget(self, folder: Path, name: str) -> None:
        """Remove the object ``name`` from ``folder`` (a fetch that failed; its memory goes with the reader)."""
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()

    def target(self, folder: Path, name: str) -> str:
        """The path to write the object ``name`` of ``folder`` into: the memfd behind its link, or (not in memory)
        a file of a private temp folder off ``/dev/shm``, linked too."""
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.memory:
            fd = os.memfd_create(name.replace("/", "_")[-200:])  # the name only shows in /proc (at most 249 bytes)
            self.fds.append(fd)
            where = f"/proc/self/fd/{fd}"
        else:
            if self.disk is None:
                self.roots.append(Path(tempfile.mkdtemp(prefix="fastckpt-s3-data-")))
                self.disk = self.roots[-1]
            self.files += 1
            where = str(self.disk / f"{self.files}-{name.replace('/', '_')[-200:]}")
            open(where, "wb").close()
        os.symlink(where, path)
        return where

    def write(self, folder: Path, name: str, data: bytes) -> None:
        with open(self.target(folder, name), "wb") as f:
            f.write(data)

    def close(self) -> None:
        while self.roots:
            shutil.rmtree(self.roots.pop(), ignore_errors=True)
        self.disk = None
        while self.fds:  # the memory goes when the last mapping of it does
            os.close(self.fds.pop())


@contextlib.contextmanager
def fetched_checkpoint(store: Any, url: ObjectUrl, save_id: str | None = None) -> Iterator[Path]:
    """The committed checkpoint at ``url`` read into memory (:class:`_MemoryFolder`: nothing is written to local
    disk) by ranged parallel reads, every object's crc32c summed as its bytes come in and checked against the
    manifest (and the checkpoint manifest inside it recording the same file sums) before this yields; yields a
    folder of it for the local loader (removed afterwards, with the memory). Every byte of the folder is then
    known to be what was saved: a loader need not sum it again (it is private memory nobody else writes).

    Raises:
        MissingStateError: no committed manifest at ``url``.
        IntegrityError: an object the manifest lists is missing or has another size, an object is there that it
            does not list, or the bytes read have another crc32c (names the object and the damaged tensor).
        CheckpointChangedError: newer saves replaced the checkpoint while it was read, 5 times in a row; with
            ``save_id`` (the save another process picked): the committed save is another one.
        HeaderError: a malformed manifest. OSError: the store failed after the bounded retries.
    """
    for _attempt in range(RETRIES):
        remote = RemoteCheckpoint(store, url, save_id)
        try:
            remote.fetch(remote.names)
        except CheckpointChangedError:
            remote.close()  # a newer save replaced it while we read: start over
            continue
        except BaseException:
            remote.close()
            raise
        break
    else:
        raise CheckpointChangedError(f"{url}: newer saves replaced it {RETRIES} times while it was read; retry")
    try:
        yield remote.folder
    finally:
        remote.close()


class RemoteCheckpoint:
    """The committed checkpoint at ``url``, read into memory object by object as a reader asks for them (a DCP
    rank fetches only the objects its boxes come from).

    Opening takes the newest committed manifest, lists its save and checks that every object the manifest lists is
    there with the recorded size and that nothing else is (:class:`~fastckpt.errors.IntegrityError` naming each
    object otherwise), and writes the checkpoint's own manifest into :attr:`folder`. :meth:`fetch` reads objects in
    (:class:`_MemoryFolder`: never to local disk; ranged parallel reads, each object's crc32c summed as its bytes
    come in and checked against the manifest object before it returns). :attr:`folder` holds the fetched objects
    only, under their names; a path-based reader opens them as local files.

    ``save_id``: the save to read (the one another process picked); another committed save there raises
    CheckpointChangedError.

    Raises (opening): MissingStateError (no committed manifest), IntegrityError (the listing disagrees with the
    manifest), HeaderError (a malformed manifest), OSError (the store failed after the bounded retries).
    """

    def __init__(self, store: Any, url: ObjectUrl, save_id: str | None = None) -> None:
        self.store, self.url = store, url
        self._space = _MemoryFolder()
        try:
            for _attempt in range(RETRIES):
                manifest = committed_manifest(store, url)
                if manifest is None:
                    raise MissingStateError(f"{url}: no committed checkpoint there (no {MANIFESTS}/*.json; a save "
                                            "that did not finish is never loaded)")
                if save_id is not None and manifest["save_id"] != save_id:
                    raise CheckpointChangedError(f"{url}: the committed save is {manifest['save_id']}, not {save_id} "
                                                 "(the one process 0 picked): a newer save replaced it; retry")
                try:
                    self.folder = self._open(manifest)
                    break
                except IntegrityError:
                    if not self._replaced(manifest):
                        raise
                    self._space.close()  # a newer save replaced it while we listed: start over
            else:
                raise CheckpointChangedError(f"{url}: newer saves replaced it {RETRIES} times while it was read; "
                                             "retry")
        except BaseException:
            self._space.close()
            raise
        self.manifest = manifest
        #: the objects read so far, in the order they were fetched (names within the save)
        self.fetched: list[str] = []

    @property
    def names(self) -> list[str]:
        """Every object of the save (names within it, as the checkpoint's manifest names its files), sorted."""
        return sorted(self.manifest["objects"])

    def _replaced(self, manifest: dict[str, Any]) -> bool:
        newer = committed_manifest(self.store, self.url)
        return newer is not None and newer["save_id"] != manifest["save_id"]

    def _open(self, manifest: dict[str, Any]) -> Path:
        store, url = self.store, self.url
        base = f"{url.prefix}/{manifest['save_id']}"
        objects: dict[str, dict[str, Any]] = manifest["objects"]
        stored = {key[len(base) + 1:]: size for key, size in store.list(base)}
        problems = []
        for name, entry in sorted(objects.items()):
            if name not in stored:
                problems.append(f"{store.url(f'{base}/{name}')}: missing (the manifest lists {entry['bytes']} bytes)")
            elif stored[name] != entry["bytes"]:
                problems.append(f"{store.url(f'{base}/{name}')}: {stored[name]} bytes stored, {entry['bytes']} "
                                "recorded")
        problems += [f"{store.url(f'{base}/{name}')}: not in the manifest" for name in sorted(set(stored) - set(objects))]
        recorded = manifest["manifest"].get("files")
        for name, entry in sorted(objects.items()):  # the whole-object sums stand for the local manifest's file sums
            file = recorded.get(name) if isinstance(recorded, dict) else None
            if isinstance(file, dict) and "crc32c" in file and file["crc32c"] != entry["crc32c"]:
                problems.append(f"{store.url(f'{base}/{name}')}: the manifest object records crc32c {entry['crc32c']}, "
                                f"its checkpoint manifest {file['crc32c']}")
        if problems:
            raise IntegrityError("; ".join(problems))
        folder = self._space.folder(str(url))
        self._space.reserve(sum(e["bytes"] for e in objects.values()), str(url))  # the manifest goes where all would
        self._space.write(folder, MANIFEST, json.dumps(manifest["manifest"]).encode())
        return folder

    def fetch(self, names: Any) -> None:
        """Read the objects ``names`` (names within the save; those already read are skipped) into :attr:`folder`.

        Raises:
            KeyError: a name the manifest does not list.
            IntegrityError: bytes read with another crc32c than recorded (names the object and the damaged
                tensor); the object stays out of :attr:`folder`.
            CheckpointChangedError: an object is gone because a newer save replaced the checkpoint.
            OSError: the store failed after the bounded retries (names the object).
        """
        objects: dict[str, dict[str, Any]] = self.manifest["objects"]
        todo = sorted(set(names) - set(self.fetched))
        for name in todo:
            if name not in objects:
                raise KeyError(f"{self.url}: {name!r} is not an object of the committed save {self.manifest['save_id']}")
        if not todo:
            return
        base = f"{self.url.prefix}/{self.manifest['save_id']}"
        self._space.reserve(sum(objects[n]["bytes"] for n in todo), str(self.url))
        targets = [self._space.target(self.folder, n) for n in todo]
        try:
            crcs = self.store.download_files([(f"{base}/{n}", t, objects[n]["bytes"]) for n, t in zip(todo, targets)])
        except FileNotFoundError as exc:
            for n in todo:
                self._space.forget(self.folder, n)
            if self._replaced(self.manifest):
                raise CheckpointChangedError(f"{self.url}: a newer save replaced it while it was read ({exc})") from None
            raise IntegrityError(f"{exc} (listed in the manifest of {self.url})") from None
        except BaseException:
            for n in todo:
                self._space.forget(self.folder, n)
            raise
        bad = [n for n, crc in zip(todo, crcs) if crc_hex(crc) != objects[n]["crc32c"]]
        if bad:
            try:
                _raise_damaged(self.store, base, self.folder, bad, objects, dict(zip(todo, crcs)))
            finally:
                for n in todo:
                    self._space.forget(self.folder, n)
        self.fetched += todo

    def close(self) -> None:
        """Release the memory (and the folder of links) of every fetched object."""
        self._space.close()


def as_fetched(text: str, local: str, url: str) -> str:
    """A message about the fetched copy at ``local``, made about ``url``: the copy's path becomes the URL and "on
    disk" (the copy's bytes came from the store) becomes "in the store"; text that names no ``local`` is kept."""
    if local not in text:
        return text
    return text.replace(local, url).replace(" on disk", " in the store")


def _raise_damaged(store: Any, base: str, folder: Path, bad: list[str], objects: dict[str, Any],
                   crcs: dict[str, int]) -> None:
    report = check_checkpoint(folder, only=bad)
    lines = [f"{store.url(f'{base}/{n}')}: crc32c {crc_hex(crcs[n])} read, {objects[n]['crc32c']} recorded"
             for n in bad]
    detail = as_fetched(report.message(), str(folder), store.url(base))
    raise IntegrityError("; ".join(lines) + (f" ({detail})" if not report.ok else ""))

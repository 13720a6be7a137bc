"""A checkpoint under an object-store prefix, committed without rename.

Layout of ``s3://bucket/P`` (every object of a save under its prefix)::

    P/manifests/0000000003.json          the commit: written last, by a conditional create (If-None-Match: *)
    P/save-0000000003-1a2b3c4d/...       the files of that save (model.safetensors, optimizer/..., ...)

A save uploads every file under a new save-id prefix, then creates ``manifests/{n}.json`` with ``n`` one above the
newest committed manifest. The safetensors files go straight from the tensors' memory (:func:`save_plan_objects`:
the Rust store serializes each part of a multipart upload into its request body once it may be sent, so at most
``concurrency`` parts of ``part_size`` bytes are in memory; crc32c and the content hashes are summed as the bytes
go out); the small files are single puts. A plan whose tensors are not all in CPU memory, and the other callers
that hand a local folder (:func:`save_object_checkpoint`, tiered saves), upload files (parallel multipart uploads
from the mapped files, crc32c summed as the bytes go out and compared with what the writer recorded). Two savers that race for ``n`` cannot both win: the loser gets
:class:`~fastckpt.errors.ConcurrentSaveError` and its objects are removed. Only after the commit are the older
manifests deleted (manifest first, then their objects) with leftovers of saves that died (their multipart uploads
aborted through the ``.fastckpt-upload`` markers), so nothing committed is lost by a failed save.

A load takes the newest manifest, lists the save's prefix and refuses a missing object, one of another size or an
object the manifest does not list (:class:`~fastckpt.errors.IntegrityError` naming it); it reads every object
into an in-memory file of its own by ranged parallel reads (nothing is written to local disk), checks each crc32c
as the bytes come in (a mismatch names the object and the tensor), and hands a folder of links to those files to
the local loader, which reads fresh memory first and applies after, as for a local folder.

May import: layers 0-1 and other ``_io`` modules.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._format.tensors import tensor_sources
from fastckpt._io.files import SavePlan
from fastckpt._io.integrity import digest_entry, text_entry
from fastckpt._io.layout import MANIFEST, manifest_dict
from fastckpt._io.log import logger
from fastckpt._io.object_store import ObjectUrl
from fastckpt.errors import CheckpointChangedError, ConcurrentSaveError, HeaderError, IntegrityError, MissingStateError

__all__ = ["MANIFESTS", "FORMAT", "MARKER", "save_object_checkpoint", "save_plan_objects", "upload_folder", "new_save",
           "upload_objects", "upload_tensor_objects", "upload_texts", "upload_plan", "commit_save", "remove_save",
           "fetched_checkpoint", "RemoteCheckpoint", "committed_manifest", "delete_checkpoint"]

MANIFESTS = "manifests"
FORMAT = "fastckpt-object/1"
MARKER = ".fastckpt-upload"  # fastckpt_store::transfer::UPLOAD_MARKER
_RETRIES = 5


def _crc_hex(crc: int) -> str:
    return f"{crc:08x}"


def manifest_numbers(store: Any, url: ObjectUrl) -> list[int]:
    """The numbers of the committed manifests of the checkpoint at ``url``, ascending."""
    found = []
    for key, _size in store.list(f"{url.prefix}/{MANIFESTS}"):
        name = key.rsplit("/", 1)[-1]
        if name.endswith(".json") and name[:-5].isdigit():
            found.append(int(name[:-5]))
    return sorted(found)


def committed_manifest(store: Any, url: ObjectUrl) -> dict[str, Any] | None:
    """The newest committed manifest of the checkpoint at ``url`` (parsed), or None when none is committed.

    Raises:
        HeaderError: the manifest is not the JSON object fastckpt writes (names it).
    """
    for _ in range(_RETRIES):
        numbers = manifest_numbers(store, url)
        if not numbers:
            return None
        key = f"{url.prefix}/{MANIFESTS}/{numbers[-1]:010d}.json"
        data = store.get(key)
        if data is not None:
            manifest = _parse_manifest(store.url(key), data)
            if manifest.get("number") != numbers[-1]:
                raise HeaderError(f"{store.url(key)}: records number {manifest.get('number')!r}, its name says "
                                  f"{numbers[-1]} (a manifest copied or edited by hand is not a commit)")
            return manifest
    raise CheckpointChangedError(f"{url}: its manifests changed {_RETRIES} times while being read; retry")


def _parse_manifest(where: str, data: bytes) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise HeaderError(f"{where}: not a JSON manifest: {exc}") from None
    ok = (isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(manifest.get("save_id"), str)
          and isinstance(manifest.get("objects"), dict) and isinstance(manifest.get("manifest"), dict)
          and manifest["save_id"].startswith("save-") and "/" not in manifest["save_id"])
    if ok:
        for name, entry in manifest["objects"].items():
            ok = ok and isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and entry["bytes"] >= 0 \
                and isinstance(entry.get("crc32c"), str) and ".." not in name.split("/") and not name.startswith("/")
    if not ok:
        raise HeaderError(f"{where}: not a fastckpt object-store manifest (format {FORMAT!r} with save_id, objects "
                          "{name: {bytes, crc32c}} and the checkpoint's manifest)")
    return manifest


def _local_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def new_save(store: Any, url: ObjectUrl) -> tuple[int, str]:
    """``(number, save_id)`` for a new save of the checkpoint at ``url``: one above the newest committed manifest,
    and a fresh ``save-{number}-{random}`` prefix for its objects."""
    numbers = manifest_numbers(store, url)
    number = numbers[-1] + 1 if numbers else 0
    return number, f"save-{number:010d}-{uuid.uuid4().hex[:8]}"


def commit_save(store: Any, url: ObjectUrl, number: int, save_id: str, objects: dict[str, Any],
                local_manifest: dict[str, Any]) -> None:
    """Commit save ``save_id`` (its ``objects`` already uploaded): create ``manifests/{number}.json`` with a
    conditional put, then remove what it supersedes (:func:`collect_garbage`).

    Raises:
        ConcurrentSaveError: another save committed that manifest first (this save's objects are removed).
        OSError: the store failed (this save's objects are removed; nothing is committed).
    """
    body = json.dumps({"format": FORMAT, "save_id": save_id, "number": number, "objects": objects,
                       "manifest": local_manifest}, indent=1, sort_keys=True).encode()
    key = f"{url.prefix}/{MANIFESTS}/{number:010d}.json"
    try:
        store.put(key, body, create_only=True)
    except FileExistsError:
        theirs = store.get(key)
        if theirs is None or json.loads(theirs).get("save_id") != save_id:  # not our own retried put
            _remove_quietly(store, url, save_id)
            raise ConcurrentSaveError(f"{store.url(key)}: another save committed {url} first (manifest {number}); "
                                      "this save's objects were removed and the other save's state is the "
                                      "committed one") from None
    except BaseException as exc:
        try:  # the put may have landed before the connection failed: the store says whether it is ours
            theirs = store.get(key)
        except Exception:  # unknown: leave our objects (a committed manifest may name them); the next save tidies up
            raise exc from None
        if theirs is None or json.loads(theirs).get("save_id") != save_id:
            _remove_quietly(store, url, save_id)
            raise
    collect_garbage(store, url, number, save_id)


def upload_objects(store: Any, url: ObjectUrl, save_id: str, folder: Path, names: list[str],
                   local_manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Upload ``folder/name`` for each of ``names`` to ``{url}/{save_id}/name``; ``{name: {bytes, crc32c}}``.

    Raises:
        IntegrityError: an uploaded file's size or crc32c is not what ``local_manifest`` records for it.
        OSError: the store failed after the bounded retries (names the object); this save's objects are removed.
    """
    keys = [f"{url.prefix}/{save_id}/{name}" for name in names]
    try:
        uploaded = store.upload_files([(str(folder / name), key) for name, key in zip(names, keys)])
    except BaseException:
        _remove_quietly(store, url, save_id)
        raise
    objects = {name: {"bytes": size, "crc32c": _crc_hex(crc)} for name, (size, crc) in zip(names, uploaded)}
    if local_manifest is not None:
        _check_against_writer(store, keys, names, objects, local_manifest)
    return objects


def upload_tensor_objects(store: Any, url: ObjectUrl, save_id: str, jobs: list[tuple[str, list[Any], Any]], *,
                          threads: int = 0) -> list[tuple]:
    """Upload each ``(name, tensor sources, metadata)`` as the safetensors object ``{url}/{save_id}/name``, straight
    from the tensors' memory (``_core.ObjectStore.upload_tensors``). The tensors must not change until it returns.

    Returns:
        Each object's digest, as ``_core.write_files_checked`` returns it for a file: ``(bytes, crc32c,
        [(tensor, crc32c)], [(tensor, xxh3-128 hex)])`` (see :func:`fastckpt._io.integrity.digest_entry`).

    Raises:
        ValueError / DtypeError: a source the writer refuses (names the object and the tensor); nothing is sent.
        OSError: the store failed after the bounded retries (names the object); this save's objects are removed.
    """
    keys = [f"{url.prefix}/{save_id}/{name}" for name, _sources, _meta in jobs]
    try:
        digests = store.upload_tensors([(key, sources, meta) for key, (_n, sources, meta) in zip(keys, jobs)],
                                       threads=threads)
    except BaseException:
        _remove_quietly(store, url, save_id)
        raise
    return digests


def upload_texts(store: Any, url: ObjectUrl, save_id: str, texts: dict[str, bytes]) -> dict[str, Any]:
    """Put each small file ``{name: data}`` at ``{url}/{save_id}/name``; ``{name: {bytes, crc32c}}``.

    Raises:
        OSError: the store failed after the bounded retries (names the object); this save's objects are removed.
    """
    try:
        for name, data in texts.items():
            store.put(f"{url.prefix}/{save_id}/{name}", data)
    except BaseException:
        _remove_quietly(store, url, save_id)
        raise
    return {name: {"bytes": len(data), "crc32c": _crc_hex(_core.crc32c(data))} for name, data in texts.items()}


def save_plan_objects(store: Any, url: ObjectUrl, plan: SavePlan, *, threads: int = 0,
                      before_commit: Callable[[], Any] | None = None) -> None:
    """Save ``plan`` (its tensors all in CPU memory) to ``url`` without a local copy: every safetensors file
    uploaded straight from the tensors (:func:`upload_tensor_objects`), the small files put, then the manifest
    object created last, holding the same manifest a local save of the plan writes.

    Args:
        before_commit: called once every object is uploaded, right before the manifest is created (an async
            save's cancel check); what it raises commits nothing (this save's objects are removed).

    Raises:
        ConcurrentSaveError, OSError: see :func:`save_object_checkpoint`; nothing is committed and the previous
            checkpoint at ``url`` is untouched. ValueError / DtypeError: a tensor the writer refuses (named).
    """
    number, save_id = new_save(store, url)
    objects, manifest = upload_plan(store, url, save_id, plan, threads=threads)
    if before_commit is not None:
        try:
            before_commit()
        except BaseException:
            _remove_quietly(store, url, save_id)
            raise
    commit_save(store, url, number, save_id, objects, manifest)


def upload_plan(store: Any, url: ObjectUrl, save_id: str, plan: SavePlan, *, threads: int = 0,
                counts: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Upload ``plan``'s files (tensors in CPU memory) under ``{url}/{save_id}/``: the safetensors files straight
    from the tensors (:func:`upload_tensor_objects`), the small files put.

    Returns:
        ``(objects, manifest)``: ``{name: {bytes, crc32c}}`` of what was uploaded, and the checkpoint manifest a
        local save of the plan writes (``counts`` added to the plan's: a sharded save's ``"sharded"`` entry).

    Raises:
        ValueError / DtypeError: a tensor the writer refuses (named). OSError: the store failed after the bounded
            retries (names the object); this save's objects are removed.
    """
    if plan.links:  # pragma: no cover - share_unchanged is refused for s3:// before a plan is built
        raise ValueError("a plan with hard links (share_unchanged) cannot be saved to object storage")
    jobs = [(p.name, tensor_sources(p.tensors, p.dtype), p.metadata) for p in plan.parts]
    digests = upload_tensor_objects(store, url, save_id, jobs, threads=threads)
    objects = {p.name: {"bytes": d[0], "crc32c": _crc_hex(d[1])} for p, d in zip(plan.parts, digests)}
    entries = {p.name: {"bytes": d[0], **digest_entry(d)} for p, d in zip(plan.parts, digests)}
    texts = {name: text if isinstance(text, bytes) else text.encode("utf-8") for name, text in plan.texts.items()}
    objects.update(upload_texts(store, url, save_id, texts))
    entries.update({name: {"bytes": len(data), **text_entry(data)} for name, data in texts.items()})
    files = {name: entry["bytes"] for name, entry in entries.items()}
    checksums = {name: {k: v for k, v in entry.items() if k != "bytes"} for name, entry in entries.items()}
    manifest = manifest_dict(plan.mode, files, {**plan.counts, **(counts or {})}, plan.step, checksums=checksums)
    return objects, manifest


def save_object_checkpoint(store: Any, url: ObjectUrl, write: Callable[[Path], None]) -> None:
    """Save the checkpoint that ``write(local_folder)`` writes to ``url``, committed by its manifest object.

    Raises:
        ConcurrentSaveError: another save committed the same manifest number first (its state is the committed one;
            this save's objects were removed).
        IntegrityError: a file changed on local disk between being written and uploaded.
        OSError: the store failed after the bounded retries (names the object); nothing is committed and the
            previous checkpoint is untouched.
    """
    with tempfile.TemporaryDirectory(prefix="fastckpt-s3-") as tmp:
        folder = Path(tmp) / "checkpoint"
        write(folder)
        upload_folder(store, url, folder)


def upload_folder(store: Any, url: ObjectUrl, folder: Path) -> None:
    """Upload the committed local checkpoint ``folder`` (its files and manifest) to ``url`` and commit it there.

    Raises:
        ConcurrentSaveError, IntegrityError, OSError: see :func:`save_object_checkpoint`; nothing is committed and
            the previous checkpoint at ``url`` is untouched.
    """
    local_manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    number, save_id = new_save(store, url)
    objects = upload_objects(store, url, save_id, folder, _local_files(folder), local_manifest)
    commit_save(store, url, number, save_id, objects, local_manifest)


def _check_against_writer(store: Any, keys: list[str], names: list[str], objects: dict[str, Any],
                          local_manifest: dict[str, Any]) -> None:
    recorded = local_manifest.get("files", {})
    for key, name in zip(keys, names):
        entry = recorded.get(name)
        if isinstance(entry, dict) and "crc32c" in entry and (entry["crc32c"], entry.get("bytes")) != (
                objects[name]["crc32c"], objects[name]["bytes"]):
            raise IntegrityError(f"{store.url(key)}: uploaded {objects[name]['bytes']} bytes with crc32c "
                                 f"{objects[name]['crc32c']}, the writer recorded {entry.get('bytes')} bytes with "
                                 f"crc32c {entry['crc32c']} (the local file changed before it was uploaded)")


def _save_number(save_id: str) -> int | None:
    parts = save_id.split("-")
    return int(parts[1]) if len(parts) == 3 and parts[0] == "save" and parts[1].isdigit() else None


def _delete_objects(store: Any, keys: list[str]) -> None:
    """Abort the multipart uploads the markers among ``keys`` name, then delete every key (markers last)."""
    markers = [k for k in keys if k.endswith(MARKER)]
    for marker in markers:
        upload_id = store.get(marker)
        if upload_id is not None:
            store.abort_upload(marker[: -len(MARKER)], upload_id.decode())
    store.delete([k for k in keys if not k.endswith(MARKER)] + markers)


def remove_save(store: Any, url: ObjectUrl, save_id: str) -> None:
    """Best effort: delete every object of the uncommitted save ``save_id`` (what is left, e.g. an upload still
    running on another process, goes with the next committed save's :func:`collect_garbage`)."""
    _remove_quietly(store, url, save_id)


def _remove_quietly(store: Any, url: ObjectUrl, save_id: str) -> None:
    with contextlib.suppress(Exception):  # best effort: the next committed save removes what is left
        _delete_objects(store, [k for k, _ in store.list(f"{url.prefix}/{save_id}")])


def collect_garbage(store: Any, url: ObjectUrl, number: int, save_id: str) -> None:
    """After manifest ``number`` (save ``save_id``) committed: delete the older manifests, then the objects of
    every other save numbered ``number`` or below (superseded, lost a race, or died: their uploads are aborted).
    Saves numbered above ``number`` may still be running and are left alone."""
    older = [f"{url.prefix}/{MANIFESTS}/{n:010d}.json" for n in manifest_numbers(store, url) if n < number]
    store.delete(older)
    stale = []
    for key, _size in store.list(url.prefix):
        rest = key[len(url.prefix) + 1:]
        head = rest.split("/", 1)[0]
        if head == MANIFESTS or head == save_id:
            continue
        n = _save_number(head)
        if n is not None and n <= number:
            stale.append(key)
    _delete_objects(store, stale)


def delete_checkpoint(store: Any, url: ObjectUrl) -> None:
    """Delete the checkpoint at ``url``: its manifests first (it stops counting at once), then every object."""
    store.delete([f"{url.prefix}/{MANIFESTS}/{n:010d}.json" for n in manifest_numbers(store, url)])
    _delete_objects(store, [k for k, _ in store.list(url.prefix)])


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
    for _attempt in range(_RETRIES):
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
        raise CheckpointChangedError(f"{url}: newer saves replaced it {_RETRIES} times while it was read; retry")
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
            for _attempt in range(_RETRIES):
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
                raise CheckpointChangedError(f"{url}: newer saves replaced it {_RETRIES} times while it was read; "
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
        bad = [n for n, crc in zip(todo, crcs) if _crc_hex(crc) != objects[n]["crc32c"]]
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
    from fastckpt._io.integrity import check_checkpoint

    report = check_checkpoint(folder, only=bad)
    lines = [f"{store.url(f'{base}/{n}')}: crc32c {_crc_hex(crcs[n])} read, {objects[n]['crc32c']} recorded"
             for n in bad]
    detail = as_fetched(report.message(), str(folder), store.url(base))
    raise IntegrityError("; ".join(lines) + (f" ({detail})" if not report.ok else ""))

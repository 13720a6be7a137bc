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

A load reads a committed save back into memory: :mod:`fastckpt._io.storage.object.fetch`.

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._format.json_input import load_json
from fastckpt._format.tensors import tensor_sources
from fastckpt._io.files import SavePlan
from fastckpt._io.storage.local.integrity import digest_entry, text_entry
from fastckpt._io.storage.local.layout import MANIFEST, manifest_dict
from fastckpt._io.storage.object.store import ObjectUrl
from fastckpt.errors import CheckpointChangedError, ConcurrentSaveError, HeaderError, IntegrityError

__all__ = ["MANIFESTS", "FORMAT", "MARKER", "save_object_checkpoint", "save_plan_objects", "upload_folder", "new_save",
           "upload_objects", "upload_tensor_objects", "upload_texts", "upload_plan", "commit_save", "remove_save",
           "committed_manifest", "delete_checkpoint"]

MANIFESTS = "manifests"
FORMAT = "fastckpt-object/1"
MARKER = ".fastckpt-upload"  # fastckpt_store::transfer::UPLOAD_MARKER
RETRIES = 5


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
    for _ in range(RETRIES):
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
    raise CheckpointChangedError(f"{url}: its manifests changed {RETRIES} times while being read; retry")


def _parse_manifest(where: str, data: bytes) -> dict[str, Any]:
    try:
        manifest = load_json(data, "fastckpt.json", object)
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
        [(tensor, crc32c)], [(tensor, xxh3-128 hex)])`` (see :func:`fastckpt._io.storage.local.integrity.digest_entry`).

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
    local_manifest = load_json((folder / MANIFEST).read_text(encoding="utf-8"), f"{folder / MANIFEST}", object)
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

"""Files shared with the previous checkpoint: a shard whose tensors are all unchanged is hard-linked, not written.

``save_state(..., share_unchanged=True)`` puts the frozen tensors of each model in shard files of their own
(:mod:`fastckpt._plan.share` decides which). :func:`share_with` then compares every such shard with the files of
the previous committed checkpoint of the project: a previous file with exactly the same tensors (names, dtypes,
shapes, metadata, and the same xxh3-128 content hash per tensor, as its manifest recorded them when it was
written) holds the same bytes, so the shard becomes a :class:`LinkedFile`: at commit time
(:func:`link_into`) the previous file is hard-linked into the staging folder and its manifest entry copied.

Why this is safe:

- A hard link is a second name for the same inode: removing the checkpoint that first wrote the file (rotation
  with ``total_limit``, or by hand) leaves the data alive for as long as any checkpoint names it.
- Links are made inside the staging folder, before the manifest; the folder is committed in one rename. A crash
  at any point leaves either the previous state or a complete checkpoint whose files are all real links; a
  checkpoint never points to files elsewhere.
- If the previous file vanished (rotated by another process) or cannot be linked (another file system), or its
  size is not the recorded one, the shard is written instead, as it would have been without sharing.

The manifest records ``"shared": {file: "<previous folder name>/<file>"}`` for the files linked.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._format.dtypes import to_safetensors_dtype
from fastckpt._format.json_input import load_json
from fastckpt._format.tensors import convert_target
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.storage.local.layout import MANIFEST

__all__ = ["LinkedFile", "share_with", "link_into"]


@dataclass
class LinkedFile:
    """A shard that equals ``source`` (a file of the previous checkpoint) and is linked, not written.

    ``part`` is kept so the shard can still be written if the link cannot be made; ``entry`` is the source's
    manifest entry (bytes, crc32c, per-tensor crc32c and xxh3).
    """

    part: FilePart
    source: Path
    entry: dict[str, Any]


def _previous_manifest(previous: Path) -> dict[str, Any] | None:
    try:
        manifest = load_json((previous / MANIFEST).read_text(encoding="utf-8"), f"{previous / MANIFEST}", object)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def _read_header(path: Path) -> dict[str, Any] | None:
    """The JSON header of a safetensors file (only its first bytes are read), or None if it is not one."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
            if not 2 <= n <= _core.MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    return header if isinstance(header, dict) else None


def _header_matches(path: Path, part: FilePart) -> bool:
    """Whether the safetensors file at ``path`` has ``part``'s tensors (name, dtype, shape) and metadata. Only the
    header is read; the bytes are known equal from the content hashes recorded when the file was written."""
    header = _read_header(path)
    if header is None:
        return False
    metadata = header.pop("__metadata__", None)
    try:
        stored = {name: (info["dtype"], list(info["shape"])) for name, info in header.items()}
    except (KeyError, TypeError):
        return False
    want = {}
    for name, t in part.tensors.items():
        dtype = to_safetensors_dtype(t.dtype, name=name)
        want[name] = (convert_target(name, dtype, part.dtype) or dtype, list(t.shape))
    return stored == want and metadata == (None if part.metadata is None else dict(part.metadata))


def share_with(plan: SavePlan, previous: Path | None, candidates: dict[str, dict[str, str]]) -> list[str]:
    """Turn the parts named in ``candidates`` that equal a file of ``previous`` into :class:`LinkedFile`s.

    Args:
        plan: the plan; matching parts move from ``plan.parts`` to ``plan.links``.
        previous: the previous committed checkpoint folder (None: nothing is shared).
        candidates: ``{part name: {tensor name: xxh3 of the tensor as it will be stored}}`` for the shards of
            frozen tensors.

    Returns:
        The names of the parts that will be linked.
    """
    if previous is None or not candidates:
        return []
    manifest = _previous_manifest(previous)
    if manifest is None:
        return []
    by_tensors = {frozenset(info["xxh3"]): (name, info) for name, info in manifest["files"].items()
                  if isinstance(info, dict) and isinstance(info.get("xxh3"), dict)}
    linked = []
    keep = []
    for part in plan.parts:
        hashes = candidates.get(part.name)
        found = by_tensors.get(frozenset(hashes)) if hashes else None
        if found is not None and found[1]["xxh3"] == hashes and _header_matches(previous / found[0], part):
            plan.links[part.name] = LinkedFile(part, previous / found[0], dict(found[1]))
            linked.append(part.name)
        else:
            keep.append(part)
    plan.parts = keep
    if linked:
        plan.counts["shared"] = {name: f"{previous.name}/{plan.links[name].source.name}" for name in linked}
    return linked


def _link(source: Path, dest: Path) -> None:
    os.link(source, dest)


def link_into(plan: SavePlan, staging: Path, files: dict[str, int], checksums: dict[str, dict[str, Any]],
              *, write: Any) -> None:
    """Hard-link every :class:`LinkedFile` of ``plan`` into ``staging`` and record its size and checksums;
    a link that cannot be made (source gone, another file system, wrong size) is written with ``write(part)``
    instead, which returns ``(size, checksum fields)``."""
    shared = plan.counts.get("shared", {})
    for name, linked in plan.links.items():
        dest = staging / name
        try:
            _link(linked.source, dest)
            if dest.stat().st_size != linked.entry.get("bytes"):
                raise FileNotFoundError(errno.ENOENT, "changed since it was recorded", str(linked.source))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            dest.unlink(missing_ok=True)
            files[name], checksums[name] = write(linked.part)
            shared.pop(name, None)
            continue
        files[name] = linked.entry["bytes"]
        checksums[name] = {k: v for k, v in linked.entry.items() if k != "bytes"}
    if not shared:
        plan.counts.pop("shared", None)

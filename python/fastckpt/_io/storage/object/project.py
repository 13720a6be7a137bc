"""Automatic naming and rotation under an object-store project prefix, as locally (:mod:`fastckpt._io.storage.local.layout`):
``{project}/checkpoints/checkpoint_{n}`` for full saves, ``{project}/model_only/checkpoint_{n}`` for model-only
snapshots. Only checkpoints with a committed manifest count; "latest" and the next number are decided by them,
and rotation deletes a checkpoint (manifest first, then its objects) only after the newer one committed.

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

import re
from typing import Any

from fastckpt._io.storage.local.layout import CHECKPOINTS_DIR, MODEL_ONLY_DIR
from fastckpt._io.storage.object.commit import committed_manifest, delete_checkpoint, manifest_numbers
from fastckpt._io.storage.object.store import ObjectUrl

__all__ = ["object_checkpoints", "object_checkpoint_numbers", "latest_object_checkpoint", "next_object_checkpoint",
           "rotate_object_checkpoints"]

_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")


def _kind_root(project: ObjectUrl, model_only: bool) -> ObjectUrl:
    return project.child(MODEL_ONLY_DIR if model_only else CHECKPOINTS_DIR)


def object_checkpoint_numbers(store: Any, project: ObjectUrl, *, model_only: bool = False,
                              full_only: bool = False) -> dict[int, ObjectUrl]:
    """``{n: url}`` of the committed ``checkpoint_n`` of one kind (``full_only``: saved in full)."""
    root = _kind_root(project, model_only)
    found: dict[int, ObjectUrl] = {}
    for key in store.list_dirs(root.prefix):
        m = _CHECKPOINT_RE.match(key.rstrip("/").rsplit("/", 1)[-1])
        if not m:
            continue
        url = root.child(m.group(0))
        if not manifest_numbers(store, url):
            continue
        if full_only:
            manifest = committed_manifest(store, url)
            if manifest is None or manifest["manifest"].get("mode") == "model_only":
                continue
        found[int(m.group(1))] = url
    return found


def object_checkpoints(store: Any, project: ObjectUrl, *, model_only: bool = False,
                       full_only: bool = False) -> dict[int, tuple[ObjectUrl, dict[str, Any]]]:
    """``{n: (url, its committed manifest record)}`` of the committed ``checkpoint_n`` of one kind (``full_only``:
    saved in full): each checkpoint's manifest read once (what ``Storage.list`` reports: step and mode)."""
    root = _kind_root(project, model_only)
    found: dict[int, tuple[ObjectUrl, dict[str, Any]]] = {}
    for key in store.list_dirs(root.prefix):
        m = _CHECKPOINT_RE.match(key.rstrip("/").rsplit("/", 1)[-1])
        if not m:
            continue
        url = root.child(m.group(0))
        manifest = committed_manifest(store, url)
        if manifest is None or (full_only and manifest["manifest"].get("mode") == "model_only"):
            continue
        found[int(m.group(1))] = (url, manifest)
    return found


def latest_object_checkpoint(store: Any, project: ObjectUrl, *, model_only: bool = False) -> ObjectUrl | None:
    """The newest committed checkpoint (full saves; with ``model_only`` the model-only snapshots), or None."""
    numbers = object_checkpoint_numbers(store, project, model_only=model_only, full_only=not model_only)
    return numbers[max(numbers)] if numbers else None


def next_object_checkpoint(store: Any, project: ObjectUrl, *, model_only: bool = False) -> ObjectUrl:
    """``checkpoint_{n}`` with n one above the largest committed number (0 when none)."""
    numbers = object_checkpoint_numbers(store, project, model_only=model_only)
    return _kind_root(project, model_only).child(f"checkpoint_{max(numbers) + 1 if numbers else 0}")


def rotate_object_checkpoints(store: Any, project: ObjectUrl, total_limit: int, *,
                              model_only: bool = False) -> list[ObjectUrl]:
    """Delete the oldest committed checkpoints of one kind so that ``total_limit`` remain; returns their URLs."""
    if total_limit < 1:
        raise ValueError(f"total_limit must be >= 1, got {total_limit}")
    numbers = object_checkpoint_numbers(store, project, model_only=model_only, full_only=not model_only)
    removed = []
    for n in sorted(numbers)[: max(0, len(numbers) - total_limit)]:
        delete_checkpoint(store, numbers[n])
        removed.append(numbers[n])
    return removed

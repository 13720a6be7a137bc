"""Automatic naming and rotation of the checkpoints under a project folder (``checkpoints/checkpoint_{n}``,
``model_only/checkpoint_{n}``; see :mod:`fastckpt._io.storage.local.layout` for what a folder holds).

Numbers count only committed folders (:func:`~fastckpt._io.storage.local.layout.is_committed`); rotation renames a
folder to an owned trash name first (:mod:`fastckpt._io.storage.local.staging`), so it stops counting at once.

May import: layers 0-1, the shared ``_io`` modules and the other modules of this package.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from fastckpt._format.json_input import load_json
from fastckpt._io.location import check_location
from fastckpt._io.storage.local.layout import CHECKPOINTS_DIR, MANIFEST, MODEL_ONLY_DIR, is_committed
from fastckpt._io.storage.local.staging import OwnedPath

__all__ = [
    "saved_mode", "checkpoint_numbers", "latest_checkpoint", "next_checkpoint_dir", "keep_from_rotation",
    "release_from_rotation", "rotate_checkpoints", "remove_folders", "remove_checkpoint_dir",
]

_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")


def saved_mode(folder: Path) -> str:
    """``"full"`` or ``"model_only"``: the manifest's mode of a committed folder (stock accelerate: ``"full"``)."""
    try:
        data = load_json((folder / MANIFEST).read_text(encoding="utf-8"), f"{folder / MANIFEST}", object)
    except (OSError, ValueError):
        return "full"
    return "model_only" if isinstance(data, dict) and data.get("mode") == "model_only" else "full"


def checkpoint_numbers(project_dir: Path, *, model_only: bool = False, full_only: bool = False) -> dict[int, Path]:
    """Committed automatic checkpoints: ``{n: folder}`` (see :func:`is_committed`).

    ``model_only``: the model-only snapshots under ``project_dir/model_only``; otherwise the checkpoints under
    ``project_dir/checkpoints`` (``full_only``: only those saved in full, the ones a full load can resume from).
    """
    root = project_dir / (MODEL_ONLY_DIR if model_only else CHECKPOINTS_DIR)
    found: dict[int, Path] = {}
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        m = _CHECKPOINT_RE.match(entry.name)
        if m and entry.is_dir() and is_committed(entry) and not (full_only and saved_mode(entry) == "model_only"):
            found[int(m.group(1))] = entry
    return found


def latest_checkpoint(project_dir: str | os.PathLike[str] | None = None, *, model_only: bool = False) -> Path | None:
    """The newest committed checkpoint (largest number, numeric order), or None.

    ``project_dir`` defaults to the current directory. Without ``model_only``: the newest *full* checkpoint in
    ``{project_dir}/checkpoints`` (what a full ``load_state(input_dir=None)`` resumes from); with it: the newest
    model-only snapshot in ``{project_dir}/model_only``. Unfinished saves are never chosen; stock accelerate
    checkpoints count (see :func:`is_committed`).
    """
    check_location(project_dir, "project_dir")
    root = Path(project_dir if project_dir is not None else os.getcwd())
    numbers = checkpoint_numbers(root, model_only=model_only, full_only=not model_only)
    return numbers[max(numbers)] if numbers else None


def next_checkpoint_dir(project_dir: Path, *, model_only: bool = False) -> Path:
    """``checkpoints/checkpoint_{n}`` (``model_only/checkpoint_{n}`` for a model-only save) with n one above the
    largest *committed* number in that folder (0 when none).

    A folder left by an unfinished save (no manifest) does not count; if it sits at ``n`` it is replaced whole
    when the new checkpoint is committed.
    """
    numbers = checkpoint_numbers(project_dir, model_only=model_only)
    root = project_dir / (MODEL_ONLY_DIR if model_only else CHECKPOINTS_DIR)
    return root / f"checkpoint_{max(numbers) + 1 if numbers else 0}"


_kept: dict[Path, int] = {}  # absolute folder -> holders (tiered uploads reading it): rotation leaves it
_kept_lock = threading.Lock()


def keep_from_rotation(folder: Path) -> None:
    """Keep ``folder`` out of :func:`rotate_checkpoints` until :func:`release_from_rotation` (a tiered save's
    background upload reads it: a plain save's rotation meanwhile must not remove it)."""
    key = Path(folder).absolute()
    with _kept_lock:
        _kept[key] = _kept.get(key, 0) + 1


def release_from_rotation(folder: Path) -> None:
    """Undo one :func:`keep_from_rotation` of ``folder``; the next rotation may remove it again."""
    key = Path(folder).absolute()
    with _kept_lock:
        if _kept.get(key, 0) <= 1:
            _kept.pop(key, None)
        else:
            _kept[key] -= 1


def rotate_checkpoints(project_dir: Path, total_limit: int, *, model_only: bool = False) -> list[Path]:
    """Remove the oldest committed checkpoints of one kind (numeric order) so that ``total_limit`` remain; returns
    the removed folders. Full checkpoints (``checkpoints/``, model-only folders there are neither counted nor
    removed) and model-only snapshots (``model_only/``) are rotated apart.

    Each is first renamed to an owned trash name (:mod:`fastckpt._io.storage.local.staging`), so it stops counting at once and a
    removal cut short never leaves a half-deleted ``checkpoint_N`` behind; the next save clears such leftovers.
    A folder a tiered save is still uploading (:func:`keep_from_rotation`) is left for a later rotation, so until
    its upload ends one more than ``total_limit`` may remain.
    """
    if total_limit < 1:
        raise ValueError(f"total_limit must be >= 1, got {total_limit}")
    numbers = checkpoint_numbers(project_dir, model_only=model_only, full_only=not model_only)
    oldest = [numbers[n] for n in sorted(numbers)[: max(0, len(numbers) - total_limit)]]
    with _kept_lock:
        removed = [f for f in oldest if f.absolute() not in _kept]
    remove_folders(removed)
    return removed


def remove_folders(folders: list[Path]) -> None:
    """Remove checkpoint folders, each first renamed to an owned trash name (:mod:`fastckpt._io.storage.local.staging`), so it
    stops counting at once and a removal cut short never leaves a half-deleted checkpoint behind."""
    for folder in folders:
        with OwnedPath(folder.parent, folder.name, "trash") as trash:
            os.rename(folder, trash.path)


def remove_checkpoint_dir(folder: Path) -> None:
    """Remove the one checkpoint folder ``folder`` as :func:`remove_folders` does.

    Raises:
        FileNotFoundError: nothing is at ``folder``. OSError: it cannot be renamed (permissions).
    """
    remove_folders([folder])

"""Trainer's ``checkpoint-{global_step}`` folders in ``output_dir``: which are finished, the latest, the rotation.

A folder counts as a finished checkpoint when it holds fastckpt's manifest (``fastckpt.json``, written last and put
in place with the folder in one step, so a ``checkpoint-N`` from fastckpt is finished or absent), or, without it,
when it is a stock Trainer checkpoint: ``trainer_state.json`` present and none of the files only fastckpt writes
(the rule of :func:`fastckpt._io.storage.local.layout.checkpoint_layout`). Order is numeric (``checkpoint-10`` after
``checkpoint-9``), as ``transformers.trainer_utils.sort_checkpoints`` falls back to.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fastckpt._io.storage.local.layout import MANIFEST
from fastckpt._io.storage.local.numbering import remove_folders

__all__ = ["PREFIX", "TRAINER_STATE", "finished_checkpoints", "latest_checkpoint", "rotate", "is_fastckpt"]

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
_NUMBERED = re.compile(rf"^{PREFIX}-(\d+)$")
_FASTCKPT_ONLY = re.compile(r"^(random_states_\d+\.safetensors|optimizer(_\d+)?(-\d+-of-\d+)?\.safetensors"
                            r"(\.index\.json)?|scheduler(_\d+)?\.json)$")


def is_fastckpt(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` is a committed fastckpt checkpoint (holds the manifest)."""
    return (Path(folder) / MANIFEST).is_file()


def _finished(folder: Path) -> bool:
    if is_fastckpt(folder):
        return True
    return (folder / TRAINER_STATE).is_file() and not any(_FASTCKPT_ONLY.match(n) for n in os.listdir(folder))


def finished_checkpoints(run_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """``{global_step: folder}`` of the finished ``checkpoint-N`` folders in ``run_dir`` (none if it is absent)."""
    root = Path(run_dir)
    if not root.is_dir():
        return {}
    found = {}
    for entry in root.iterdir():
        m = _NUMBERED.match(entry.name)
        if m and entry.is_dir() and _finished(entry):
            found[int(m.group(1))] = entry
    return found


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The finished ``checkpoint-N`` with the largest N (what ``resume_from_checkpoint=True`` resumes), or None."""
    found = finished_checkpoints(run_dir)
    return found[max(found)] if found else None


def rotate(run_dir: str | os.PathLike[str], total_limit: int | None, best: str | None = None) -> list[Path]:
    """Remove the oldest finished checkpoints so that ``total_limit`` remain, as ``save_total_limit`` does: the
    newest and the best one (``best``, ``state.best_model_checkpoint``) are never removed, so with a best checkpoint
    and ``total_limit=1`` two remain. Returns the removed folders (each renamed away first, then removed).

    ``total_limit`` None or <= 0 keeps every checkpoint (Trainer's rule).
    """
    if total_limit is None or total_limit <= 0:
        return []
    found = finished_checkpoints(run_dir)
    if len(found) <= total_limit:
        return []
    order = [found[n] for n in sorted(found)]
    protected = {order[-1].resolve()}
    if best is not None and Path(best).resolve() in {p.resolve() for p in order}:
        protected.add(Path(best).resolve())
    keep = max(total_limit, len(protected))
    removed = []
    for folder in order:
        if len(order) - len(removed) <= keep:
            break
        if folder.resolve() not in protected:
            removed.append(folder)
    remove_folders(removed)
    return removed

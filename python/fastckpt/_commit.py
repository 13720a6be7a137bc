"""Writing a :class:`~fastckpt._save_plan.SavePlan` as one crash-safe checkpoint folder.

1. A staging folder ``.{name}.fastckpt-staging-{pid}-{random}`` is made beside the target.
2. The Rust core writes every safetensors file of the plan in one parallel pass (``_core.write_files``), then the
   JSON files are written; each file is fsynced when ``durable``.
3. The manifest ``fastckpt.json`` is written last; modes are copied from a checkpoint being replaced (case C13);
   files the user keeps in the target folder are hard-linked into the staging folder.
4. ``_core.commit_dir`` puts the staging folder in place in one step (rename, or ``RENAME_EXCHANGE`` over an older
   folder) and fsyncs the parent. On any error the staging folder is removed and the target is untouched.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

from . import _core
from ._layout import MANIFEST, manifest_dict
from ._save_plan import SavePlan
from ._tensors import tensor_sources

__all__ = ["write_checkpoint", "write_text", "fsync_dir"]

_LAYOUT_BASES = {"model", "optimizer", "scheduler", "random_states", "pytorch_model", "custom_checkpoint",
                 "scaler", "sampler", "dl_state_dict"}


def fsync_dir(path: Path) -> None:
    """fsync a folder so the names in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str | bytes, durable: bool) -> int:
    """Write a small UTF-8 file, or bytes as given (fsynced when ``durable``); returns its size in bytes."""
    data = text if isinstance(text, bytes) else text.encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    return len(data)


def _existing_mode(target: Path) -> tuple[int | None, int | None]:
    """(file mode, folder mode) of a checkpoint being replaced, so an overwrite keeps them (case C13)."""
    if not target.is_dir():
        return None, None
    folder_mode = target.stat().st_mode & 0o7777
    for name in (MANIFEST, "model.safetensors"):
        if (target / name).is_file():
            return (target / name).stat().st_mode & 0o7777, folder_mode
    return None, folder_mode


def _is_layout_name(name: str) -> bool:
    stem = name.split(".", 1)[0].split("-", 1)[0]
    head, _, tail = stem.rpartition("_")
    base = head if tail.isdigit() else stem
    return base in _LAYOUT_BASES or name == "config.json"


def _carry_foreign_entries(target: Path, staging: Path) -> None:
    """Hard-link into ``staging`` whatever the user keeps in ``target`` that is not part of a checkpoint."""
    if not target.is_dir():
        return
    for entry in target.iterdir():
        if entry.name == MANIFEST or _is_layout_name(entry.name) or (staging / entry.name).exists():
            continue
        dest = staging / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry), dest)
        elif entry.is_dir():
            shutil.copytree(entry, dest, symlinks=True, copy_function=os.link)
        else:
            os.link(entry, dest)


def write_checkpoint(plan: SavePlan, target: Path, *, durable: bool = True, threads: int = 0) -> Path:
    """Write ``plan`` to the folder ``target`` crash-safely (see the module docs); returns ``target``.

    Raises:
        OSError: the folder cannot be written (disk full, permissions); nothing is left behind and a previous
            checkpoint at ``target`` is intact.
    """
    target = target.absolute()
    file_mode, folder_mode = _existing_mode(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.fastckpt-staging-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        jobs = [(str(staging / p.name), tensor_sources(p.tensors), p.metadata) for p in plan.parts]
        sizes = _core.write_files(jobs, durable=durable, threads=threads)
        files = {p.name: size for p, size in zip(plan.parts, sizes)}
        for name, text in plan.texts.items():
            files[name] = write_text(staging / name, text, durable)
        manifest = manifest_dict(plan.mode, files, plan.counts, plan.step)
        write_text(staging / MANIFEST, json.dumps(manifest, indent=2), durable)
        if file_mode is not None:
            for name in [*files, MANIFEST]:
                os.chmod(staging / name, file_mode)
        if folder_mode is not None:
            os.chmod(staging, folder_mode)
        _carry_foreign_entries(target, staging)
        if durable:
            fsync_dir(staging)
        _core.commit_dir(str(staging), str(target), durable=durable)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target

"""Writing a :class:`~fastckpt._io.files.SavePlan` as one crash-safe checkpoint folder.

1. Leftovers of dead saves beside the target are removed; a staging folder ``.{name}.fastckpt-staging-{pid}-{random}``
   owned by this process (a ``flock``'ed lock file beside it, see :mod:`fastckpt._io.staging`) is made beside it.
2. The Rust core writes every safetensors file of the plan in one parallel pass (``_core.write_files_checked``,
   which also returns crc32c checksums per file and per tensor, summed while writing), then the JSON files are
   written; each file is fsynced when ``durable``.
3. The manifest ``fastckpt.json`` (sizes and checksums, see :mod:`fastckpt._io.integrity`) is written last; modes are
   copied from a checkpoint being replaced (case C13); files the user keeps in the target folder are hard-linked
   into the staging folder.
4. ``_core.commit_dir`` puts the staging folder in place in one step (rename, or ``RENAME_EXCHANGE`` over an older
   folder, retried when another process commits the same target at once) and fsyncs the parent. On any error the
   staging folder is removed and the target is untouched; if the process dies, the next save removes it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._format.tensors import tensor_sources
from fastckpt._io.files import SavePlan
from fastckpt._io.integrity import digest_entry, text_entry
from fastckpt._io.layout import MANIFEST, manifest_dict
from fastckpt._io.staging import OwnedPath, clean_leftovers

__all__ = ["check_target", "write_checkpoint", "write_text", "fsync_dir"]

_LAYOUT_BASES = {"model", "optimizer", "scheduler", "random_states", "pytorch_model", "custom_checkpoint",
                 "scaler", "sampler", "dl_state_dict"}


def fsync_dir(path: Path) -> None:
    """fsync a folder so the names in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise _naming(exc, path, "fsyncing the folder") from None
    finally:
        os.close(fd)


def _naming(exc: OSError, path: Path, doing: str) -> OSError:
    """``exc`` (its errno class) with ``path`` as the filename and what was being done, when it named no file."""
    if exc.filename is not None:
        return exc
    return type(exc)(exc.errno, f"{doing}: {exc.strerror}", str(path))


def write_text(path: Path, text: str | bytes, durable: bool) -> int:
    """Write a small UTF-8 file, or bytes as given (fsynced when ``durable``); returns its size in bytes."""
    data = text if isinstance(text, bytes) else text.encode("utf-8")
    try:
        with open(path, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except OSError as exc:  # a full disk or an I/O error: say which file
        raise _naming(exc, path, f"writing {len(data)} bytes") from None
    return len(data)


def _existing_mode(target: Path) -> tuple[int | None, int | None]:
    """(file mode, folder mode) of a checkpoint being replaced, so an overwrite keeps them (case C13)."""
    try:  # another process may replace or remove the target meanwhile (case C18)
        if not target.is_dir():
            return None, None
        folder_mode = target.stat().st_mode & 0o7777
        for name in (MANIFEST, "model.safetensors"):
            if (target / name).is_file():
                return (target / name).stat().st_mode & 0o7777, folder_mode
        return None, folder_mode
    except FileNotFoundError:
        return None, None


def _is_layout_name(name: str) -> bool:
    stem = name.split(".", 1)[0].split("-", 1)[0]
    head, _, tail = stem.rpartition("_")
    base = head if tail.isdigit() else stem
    return base in _LAYOUT_BASES or name == "config.json"


def _carry_foreign_entries(target: Path, staging: Path) -> None:
    """Hard-link into ``staging`` whatever the user keeps in ``target`` that is not part of a checkpoint."""
    try:
        entries = list(target.iterdir()) if target.is_dir() else []
    except FileNotFoundError:  # replaced by a concurrent save meanwhile
        return
    for entry in entries:
        if entry.name == MANIFEST or _is_layout_name(entry.name) or (staging / entry.name).exists():
            continue
        dest = staging / entry.name
        try:
            if entry.is_symlink():
                os.symlink(os.readlink(entry), dest)
            elif entry.is_dir():
                shutil.copytree(entry, dest, symlinks=True, copy_function=os.link)
            else:
                os.link(entry, dest)
        except FileNotFoundError:
            continue


def check_target(output_dir: str | os.PathLike[str]) -> Path:
    """The absolute folder a save will replace, refused before anything is written when replacing it would lose
    data: an existing file (not a folder), a folder holding the current working directory (``"."``, ``".."``,
    ``os.getcwd()``), the file system root, or an empty path. A symlink to a folder is followed, so the link
    keeps pointing at the new checkpoint.

    Raises:
        ValueError: an empty path, the root, or a folder that contains the current working directory.
        NotADirectoryError: the path exists and is not a folder (nothing is touched).
    """
    if os.fspath(output_dir) == "":
        raise ValueError("output_dir is an empty path; name the checkpoint folder")
    target = Path(os.path.abspath(output_dir))
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    if target.parent == target:
        raise ValueError(f"output_dir {target} is the file system root; name a checkpoint folder inside it")
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "output_dir exists and is not a folder; a checkpoint is a folder",
                                 str(target))
    cwd = Path(os.path.realpath(os.getcwd()))
    real = Path(os.path.realpath(target))
    if real == cwd or real in cwd.parents:
        raise ValueError(
            f"output_dir {target} contains the current working directory {cwd}; a save replaces the whole folder, "
            "so save into a subfolder (e.g. output_dir='checkpoints/step_100')"
        )
    return target


def write_checkpoint(plan: SavePlan, target: Path, *, durable: bool = True, threads: int = 0,
                     ready: Any = None, progress: Any = None, before_commit: Any = None) -> Path:
    """Write ``plan`` to the folder ``target`` crash-safely (see the module docs); returns ``target``.

    ``ready`` (optional): ``ready([(address, length), ...])``, called by the writer before each chunk with the
    source memory it reads, returns once those bytes are final (CUDA staging: :meth:`fastckpt._io.snapshot.Snapshot.
    ready`), so chunk k is written while chunk k+1 is still being copied from the device.
    ``progress`` (optional): a ``fastckpt._core.WriteProgress`` over the plan's tensors, in part order (streaming
    async saves, :mod:`fastckpt._io.async_stream`). ``before_commit`` (optional): called once every file is
    written, before the manifest; if it raises, nothing is committed.

    Raises:
        OSError: the folder cannot be written (disk full, permissions); nothing is left behind and a previous
            checkpoint at ``target`` is intact.
    """
    target = check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(target.parent)
    file_mode, folder_mode = _existing_mode(target)
    owner = OwnedPath(target.parent, target.name)
    staging = owner.path
    try:
        staging.mkdir()
        jobs = [(str(staging / p.name), tensor_sources(p.tensors), p.metadata) for p in plan.parts]
        digests = _core.write_files_checked(jobs, durable=durable, threads=threads, ready=ready, progress=progress)
        files = {p.name: digest[0] for p, digest in zip(plan.parts, digests)}
        checksums = {p.name: digest_entry(digest) for p, digest in zip(plan.parts, digests)}
        for name, text in plan.texts.items():
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            files[name] = write_text(staging / name, data, durable)
            checksums[name] = text_entry(data)
        if before_commit is not None:
            before_commit()
        manifest = manifest_dict(plan.mode, files, plan.counts, plan.step, checksums=checksums)
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
    finally:
        owner.release()  # after a commit nothing is left at `staging`; after an error, the partial folder goes
    return target

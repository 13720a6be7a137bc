"""Writing a :class:`~fastckpt._io.files.SavePlan` as one crash-safe checkpoint folder.

1. Leftovers of dead saves beside the target are removed; a staging folder ``.{name}.fastckpt-staging-{pid}-{random}``
   owned by this process (a ``flock``'ed lock file beside it, see :mod:`fastckpt._io.storage.local.staging`) is made beside it.
2. The Rust core writes every safetensors file of the plan in one parallel pass (``_core.write_files_checked``,
   which also returns crc32c checksums per file and per tensor, summed while writing), then the JSON files are
   written; each file is fsynced when ``durable``.
3. The manifest ``fastckpt.json`` (sizes and checksums, see :mod:`fastckpt._io.storage.local.integrity`) is written last; file modes are
   copied from a checkpoint being replaced (case C13), and the staging folder takes the replaced folder's group
   and setgid bit before any file is made in it (a shared group folder stays shared) and its mode just before the
   commit (a read-only 0555 folder can be saved over); files the user keeps in
   the target folder are hard-linked into the staging folder.
4. ``_core.commit_dir`` puts the staging folder in place in one step (rename, or ``RENAME_EXCHANGE`` over an older
   folder, retried when another process commits the same target at once) and fsyncs the parent. On any error the
   staging folder is removed and the target is untouched; if the process dies, the next save removes it.

A target that cannot be replaced whole (a mount point, a folder under a parent this process cannot write) or that
holds 256 or more files of the user's is committed inside itself instead: :mod:`fastckpt._io.storage.local.in_place`.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._format.tensors import tensor_sources
from fastckpt._io.files import SavePlan
from fastckpt._io.log import log_save
from fastckpt._io.storage.local.in_place import check_in_place, commit_in_place, in_place_reason
from fastckpt._io.storage.local.integrity import digest_entry, text_entry
from fastckpt._io.storage.local.layout import (
    DICT_PICKLE,
    DICT_STRUCTURE,
    DICT_TENSORS,
    MANIFEST,
    SAVE_ID_KEY,
    manifest_dict,
)
from fastckpt._io.storage.local.staging import OwnedPath, clean_leftovers, remember_scanned
from fastckpt.errors import DestinationNotWritableError, OptionError

__all__ = ["Claim", "check_target", "claim_target", "write_checkpoint", "write_files", "write_text", "fsync_dir", "foreign_entries"]

#: A target holding this many entries of the user's is committed in place instead of carrying them all over.
FOREIGN_LIMIT = 256

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


def _existing(target: Path) -> tuple[int | None, os.stat_result | None]:
    """(file mode, folder stat) of a checkpoint being replaced, so an overwrite keeps its modes (case C13) and the
    folder's group, mode and setgid bit (a shared group folder)."""
    try:  # another process may replace or remove the target meanwhile (case C18)
        folder = os.stat(target)
        if not stat.S_ISDIR(folder.st_mode):
            return None, None
        for name in (MANIFEST, "model.safetensors"):
            if (target / name).is_file():
                return (target / name).stat().st_mode & 0o7777, folder
        return None, folder
    except FileNotFoundError:
        return None, None


def _match_folder(staging: Path, folder: os.stat_result | None) -> None:
    """Give ``staging`` the group and mode (setgid included) of the folder it replaces, before any file is made
    in it, so new files get the group that folder would give them. A group this process may not give is kept
    as the parent gave it."""
    if folder is None:
        return
    try:
        if os.stat(staging).st_gid != folder.st_gid:
            os.chown(staging, -1, folder.st_gid)
    except OSError:
        pass  # not a member of that group
    # the setgid bit now (new files take the folder's group), the folder's own mode only at the commit
    # (:func:`_final_mode`): a read-only 0555 checkpoint folder must not refuse the files of its own save
    os.chmod(staging, (folder.st_mode & 0o7777) | 0o700)


def _final_mode(staging: Path, folder: os.stat_result | None) -> None:
    """Give ``staging`` the mode of the folder it replaces, once every file is in it (just before the commit)."""
    if folder is None:
        return
    try:
        os.chmod(staging, folder.st_mode & 0o7777)
    except OSError as exc:
        raise _naming(exc, staging, f"giving the staging folder the mode {folder.st_mode & 0o7777:o}") from None


def _is_layout_name(name: str) -> bool:
    stem = name.split(".", 1)[0].split("-", 1)[0]
    head, _, tail = stem.rpartition("_")
    base = head if tail.isdigit() else stem
    return base in _LAYOUT_BASES or name == "config.json"


def _is_own_entry(name: str) -> bool:
    """Part of a checkpoint (or fastckpt's own hidden entries in it), not a file the user keeps there."""
    return (name == MANIFEST or _is_layout_name(name) or name.startswith(".fastckpt")
            or name in (DICT_TENSORS, DICT_STRUCTURE, DICT_PICKLE))


def foreign_entries(target: Path, limit: int = FOREIGN_LIMIT) -> list[str] | None:
    """Names the user keeps in ``target`` (not part of a checkpoint); None when there are ``limit`` or more (the
    listing stops there), which makes the save commit in place rather than carry them all."""
    names: list[str] = []
    try:
        with os.scandir(target) as entries:
            for entry in entries:
                if not _is_own_entry(entry.name):
                    names.append(entry.name)
                    if len(names) >= limit:
                        return None
    except (FileNotFoundError, NotADirectoryError):  # replaced by a concurrent save meanwhile
        return []
    return names


def _carry_foreign_entries(target: Path, staging: Path, names: list[str]) -> None:
    """Hard-link into ``staging`` the entries ``names`` the user keeps in ``target``."""
    for name in names:
        entry, dest = target / name, staging / name
        if os.path.lexists(dest):
            continue
        try:
            if entry.is_symlink():
                os.symlink(os.readlink(entry), dest)
            elif entry.is_dir():
                shutil.copytree(entry, dest, symlinks=True, copy_function=os.link)
            else:
                os.link(entry, dest)
        except FileNotFoundError:
            continue


def check_target(output_dir: str | os.PathLike[str], what: str = "output_dir") -> Path:
    """The absolute folder a save will replace, refused before anything is written when replacing it would lose
    data: an existing file (not a folder), a path under a file, a folder holding the current working directory
    (``"."``, ``".."``, ``os.getcwd()``), the file system root, or an empty path. A symlink to a folder is
    followed, so the link keeps pointing at the new checkpoint. ``what``: the argument's name, for messages.

    Raises:
        ValueError: an empty path, the root, or a folder that contains the current working directory.
        NotADirectoryError: the path, or a folder above it, exists and is not a folder (nothing is touched).
    """
    if os.fspath(output_dir) == "":
        raise OptionError(f"{what} is an empty path; name the checkpoint folder")
    target = Path(os.path.abspath(output_dir))
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    if target.parent == target:
        raise ValueError(f"{what} {target} is the file system root; name a checkpoint folder inside it")
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{what} exists and is not a folder; a checkpoint is a folder",
                                 str(target))
    above = next((p for p in target.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{what} {target} lies under a file, not a folder", str(above))
    cwd = Path(os.path.realpath(os.getcwd()))
    real = Path(os.path.realpath(target))
    if real == cwd or real in cwd.parents:
        raise ValueError(
            f"{what} {target} contains the current working directory {cwd}; a save replaces the whole folder, "
            "so save into a subfolder (e.g. output_dir='checkpoints/step_100')"
        )
    return target


def write_files(plan: SavePlan, folder: Path, *, save_id: str, durable: bool, threads: int, ready: Any,
                file_mode: int | None, extra: dict[str, Any] | None = None, tag_files: bool = False,
                progress: Any = None, before_commit: Any = None) -> dict[str, int]:
    """Write every file of ``plan`` into the existing ``folder``, the manifest last; returns ``{name: bytes}``.

    With ``tag_files`` (an in-place commit, whose files are renamed into the folder one by one) the manifest
    records ``save_id`` and each safetensors file carries it too (metadata ``fastckpt.save_id``), so a reader can
    tell the files of one save from another's (:mod:`fastckpt._io.storage.local.folder`). A folder committed in one step needs
    no tag: its files never change after the commit, so files opened through one folder handle are of one save
    (and the same state saves to the same bytes).
    """
    def metadata(p: Any) -> Any:
        return [*p.metadata, (SAVE_ID_KEY, save_id)] if tag_files and p.metadata is not None else p.metadata

    jobs = [(str(folder / p.name), tensor_sources(p.tensors, p.dtype), metadata(p)) for p in plan.parts]
    digests = _core.write_files_checked(jobs, durable=durable, threads=threads, ready=ready, progress=progress)
    files = {p.name: digest[0] for p, digest in zip(plan.parts, digests)}
    checksums = {p.name: digest_entry(digest) for p, digest in zip(plan.parts, digests)}
    if plan.links:  # shards equal to the previous checkpoint's: hard links (see fastckpt._io.storage.local.sharing)
        from fastckpt._io.storage.local.sharing import link_into

        def write_one(part: Any) -> tuple[int, dict[str, Any]]:
            job = [(str(folder / part.name), tensor_sources(part.tensors, part.dtype), metadata(part))]
            digest = _core.write_files_checked(job, durable=durable, threads=threads, ready=ready)[0]
            return digest[0], digest_entry(digest)

        link_into(plan, folder, files, checksums, write=write_one)
    for name, text in plan.texts.items():
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        files[name] = write_text(folder / name, data, durable)
        checksums[name] = text_entry(data)
    if before_commit is not None:  # e.g. an async save's last checks; raising here commits nothing
        before_commit(checksums)
    facts = {**plan.counts, **({"save_id": save_id} if tag_files else {}), **(extra or {})}
    manifest = manifest_dict(plan.mode, files, facts, plan.step, checksums=checksums)
    write_text(folder / MANIFEST, json.dumps(manifest, indent=2), durable)
    if file_mode is not None:
        for name in [*files, MANIFEST]:
            os.chmod(folder / name, file_mode)
    return files


class Claim:
    """A save's destination, claimed before its first byte (:func:`claim_target`): its parent folders exist, the
    commit is decided (beside the target, or in place and why) and, beside it, the owned staging folder is made. A
    synchronous save claims and writes at once; an async save claims at the call and writes on the writer thread,
    so a destination that takes no files fails the call itself. :meth:`release` removes the staging folder and its
    lock (idempotent); :func:`write_checkpoint` releases it when done."""

    def __init__(self, target: Path, reason: str | None, owner: OwnedPath | None) -> None:
        self.target, self.reason, self._owner = target, reason, owner

    @property
    def staging(self) -> Path | None:
        """The staging folder beside the target (None for an in-place commit)."""
        return None if self._owner is None else self._owner.path

    def release(self) -> None:
        if self._owner is not None:
            self._owner.release()
            self._owner = None


def _make_parent(target: Path) -> None:
    """Make the folders above ``target``, naming ``target`` and the reason when that fails."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        where = exc.filename if exc.filename is not None else target.parent
        raise DestinationNotWritableError.of(
            exc.errno, f"cannot write {target}: its folder {target.parent} cannot be made ({where}: "
                       f"{exc.strerror or exc})", str(target)) from None


def claim_target(target: str | os.PathLike[str]) -> Claim:
    """Claim the folder ``target`` a save will replace, doing everything a save does before its first byte (a few
    syscalls, no tensor data): :func:`check_target`, the parent folders made, leftovers of dead saves beside it
    removed, the commit decided (:func:`.in_place.in_place_reason`, or 256 files of the user's) and its staging
    folder made (an in-place commit: its lock file checked, not taken).

    Raises:
        ValueError / NotADirectoryError: what :func:`check_target` refuses.
        DestinationNotWritableError: the parent folder cannot be made, or takes no new files (read-only, full, no
            permission, ``/proc``): names ``target`` and the reason; also the builtin OSError subclass of its errno.
            Nothing is left behind.
    """
    target = check_target(target)
    _make_parent(target)
    reason = in_place_reason(target)
    if reason is None and target.is_dir() and foreign_entries(target) is None:
        reason = f"it holds {FOREIGN_LIMIT} or more files of its own"
    if reason is not None:
        check_in_place(target)
        return Claim(target, reason, None)
    clean_leftovers(target.parent)
    owner = OwnedPath(target.parent, target.name)
    try:
        owner.path.mkdir()
    except OSError as exc:
        owner.release()
        raise DestinationNotWritableError.of(exc.errno, f"cannot write {target}: its staging folder cannot be made "
                                                        f"in {target.parent} ({exc.strerror or exc})",
                                             str(target)) from None
    except BaseException:
        owner.release()
        raise
    return Claim(target, None, owner)


def write_checkpoint(plan: SavePlan, target: Path, *, durable: bool = True, threads: int = 0,
                     ready: Any = None, progress: Any = None, before_commit: Any = None,
                     claim: Claim | None = None) -> Path:
    """Write ``plan`` to the folder ``target`` crash-safely (see the module docs); returns ``target``.

    ``ready`` (optional): ``ready([(address, length), ...])``, called by the writer before each chunk with the
    source memory it reads, returns once those bytes are final (CUDA staging: :meth:`fastckpt._io.async_save.snapshot.Snapshot.
    ready`), so chunk k is written while chunk k+1 is still being copied from the device.
    ``progress`` (optional): a ``fastckpt._core.WriteProgress`` over the plan's tensors, in part order (streaming
    async saves, :mod:`fastckpt._io.async_save.stream`). ``before_commit`` (optional): ``before_commit(checksums)``
    with ``{file name: its manifest checksum fields}``, called once every file is written, before the manifest;
    if it raises, nothing is committed. ``claim`` (optional): ``target``'s :func:`claim_target`, made earlier (an
    async save's call); else it is claimed here. Released either way.

    A target that is a mount point, sits in a folder this process cannot write, or holds many files of the user's
    is committed inside itself instead (:mod:`fastckpt._io.storage.local.in_place`); that is decided before anything is written.

    Raises:
        DestinationNotWritableError: what :func:`claim_target` raises (before anything is written).
        OSError: the folder cannot be written (disk full, permissions); nothing is left behind and a previous
            checkpoint at ``target`` is intact.
    """
    started = time.perf_counter()
    claim = claim if claim is not None else claim_target(target)
    try:
        target = claim.target
        save_id = secrets.token_hex(8)
        if claim.reason is not None:
            file_mode = _existing(target)[0]
            commit_in_place(target, claim.reason, lambda folder, facts: write_files(
                plan, folder, save_id=save_id, durable=durable, threads=threads, ready=ready, file_mode=file_mode,
                extra=facts, tag_files=True, progress=progress, before_commit=before_commit), durable=durable)
        else:
            _commit_beside(plan, claim, save_id=save_id, durable=durable, threads=threads, ready=ready,
                           progress=progress, before_commit=before_commit)
    finally:
        claim.release()  # after a commit nothing is left at the staging path; after an error, the partial folder goes
    if claim.reason is None:
        remember_scanned(target.parent)  # after the lock's removal: the next save need not list the parent again
    log_save(target, plan, time.perf_counter() - started, in_place=claim.reason)
    return target


def _commit_beside(plan: SavePlan, claim: Claim, *, save_id: str, durable: bool, threads: int, ready: Any,
                   progress: Any = None, before_commit: Any = None) -> None:
    """The usual commit: the claimed staging folder beside the target, put in place in one step (see the module
    docs); the caller releases the claim (removing the partial folder after an error)."""
    target, staging = claim.target, claim.staging
    assert staging is not None
    file_mode, folder = _existing(target)
    _match_folder(staging, folder)
    write_files(plan, staging, save_id=save_id, durable=durable, threads=threads, ready=ready,
                file_mode=file_mode, progress=progress, before_commit=before_commit)
    # the user's files in the target as they are now (an async save claimed it at the call)
    _carry_foreign_entries(target, staging, (foreign_entries(target, limit=sys.maxsize) or []) if target.is_dir()
                           else [])
    _final_mode(staging, folder)
    if durable:
        fsync_dir(staging)
    _core.commit_dir(str(staging), str(target), durable=durable)

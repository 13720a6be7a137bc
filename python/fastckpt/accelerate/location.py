"""Where an Accelerator's checkpoint is: ``output_dir`` / ``input_dir`` or its ``ProjectConfiguration`` made one
:class:`~fastckpt._io.storage.base.Storage` (a local folder or ``s3://`` alike), and accelerate's project rules
spoken in the storage's verbs.

accelerate's rules: an explicit folder is always used (a local folder with an ``s3://`` project included); else,
with ``automatic_checkpoint_naming``, a full save goes to ``checkpoints/checkpoint_{n}`` with n = max(``iteration``,
largest committed + 1) and a model-only save to the next ``model_only/checkpoint_{n}``; ``total_limit`` rotates
after the commit. A load picks on the main process (the named checkpoint, or the newest committed one of
``checkpoints/``: saved in full, or of either mode for a model-only load), every process reaches its files
(:meth:`Storage.as_local`: the folder itself, or a checked in-memory copy of an object store's) and the processes
compare the manifest's digest before anything is applied.

May import: layers 0-4 (private).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastckpt._io.group.distributed import agree, broadcast_from_main, gather_to_main, on_main
from fastckpt._io.storage import Storage, resolve
from fastckpt._io.storage.base import CheckpointView, Committed, StagedSave
from fastckpt._io.storage.local.layout import CHECKPOINTS_DIR, MANIFEST
from fastckpt.errors import CheckpointChangedError, MissingStateError

__all__ = ["checkpoint_storage", "check_remote_save", "check_total_limit", "begin_save", "named",
           "fetched_on_every_rank", "set_iteration"]


def _project_dir(accelerator: Any) -> Any:
    project = getattr(accelerator, "project_dir", None)
    return project if project is not None else os.getcwd()


def checkpoint_storage(accelerator: Any, folder: Any, what: str) -> Storage:
    """The storage of ``folder`` (``output_dir`` / ``input_dir``), or of the Accelerator's project when None.

    Raises:
        ValueError: a URL of a scheme fastckpt does not serve (the folder's or ``project_dir``'s); a local
            ``folder`` with an ``s3://`` project is allowed (an explicit folder is always used), as is an
            ``s3://`` folder with a local project.
    """
    project = resolve(None, project_dir=_project_dir(accelerator), what="project_dir")  # checks its scheme
    if folder is None:
        return project
    return resolve(os.path.expanduser(os.fspath(folder)), what=what)


def check_remote_save(storage: Storage, *, fsdp: str | None, async_save: Any, share_unchanged: bool,
                      hooks: list) -> None:
    """Raises ValueError for what a save whose checkpoints are no local folders (``s3://``) does not do (yet)."""
    if storage.tier == "local":
        return
    if fsdp is not None:
        raise ValueError("FSDP2 states do not save to s3:// yet; save to a local folder (then upload it)")
    if async_save:
        raise ValueError("async_save does not apply to s3:// with fastckpt.accelerate yet; save with "
                         "async_save=False, or use fastckpt.save_state(..., remote=) for a tiered save")
    if share_unchanged:
        raise ValueError("share_unchanged hard-links local files and does not apply to s3://; pass False")
    if hooks:
        raise ValueError("save_model_state_pre_hooks write into a local folder; they do not apply to s3:// saves")


def check_total_limit(accelerator: Any, output_dir: Any) -> None:
    """Raises ValueError, before anything is written, for a ``total_limit`` the automatic naming's rotation cannot
    keep (not an int >= 1); a named ``output_dir`` is never rotated, so it does not look."""
    limit = accelerator.project_configuration.total_limit
    if output_dir is not None or not accelerator.project_configuration.automatic_checkpoint_naming or limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"ProjectConfiguration.total_limit must be an int >= 1 (or None to keep every checkpoint), "
                         f"got {limit!r}")


def begin_save(accelerator: Any, storage: Storage, named_folder: bool, *, model_only: bool,
               step: int) -> tuple[StagedSave | None, str, int | None]:
    """(the staged save, where it goes, n of an automatic full save's ``checkpoint_{n}`` or None) by accelerate's
    rules. Runs on the main process. A named folder's save is opened when it is written (None here): a folder that
    cannot take it fails that step, as a save's write does.

    Raises:
        ValueError: no folder and no ``automatic_checkpoint_naming``.
    """
    config = accelerator.project_configuration
    if named_folder:
        return None, storage.location, None
    if not config.automatic_checkpoint_naming:
        raise ValueError("output_dir is required unless the Accelerator's ProjectConfiguration has "
                         "automatic_checkpoint_naming=True")
    if model_only:  # numbered apart, one above the largest model-only snapshot
        save = storage.begin(model_only=True, step=step)
        return save, save.location, None
    numbers = [c.number for c in storage.list(full_only=False) if c.number is not None]
    n = max(int(config.iteration), max(numbers) + 1 if numbers else 0)
    save = storage.begin(f"{CHECKPOINTS_DIR}/checkpoint_{n}", step=step)
    return save, save.location, n


def named(committed: Committed | CheckpointView) -> Path | str:
    """How a public call returns a checkpoint: a local folder as an absolute ``Path``, else its URL."""
    name = committed.named
    return name.absolute() if isinstance(name, Path) else name


def _pick(storage: Storage, folder: Any, model_only: bool) -> Committed:
    if folder is not None:
        return Committed(storage.location, None)
    found = storage.list(full_only=not model_only)
    if not found:
        what = "checkpoint_N" if model_only else "checkpoint_N saved in full"
        raise MissingStateError(f"{storage.location.rstrip('/')}/{CHECKPOINTS_DIR}: no committed {what} to load")
    return found[-1]


@contextlib.contextmanager
def fetched_on_every_rank(storage: Storage, folder: Any, *, model_only: bool,
                          timeout: float) -> Iterator[CheckpointView]:
    """The checkpoint the main process picked (``folder``, or the project's newest), its files reached by every
    process (:meth:`Storage.as_local`), the same committed save on each.

    Raises:
        MissingStateError, IntegrityError, OSError: on the process where it happened; CheckpointError on the
            others. CheckpointChangedError: a newer save replaced the checkpoint between the processes' reads
            (retry).
    """
    chosen = on_main(lambda: _pick(storage, folder, model_only), what="finding the checkpoint", timeout=timeout)
    what = f"fetching {chosen.location}"
    with contextlib.ExitStack() as stack:
        error: BaseException | None = None
        digest = None
        view: CheckpointView | None = None
        try:
            view = stack.enter_context(storage.as_local(chosen, model_only=model_only))
            manifest = view.path / MANIFEST
            digest = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None
        except Exception as exc:  # every process learns of it before any object changes
            error = exc
        agree(error, what=what, timeout=timeout)
        digests = gather_to_main(digest, what=what, timeout=timeout)
        same = broadcast_from_main(None if digests is None else len(set(digests)) == 1, what=what, timeout=timeout)
        if not same:
            raise CheckpointChangedError(f"{chosen.location}: a newer save replaced it while the processes "
                                         "downloaded it; retry")
        assert view is not None
        yield view


def set_iteration(accelerator: Any, view: CheckpointView) -> None:
    """``project_configuration.iteration`` = N + 1 after loading ``{project_dir}/checkpoints/checkpoint_N``."""
    name = named(view)
    project = checkpoint_storage(accelerator, None, "project_dir").location
    if isinstance(name, Path):  # a local folder: compared as the file system sees it
        parent, checkpoints = name.parent.resolve(), (Path(project).absolute() / CHECKPOINTS_DIR).resolve()
    else:  # a URL: compared as written
        parent, checkpoints = name.rsplit("/", 1)[0], f"{project.rstrip('/')}/{CHECKPOINTS_DIR}"
    m = re.fullmatch(r"checkpoint_(\d+)", os.path.basename(str(name)))
    if m and parent == checkpoints:
        accelerator.project_configuration.iteration = int(m.group(1)) + 1

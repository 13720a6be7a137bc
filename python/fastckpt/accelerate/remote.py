"""``fastckpt.accelerate`` over ``s3://``: an ``output_dir`` / ``input_dir`` URL, or an Accelerator whose
``ProjectConfiguration(project_dir="s3://bucket/run", automatic_checkpoint_naming=True, total_limit=...)`` names
its checkpoints in object storage.

Save: every process's RNG states are gathered to the main process as for a local save, and the main process writes
the whole checkpoint (one ``random_states`` file per process) into a private local folder and uploads it as one
commit (:func:`fastckpt._io.storage.object.commit.save_object_checkpoint`), then rotates the remote project. Load: the main
process picks the checkpoint URL; every process downloads it (checked by crc32c) into a private folder of its own;
the processes agree that they fetched the same committed save before anything is applied.

May import: layers 0-4 (private) and :mod:`fastckpt.checkpoint`.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastckpt._io.group.distributed import agree, broadcast_from_main, gather_to_main, on_main
from fastckpt._io.storage.local.layout import MANIFEST
from fastckpt._io.storage.object.api import fetched
from fastckpt._io.storage.object.commit import save_object_checkpoint
from fastckpt._io.storage.object.project import (
    next_object_checkpoint,
    object_checkpoint_numbers,
    rotate_object_checkpoints,
)
from fastckpt._io.storage.object.store import ObjectUrl, open_store, parse_url, remote_url
from fastckpt.errors import CheckpointChangedError, MissingStateError

__all__ = ["remote_location", "check_remote_save", "choose_remote_target", "write_remote", "fetched_on_every_rank",
           "set_remote_iteration"]


def remote_location(accelerator: Any, folder: Any, folder_arg: str) -> tuple[ObjectUrl | None, ObjectUrl | None]:
    """``(checkpoint url, project url)`` of an ``s3://`` folder / project_dir (each None when local); both None
    for a local checkpoint.

    Raises:
        ValueError: a URL of a scheme fastckpt does not serve; a local ``folder`` with an ``s3://`` project is
            allowed (an explicit folder is always used), as is an ``s3://`` folder with a local project.
    """
    url = remote_url(folder, folder_arg)
    project = remote_url(getattr(accelerator, "project_dir", None), "project_dir")
    if url is None and folder is not None:
        project = None  # an explicit local folder: the project does not matter
    return url, project


def check_remote_save(*, fsdp: str | None, async_save: Any, share_unchanged: bool, hooks: list) -> None:
    """Raises ValueError for what an ``s3://`` accelerate save does not do (yet), naming it."""
    if fsdp is not None:
        raise ValueError("FSDP2 states do not save to s3:// yet; save to a local folder (then upload it)")
    if async_save:
        raise ValueError("async_save does not apply to s3:// with fastckpt.accelerate yet; save with "
                         "async_save=False, or use fastckpt.save_state(..., remote=) for a tiered save")
    if share_unchanged:
        raise ValueError("share_unchanged hard-links local files and does not apply to s3://; pass False")
    if hooks:
        raise ValueError("save_model_state_pre_hooks write into a local folder; they do not apply to s3:// saves")


def choose_remote_target(accelerator: Any, url: ObjectUrl | None, project: ObjectUrl | None,
                         model_only: bool, storage_options: Any = None) -> tuple[ObjectUrl, int | None]:
    """(checkpoint URL, automatic number or None), with the rules of :func:`~fastckpt.accelerate.project.
    choose_target` counted over committed manifests. Runs on the main process."""
    if url is not None:
        return url, None
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        raise ValueError("output_dir is required unless the Accelerator's ProjectConfiguration has "
                         "automatic_checkpoint_naming=True")
    assert project is not None
    store = open_store(project.bucket, storage_options)
    if model_only:
        target = next_object_checkpoint(store, project, model_only=True)
        return target, int(target.prefix.rsplit("_", 1)[1])
    numbers = object_checkpoint_numbers(store, project)
    n = max(int(config.iteration), max(numbers) + 1 if numbers else 0)
    return project.child("checkpoints", f"checkpoint_{n}"), n


def write_remote(accelerator: Any, target: ObjectUrl, number: int | None, write: Callable[[Path], Any], *,
                 model_only: bool, storage_options: Any = None) -> str:
    """On the main process: ``write(local_folder)``, upload and commit at ``target``, then rotate the project to
    ``total_limit`` (automatic naming only). Returns the URL."""
    store = open_store(target.bucket, storage_options)
    save_object_checkpoint(store, target, write)
    limit = accelerator.project_configuration.total_limit
    project = remote_url(getattr(accelerator, "project_dir", None), "project_dir")
    if number is not None and limit is not None and project is not None:
        rotate_object_checkpoints(store, project, limit, model_only=model_only)
    return str(target)


def _resolve(url: ObjectUrl | None, project: ObjectUrl | None, model_only: bool) -> str:
    if url is not None:
        return str(url)
    assert project is not None
    numbers = object_checkpoint_numbers(open_store(project.bucket), project, full_only=not model_only)
    if not numbers:
        what = "checkpoint_N" if model_only else "checkpoint_N saved in full"
        raise MissingStateError(f"{project.child('checkpoints')}: no committed {what} to load")
    return str(numbers[max(numbers)])


@contextlib.contextmanager
def fetched_on_every_rank(url: ObjectUrl | None, project: ObjectUrl | None, *, model_only: bool,
                          timeout: float) -> Iterator[tuple[str, Path]]:
    """``(checkpoint URL, local folder)``: the URL the main process picked, downloaded by every process.

    Raises:
        MissingStateError, IntegrityError, OSError: as :func:`fastckpt._io.storage.object.api.fetched`, on the process
            where it happened; CheckpointError on the others. CheckpointChangedError: a newer save replaced the
            checkpoint between the processes' downloads (retry).
    """
    chosen = on_main(lambda: _resolve(url, project, model_only), what="finding the checkpoint", timeout=timeout)
    with contextlib.ExitStack() as stack:
        error: BaseException | None = None
        digest = None
        try:
            folder = stack.enter_context(fetched(parse_url(chosen, "input_dir"), None, model_only=model_only,
                                                 storage_options=None))
            digest = hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()
        except Exception as exc:  # every process learns of it before any object changes
            error = exc
        agree(error, what=f"fetching {chosen}", timeout=timeout)
        digests = gather_to_main(digest, what=f"fetching {chosen}", timeout=timeout)
        same = broadcast_from_main(None if digests is None else len(set(digests)) == 1, what=f"fetching {chosen}",
                                   timeout=timeout)
        if not same:
            raise CheckpointChangedError(f"{chosen}: a newer save replaced it while the processes downloaded it; "
                                         "retry")
        yield chosen, folder


def set_remote_iteration(accelerator: Any, chosen: str) -> None:
    """``project_configuration.iteration`` = N + 1 after loading ``{project_dir}/checkpoints/checkpoint_N``."""
    project = remote_url(getattr(accelerator, "project_dir", None), "project_dir")
    m = re.fullmatch(r"checkpoint_(\d+)", chosen.rsplit("/", 1)[-1])
    if m and project is not None and chosen.rsplit("/", 1)[0] == str(project.child("checkpoints")):
        accelerator.project_configuration.iteration = int(m.group(1)) + 1

"""Sharded (DTensor / FSDP2) states in :func:`fastckpt.save_state` / :func:`fastckpt.load_state`: written and read
through torch.distributed.checkpoint with fastckpt's storage plugin (:mod:`fastckpt.dcp`), one part folder per
model / optimizer inside the checkpoint (see :mod:`fastckpt._plan.sharded_save`, :mod:`fastckpt._plan.sharded_load`);
a model-only save is a Hugging Face folder every world size loads. An ``s3://`` checkpoint is written by every rank
straight to object storage and committed by the main process (see :mod:`fastckpt._plan.sharded_save`), and read by
every rank from the one save the main process picked (:func:`load_sharded`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastckpt._io.group.distributed import Session, process_rank
from fastckpt._io.storage.base import Storage
from fastckpt._io.storage.local.folder import pinned
from fastckpt._io.storage.object.fetch import RemoteCheckpoint
from fastckpt._io.storage.object.sharded import ObjectSave
from fastckpt._plan.sharded_load import is_sharded_checkpoint, plan_sharded_load
from fastckpt._plan.sharded_save import save_sharded

__all__ = ["dcp_storage_writer", "dcp_storage_reader", "save_sharded_state", "load_sharded_state", "load_sharded"]


def dcp_storage_writer(folder: Path | str, durable: bool, threads: int, *,
                       storage_options: Mapping[str, Any] | None = None) -> Any:
    """The DCP ``StorageWriter`` a sharded save writes one part with, into ``folder`` inside the staging folder
    (or under the ``s3://`` prefix of the part inside the save; fastckpt.dcp, ``commit=False``: the save commits the
    whole checkpoint once)."""
    import fastckpt.dcp

    return fastckpt.dcp.StorageWriter(folder, threads=threads, durable=durable, commit=False,
                                      storage_options=dict(storage_options) if storage_options else None)


def dcp_storage_reader(folder: Path, checksums: dict[str, Any] | None = None, *, verify: bool = True,
                       threads: int = 0) -> Any:
    """The DCP ``StorageReader`` a sharded load reads one part with (``checksums``: the part's files as the
    checkpoint's manifest records them, ``{file name: {"bytes", "crc32c", "tensors"}}``)."""
    import fastckpt.dcp

    return fastckpt.dcp.StorageReader(folder, threads=threads, verify=verify, checksums=checksums)


def save_sharded_state(models: list, optimizers: list, schedulers: list, *, storage: Storage, model_only: bool,
                       total_limit: int | None, step: int, durable: bool, threads: int, max_shard_size: Any,
                       compat: Any, async_save: bool, timeout: float) -> Path | str:
    """Save sharded models (and their optimizers, schedulers) from every rank; returns the committed folder (an
    ``s3://`` ``output_dir`` / ``project_dir``: the checkpoint's URL)."""
    for name, value in (("max_shard_size", None if model_only else max_shard_size), ("compat", compat)):
        if value is not None:
            raise ValueError(f"{name}={value!r} does not apply to a sharded (DTensor / FSDP2) model: its shards are "
                             "written through torch.distributed.checkpoint; pass None")
    if max_shard_size is not None:
        from fastckpt._io.sizes import parse_size

        max_shard_size = parse_size(max_shard_size)
    if async_save:
        raise ValueError("async_save=True is not supported for sharded (DTensor / FSDP2) models yet; "
                         "save with async_save=False")
    if storage.tier == "remote":  # every rank writes its shards straight to object storage; the main one commits
        url, project, options = storage.url, storage.project, storage.storage_options
        remote = ObjectSave(url, project if url is None else None, model_only=model_only, storage_options=options)
        saved = save_sharded(models, optimizers, schedulers, target=remote, model_only=model_only, step=step,
                             durable=durable, threads=threads, timeout=timeout, max_shard_size=max_shard_size,
                             writer_factory=functools.partial(dcp_storage_writer, storage_options=options))
        if url is None and total_limit is not None and process_rank() == 0:
            remote.rotate(total_limit)
        return saved
    target = storage.begin(model_only=model_only, step=step).location
    path = save_sharded(models, optimizers, schedulers, target=Path(target).absolute(), model_only=model_only,
                        step=step, durable=durable, threads=threads, timeout=timeout,
                        writer_factory=dcp_storage_writer, max_shard_size=max_shard_size)
    if total_limit is not None and process_rank() == 0:
        storage.rotate(total_limit, model_only=model_only)  # the kind saved (a named folder is never rotated)
    return path


def load_sharded_state(folder: Path, models: list, optimizers: list, schedulers: list, *, model_only: bool,
                       strict: bool, threads: int, verify: bool, timeout: float,
                       remote: RemoteCheckpoint | None = None) -> tuple[list[str], list[str], list[str]]:
    """Load a checkpoint into sharded models on every rank; returns ``(missing_keys, unexpected_keys, skipped)``
    (``skipped``: :attr:`~fastckpt.LoadResult.skipped`'s lines).

    ``remote``: ``folder`` is that opened ``s3://`` checkpoint's folder, holding its small files and each part's
    ``dcp_metadata.json``; each part's reader fetches the shard objects this rank's boxes come from."""
    from fastckpt.errors import MissingStateError

    session = Session(f"load_state from {remote.url if remote is not None else folder.absolute()}", timeout)
    mode = None if is_sharded_checkpoint(folder) else _saved_mode(folder)
    if mode == "model_only" and not model_only and (optimizers or schedulers):
        raise MissingStateError(f"{folder}: saved with model_only=True, so it holds no optimizer or scheduler state; "
                                "load it with model_only=True, or pass no optimizer/scheduler. Nothing was changed.")
    if mode is not None and (model_only or mode == "model_only"):  # model files (a model-only save: HF files)
        return _load_full_into_sharded(folder, models, model_only=model_only, strict=strict, verify=verify,
                                       threads=threads, session=session)
    error: BaseException | None = None
    try:
        if not is_sharded_checkpoint(folder):
            raise MissingStateError(f"{folder}: not a sharded checkpoint; a sharded (DTensor / FSDP2) model loads "
                                    "checkpoints saved from sharded models")
    except Exception as exc:  # reported to every rank with the validation (plan_sharded_load's one round)
        error = exc
    if error is None and not model_only and session.rank == 0:
        from fastckpt._state.rng import warn_unrestored

        warn_unrestored(folder, session.world, stacklevel=4)
    plan = plan_sharded_load(folder, models, optimizers, schedulers, model_only=model_only, strict=strict,
                             session=session, reader_factory=dcp_storage_reader if remote is None else
                             functools.partial(_remote_part_reader, remote),
                             rng_rank=None if model_only else session.rank, failed=error, verify=verify,
                             threads=threads, listed=remote is not None)
    plan.apply()
    return plan.missing_keys, plan.unexpected_keys, plan.skipped


def load_sharded(storage: Storage, models: list, optimizers: list, schedulers: list, *, model_only: bool,
                 strict: bool, threads: int, verify: bool, timeout: float) -> tuple[list[str], list[str], list[str]]:
    """A checkpoint of ``storage`` (:func:`fastckpt._io.storage.resolve`) into sharded models on every rank: every
    rank opens the same committed save (:meth:`~fastckpt._io.storage.base.Storage.open_shared`: of an ``s3://``
    checkpoint, the main process picks it, every rank reads its small files and each part's metadata into memory
    and agrees, and each part reader then fetches only the shard objects this rank's boxes come from), then the
    sharded load plan runs on it."""
    with storage.open_shared(model_only=model_only, timeout=timeout, what="load_state") as view:
        return load_sharded_state(view.path, models, optimizers, schedulers, model_only=model_only, strict=strict,
                                  threads=threads, verify=verify and not view.checked, timeout=timeout,
                                  remote=view.extra.get("remote"))


def _remote_part_reader(remote: RemoteCheckpoint, folder: Path, checksums: dict[str, Any] | None = None, *,
                        verify: bool = True, threads: int = 0) -> Any:
    """:func:`dcp_storage_reader` for the part ``folder.name`` of the opened ``s3://`` checkpoint ``remote``."""
    reader = dcp_storage_reader(folder, checksums, verify=verify, threads=threads)
    reader.attach_remote(remote, folder.name)
    return reader


def _saved_mode(folder: Path) -> Any:
    from fastckpt._io.storage.local.layout import read_manifest
    from fastckpt.errors import MissingStateError

    try:
        return read_manifest(folder, check_sizes=False).get("mode")
    except (MissingStateError, ValueError):
        return None


def _load_full_into_sharded(folder: Path, models: list, *, model_only: bool, strict: bool, verify: bool,
                            threads: int, session: Session) -> tuple[list[str], list[str], list[str]]:
    """Full model files (a model-only save, from one process or FSDP2) into sharded models: every rank reads and
    checks the full tensors, every rank agrees, then ``set_model_state_dict(full_state_dict=True)`` keeps each
    rank's shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from fastckpt._io.storage.local.layout import checkpoint_layout
    from fastckpt._plan.full_load import plan_full

    full: list = []
    error: BaseException | None = None
    try:
        with pinned(folder, verify=verify, threads=threads, defer=True) as handle:  # every file summed at the end
            full = plan_full(handle, models, [], model_only=True, strict=strict, layout=checkpoint_layout(handle))
    except Exception as exc:
        error = exc
    session.agree(error, step="validate")
    missing: list[str] = []
    unexpected: list[str] = []
    for _, model, state, miss, unexp in full:
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))
        missing += miss
        unexpected += unexp
    return missing, unexpected, []

"""``save_state`` / ``load_state``: a whole training state in one crash-safe, pickle-free checkpoint folder.

The Python side decides *which* tensors go where (the model-only policy, tied weights, optimizer fqns) and hands
only those to the Rust core, which writes every file of the checkpoint in one parallel pass straight from tensor
memory. The folder is assembled in a staging folder beside the target, the manifest is written last, and the
staging folder is put in place in one step (``fastckpt._core.commit_dir``), so a reader sees the previous
checkpoint or the new complete one, never a mix. The argument checks and the save paths per storage live in
:mod:`fastckpt.checkpoint_impl`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Literal, Mapping, NamedTuple, Sequence, overload

import torch

from fastckpt._io.async_save.writer import AsyncSave, wait_for_saves_to
from fastckpt._io.group.distributed import DEFAULT_TIMEOUT, check_timeout, is_distributed
from fastckpt._io.log import log_load
from fastckpt._io.storage.base import newest
from fastckpt._io.storage.local.folder import RETRIES, opened_files
from fastckpt._io.storage.local.integrity import VerifyReport
from fastckpt._io.storage.local.integrity import verify_checkpoint as _verify_local
from fastckpt._io.storage.schemes import resolve
from fastckpt._io.storage.tiered.upload import TieredSave
from fastckpt._plan.load import plan_load
from fastckpt._plan.sharded_load import is_sharded_checkpoint
from fastckpt._state.rng import warn_unrestored
from fastckpt._state.sharded import is_sharded
from fastckpt.checkpoint_impl import (
    _as_list,
    _check_common,
    _check_flags,
    _check_map_location,
    save_to,
)
from fastckpt.checkpoint_sharded import load_sharded, load_sharded_state
from fastckpt.errors import CheckpointChangedError, OptionTypeError

__all__ = ["save_state", "load_state", "latest_checkpoint", "verify_checkpoint", "LoadResult"]


class _Keys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class LoadResult(_Keys):
    """What :func:`load_state` returns, like torch's ``load_state_dict``: names (fqns) not loaded, as the pair
    ``(missing_keys, unexpected_keys)``; with several models the names carry a ``model_{i}.`` prefix.

    ``skipped``: saved parts that a ``strict=False`` load did not apply, one line each naming the part and why (an
    optimizer or scheduler state saved by another class: the live object keeps its own state).
    """

    skipped: list[str]

    def __new__(cls, missing_keys: list[str], unexpected_keys: list[str],
                skipped: list[str] | None = None) -> LoadResult:
        self = super().__new__(cls, missing_keys, unexpected_keys)
        self.skipped = list(skipped or [])
        return self


# Typed overloads: ``async_save=False`` (the default) returns the committed folder, ``True`` / ``"stream"`` / ``"snapshot"`` the handle,
# ``remote=`` a TieredSave. An ``s3://`` output_dir returns the checkpoint's URL as a ``str`` (a URL and a local path
# are both ``str`` arguments, so the overloads cannot tell them apart: they say ``Path``).
_Models = torch.nn.Module | Sequence[torch.nn.Module]
_Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None
_PathArg = str | os.PathLike[str] | None


@overload
def save_state(model: _Models, optimizer: _Optimizers = ..., scheduler: Any = ..., *, output_dir: _PathArg = ...,
               model_only: bool = ..., project_dir: _PathArg = ..., total_limit: int | None = ..., step: int = ...,
               durable: bool = ..., threads: int = ..., max_shard_size: int | str | None = ...,
               compat: str | None = ..., async_save: Literal[False] = ..., trainable_only: bool = ...,
               trainable_buffers: Sequence[str] = ..., dtype: torch.dtype | None = ..., share_unchanged: bool = ...,
               timeout: float = ..., host_memory_budget: int | str | None = ...,
               storage_options: Mapping[str, Any] | None = ..., remote: None = ...) -> Path: ...
@overload
def save_state(model: _Models, optimizer: _Optimizers = ..., scheduler: Any = ..., *, output_dir: _PathArg = ...,
               model_only: bool = ..., project_dir: _PathArg = ..., total_limit: int | None = ..., step: int = ...,
               durable: bool = ..., threads: int = ..., max_shard_size: int | str | None = ...,
               compat: str | None = ..., async_save: Literal[True, "stream", "snapshot"], trainable_only: bool = ...,
               trainable_buffers: Sequence[str] = ..., dtype: torch.dtype | None = ..., share_unchanged: bool = ...,
               timeout: float = ..., host_memory_budget: int | str | None = ...,
               storage_options: Mapping[str, Any] | None = ..., remote: None = ...) -> AsyncSave: ...
@overload
def save_state(model: _Models, optimizer: _Optimizers = ..., scheduler: Any = ..., *, output_dir: _PathArg = ...,
               model_only: bool = ..., project_dir: _PathArg = ..., total_limit: int | None = ..., step: int = ...,
               durable: bool = ..., threads: int = ..., max_shard_size: int | str | None = ...,
               compat: str | None = ..., async_save: bool | str = ..., trainable_only: bool = ...,
               trainable_buffers: Sequence[str] = ..., dtype: torch.dtype | None = ..., share_unchanged: bool = ...,
               timeout: float = ..., host_memory_budget: int | str | None = ...,
               storage_options: Mapping[str, Any] | None = ..., remote: None = ...) -> Path | AsyncSave: ...
@overload
def save_state(model: _Models, optimizer: _Optimizers = ..., scheduler: Any = ..., *, output_dir: _PathArg = ...,
               model_only: bool = ..., project_dir: _PathArg = ..., total_limit: int | None = ..., step: int = ...,
               durable: bool = ..., threads: int = ..., max_shard_size: int | str | None = ...,
               compat: str | None = ..., async_save: bool | str = ..., trainable_only: bool = ...,
               trainable_buffers: Sequence[str] = ..., dtype: torch.dtype | None = ..., share_unchanged: bool = ...,
               timeout: float = ..., host_memory_budget: int | str | None = ...,
               storage_options: Mapping[str, Any] | None = ..., remote: str) -> TieredSave: ...


def save_state(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    scheduler: Any = None,
    *,
    output_dir: str | os.PathLike[str] | None = None,
    model_only: bool = False,
    project_dir: str | os.PathLike[str] | None = None,
    total_limit: int | None = None,
    step: int = 0,
    durable: bool = True,
    threads: int = 0,
    max_shard_size: int | str | None = None,
    compat: str | None = None,
    async_save: bool | str = False,
    trainable_only: bool = False,
    trainable_buffers: Sequence[str] = (),
    dtype: torch.dtype | None = None,
    share_unchanged: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    host_memory_budget: int | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    remote: str | None = None,
) -> Path | AsyncSave | str | TieredSave:
    """Save a training state (or only the model weights) to a checkpoint folder, crash-safely.

    Mirrors ``accelerate.Accelerator.save_state``'s layout and file names without pickle; see
    :mod:`fastckpt._io.storage.local.layout` for the files.

    Args:
        model: a module or a list of modules (``model.safetensors``, ``model_1.safetensors``, ...).
        optimizer: an optimizer, a list, or None. Ignored (never touched) when ``model_only``. State of a parameter
            that belongs to no passed model (a standalone ``nn.Parameter``) is keyed by its position in
            ``param_groups`` (``#k``, listed in the manifest's ``positional_params``) and restored by position.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``), a list, or None.
            Ignored when ``model_only``.
        output_dir: the checkpoint folder; replaced atomically if it exists (other files in it are kept).
            None: ``{project_dir}/checkpoints/checkpoint_{n}``, n = largest present + 1; a model-only save goes to
            ``{project_dir}/model_only/checkpoint_{n}``, numbered apart.
        model_only: write only the model files (+ ``config.json`` for a model with a config) and the manifest.
        project_dir: root for automatic naming; defaults to the current directory.
        total_limit: with automatic naming, keep only the newest ``total_limit`` checkpoints of the kind saved
            (full checkpoints and model-only snapshots are counted apart; numeric order), removed after the new
            one is committed.
        step: a training step counter stored with the RNG states and in the manifest.
        durable: fsync every file and folder before returning (default True; False is faster, not crash-safe).
        threads: writer threads; 0 picks min(8, cores).
        max_shard_size: None writes one file per model / optimizer; an int (bytes) or a string with Hugging Face's
            units (``"10GB"`` = 10 * 10**9 bytes, ``"10GiB"`` = 10 * 2**30) splits larger ones into
            ``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json`` (likewise ``optimizer-...``),
            written in parallel.
        compat: None (fastckpt's pickle-free layout) or ``"accelerate"``: exactly the files
            ``Accelerator.save_state`` writes (``optimizer.bin``, ``scheduler.bin``, ``random_states_0.pkl`` are
            pickles; ``model.safetensors`` unsharded) plus the manifest, so stock ``Accelerator.load_state``
            restores it.
        async_save: every mode commits exactly the state at the call or raises
            ``ConcurrentModificationError`` (committing nothing; the previous checkpoint stays), except for the one
            limit of ``"stream"`` (see :mod:`fastckpt._io.async_save.modes`). ``True``: on the CPU, return once the
            module buffers, small tensors and unowned parameters are copied and every parameter and optimizer
            state tensor is hashed (xxh3-128, in parallel, GIL released; reads the state once, no copy); they
            are written in the background straight from the live tensors, each passed optimizer's next
            ``step()`` first copies only its tensors not yet written, and a tensor written with other bytes
            than it held at the call (changed by ``p.data``, a ``.numpy()`` view, another thread, or in place
            outside ``step()``) fails the save. With CUDA tensors ``True`` enqueues the device-to-host copies of
            the whole state on a side stream the caller's stream waits for (the host is not blocked).
            ``"stream"``: as ``True`` on the CPU without the hashes (version counters and a crc32c re-check
            only); its limit: a write that bypasses torch's version counters (``p.data``, a ``.numpy()`` view,
            raw pointers) after the call and before the tensor is written is not detected and is saved. On CUDA
            it copies on a side stream the caller's stream does not wait for, so such writes race the copies.
            ``"snapshot"``: copy the whole state into a reused host buffer pool at the call, then write in the
            background (see :mod:`fastckpt._io.async_save.writer`). At most one async save is in flight: a second
            one waits for the first to be written.
        host_memory_budget: with ``async_save=True`` or ``"stream"``, host bytes (pinned with CUDA) the save may hold for
            copies (an int, or ``"4GB"``, ``"512MiB"``); None: as needed, at most the state's size. Below what a
            step must copy, the step copies what fits and waits for the writer to write the rest. The buffers are
            reused across saves and freed by :func:`fastckpt.release_buffers` or after 60 s without a save.
        trainable_only: write only the parameters with ``requires_grad`` (and ``trainable_buffers``), plus the
            optimizer state (which covers only those); the frozen rest is recorded in the manifest by name, dtype,
            shape and xxh3-128 content hash, and checked when the checkpoint is loaded into a model built from
            the same base (see :mod:`fastckpt._state.trainable`). With ``model_only`` on a ``peft.PeftModel``:
            ``adapter_model.safetensors`` + ``adapter_config.json`` as ``PeftModel.save_pretrained`` writes them.
        trainable_buffers: buffer fqns a ``trainable_only`` save writes too (e.g. BatchNorm running stats).
        dtype: ``model_only`` saves only: ``torch.bfloat16``, ``float16``, ``float32`` or ``float64``; floating
            tensors are converted while written, chunk by chunk in the core (round to nearest even, as
            ``Tensor.to``), with no converted copy in memory; integer and bool tensors are stored unchanged. The
            manifest and ``config.json`` record the dtype.
        share_unchanged: with automatic naming (``output_dir=None``) or an ``output_dir`` inside ``project_dir``'s
            ``checkpoints``: frozen tensors go to shard files of their own, and a shard whose tensors all equal
            the previous checkpoint's (name, dtype, shape, xxh3-128) is hard-linked from it instead of written
            (see :mod:`fastckpt._io.storage.local.sharing`).
        timeout: sharded (DTensor / FSDP2) saves: seconds each process waits for the others at each step before
            raising :class:`~fastckpt.errors.CollectiveTimeoutError` (a process died or never called save_state).
        storage_options: for ``s3://`` locations: S3 settings over the ``AWS_*`` environment (``endpoint_url``,
            ``region``, ``access_key_id``, ``secret_access_key``, ``session_token``, ``allow_http``, ...; object_store's
            keys) and the transfer: ``part_size`` (bytes, default 16 MiB), ``concurrency`` (requests in flight,
            default 16), ``max_retries`` (default 10), ``retry_timeout`` (seconds, default 180), ``retry_backoff``
            (first backoff in seconds, default 0.1, doubling up to 15 s).
        remote: an ``s3://`` URL for a tiered save: the checkpoint is committed locally first (as without it,
            ``async_save`` included), then that folder is uploaded in the background and committed at ``remote``
            (with automatic naming ``remote`` is a project prefix and the local name is used under it:
            ``{remote}/checkpoints/checkpoint_{n}``; ``total_limit`` rotates both tiers, the remote one after the
            newer remote commit). Returns a :class:`~fastckpt._io.storage.tiered.upload.TieredSave`; until its upload
            committed, the previous remote checkpoint is the latest. The next tiered save first waits for the
            upload in flight (raising its error if no ``wait()`` did).

    Object storage: ``output_dir="s3://bucket/prefix"`` (or ``project_dir="s3://bucket/run"`` for automatic naming
    and ``total_limit`` rotation) uploads every file under a new save-id prefix straight from the tensors' memory
    (parallel multipart uploads, each part serialized into its request body as it goes out: about
    ``concurrency * part_size`` bytes in flight; crc32c summed on the way; tensors on a GPU are first copied into
    the host buffer pool, as for a local save of them, and uploaded from there) and commits by creating ``prefix/manifests/{n}.json`` last with a
    conditional put; older saves' objects are deleted only after that (see
    :mod:`fastckpt._io.storage.object.commit`). With ``async_save`` (any mode) the state is copied into the host buffer
    pool at the call (a snapshot: the call costs about one memcpy of the state, CUDA tensors included) and uploaded
    from that copy on the writer thread; ``wait()`` returns the URL once the manifest object exists (not for
    sharded models yet). Not with ``share_unchanged`` yet.

    Sharded models (FSDP2 ``fully_shard``, any DTensor parameter): every process calls ``save_state`` with the same
    arguments; the shards are written through torch.distributed.checkpoint into the checkpoint's staging folder
    beside the scheduler/optimizer JSON, one RNG file per process and the manifest, committed once (see
    :mod:`fastckpt._plan.sharded_save`). ``max_shard_size`` (but for ``model_only``), ``compat``, ``async_save``
    and ``remote`` do not apply to them. To ``s3://`` no disk is shared: every process uploads its own shards
    straight from memory under the save's prefix and the main process uploads the small files and commits the
    manifest object (the same manifest as a local sharded save); a failure on any process commits nothing and
    raises on every process. A ``model_only`` save to ``s3://`` gathers each model's full state dict into the main
    process's CPU memory (one all-gather per tensor, on the model's process group, without ``timeout``) and
    uploads what a one-process model-only save uploads.

    Returns:
        The committed checkpoint folder; with ``async_save``, an :class:`~fastckpt._io.async_save.writer.AsyncSave` handle whose
        ``wait()`` returns it once committed; for ``s3://``, the checkpoint's URL (a ``str``); with ``remote``, a
        :class:`~fastckpt._io.storage.tiered.upload.TieredSave` (``wait_local()``, ``wait()`` for the remote commit).

    Raises:
        OptionTypeError: a flag (``model_only``, ``durable``, ``trainable_only``, ``share_unchanged``) that is not
            True or False, or an ``output_dir`` that is no path; OptionError (a ValueError): a bad ``threads``,
            ``step`` or ``total_limit``. Raised before anything is written.
        DtypeError: a tensor dtype the format cannot store (names the tensor).
        TypeError: scheduler / optimizer state that cannot be stored without pickle (names its path).
        ValueError: a bad ``max_shard_size`` or ``compat``, or both ``max_shard_size`` and ``compat="accelerate"``;
            ``dtype`` without ``model_only`` or not a floating dtype.
        FrozenWeightsError: never on save (see :func:`load_state`).
        DestinationNotWritableError: a local ``output_dir`` (or project folder) whose folder cannot be made or takes
            no new files (read-only, full, no permission, ``/proc``): raised at the call in every ``async_save`` mode
            as in a synchronous save, before anything is written or copied, naming the folder given; nothing is
            left behind and nothing is reported later. Also the builtin OSError subclass of its errno
            (``PermissionError``, ``FileNotFoundError``). ``NotADirectoryError``: ``output_dir`` is a file or lies
            under one (at the call too). Over ``s3://`` a missing bucket is found by the upload (for an async save,
            on the writer thread).
        OSError: the folder cannot be written; nothing is left behind and the previous checkpoint is intact. For
            ``s3://``: the store failed after the bounded retries (names the object); nothing is committed.
        ConcurrentSaveError: (``s3://``) another save committed the same checkpoint first; its state is the one there.
        ValueError: a URL of a scheme fastckpt does not serve (``gs://``, ``hf://``, ``file://``...), before
            anything is written; a bad ``storage_options`` key or value.
        CollectiveTimeoutError: (sharded) another process did not take part within ``timeout`` (names it and the
            step); CheckpointError: (sharded) another process failed (names it); the previous checkpoint is intact.
        Exception: an earlier async save failed and its exception was not yet raised by ``wait()``: it is
            raised here, once (this save is then not made).

    Example:
        >>> path = fastckpt.save_state(model, optimizer, scheduler, output_dir="ckpt")
        >>> fastckpt.save_state(model, model_only=True, output_dir="weights")
        >>> handle = fastckpt.save_state(model, optimizer, output_dir="ckpt", async_save=True)
        >>> optimizer.step()  # training goes on; the checkpoint keeps the values as of the call
        >>> handle.wait()
    """
    storage = resolve(output_dir, project_dir=project_dir, storage_options=storage_options, remote=remote)
    return save_to(storage, model, optimizer, scheduler, model_only=model_only, total_limit=total_limit, step=step,
                durable=durable, threads=threads, max_shard_size=max_shard_size, compat=compat, async_save=async_save,
                trainable_only=trainable_only, trainable_buffers=trainable_buffers, dtype=dtype,
                share_unchanged=share_unchanged, timeout=timeout, host_memory_budget=host_memory_budget)


def load_state(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    scheduler: Any = None,
    *,
    input_dir: str | os.PathLike[str] | None = None,
    model_only: bool = False,
    strict: bool = True,
    map_location: str | torch.device | None = None,
    project_dir: str | os.PathLike[str] | None = None,
    threads: int = 0,
    trust_pickle: bool = False,
    verify: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    cast: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> LoadResult:
    """Restore a state saved by :func:`save_state` (or by stock ``Accelerator.save_state``): validate, then apply.

    A folder without ``fastckpt.json`` that holds accelerate's files (``model.safetensors`` or
    ``pytorch_model.bin``, ``optimizer.bin``, ``scheduler.bin``, ``random_states_0.pkl``) is read as accelerate
    wrote it; its optimizer state is keyed by position and must match the live ``param_groups``.

    Args:
        model: a module or a list (the same number as were saved, or fewer).
        optimizer: optimizers to restore (ignored when ``model_only``).
        scheduler: schedulers to restore (ignored when ``model_only``).
        input_dir: the checkpoint folder; None picks the latest committed ``{project_dir}/checkpoints/checkpoint_N``
            (for a full load the latest one saved in full).
        model_only: read only the model weights (works on model-only and full checkpoints).
        strict: raise on missing / unexpected model keys, and on live parameters that the saved optimizer
            ``param_groups`` do not cover; with False those are reported / start fresh.
        map_location: device for optimizer state tensors before torch places them; None: where the objects
            live (model weights always land on their parameter's device; ``step`` where torch keeps it).
        project_dir: root for ``input_dir=None``; defaults to the current directory.
        threads: reader threads; 0 picks min(8, cores).
        trust_pickle: accelerate's files only: they are read with ``torch.load(weights_only=True)`` and
            accelerate's allowlist of numpy globals; True allows full unpickling for files that need it (a pickled
            sampler, numpy scalars in a scheduler). Full unpickling can run arbitrary code.
        verify: check every byte the load reads against the crc32c checksums recorded in ``fastckpt.json`` (each
            tensor's, each file's), summed by the Rust core as the bytes come in, before any of them reaches a live
            tensor: a mismatch raises IntegrityError naming the file and tensor and nothing is changed. False
            skips the sums (sizes, headers and the small JSON files are still checked); a checkpoint without
            recorded checksums (stock accelerate's) has nothing to check. The files the load does not read are
            not checked: :func:`fastckpt.verify_checkpoint` checks a whole folder (and the xxh3-128 hashes).
        timeout: sharded checkpoints with several processes: seconds each process waits for the others at each
            step before raising :class:`~fastckpt.errors.CollectiveTimeoutError`.

    A sharded checkpoint (saved from DTensor / FSDP2 models) loads on any number of processes (DCP reshards it)
    and into plain models in one process without a process group; every process calls ``load_state`` with the same
    arguments, and a failure on any process raises on every process before anything changes.
        cast: model weights stored in another dtype (an fp32 checkpoint into a bf16 / fp16 model) are cast to the
            live parameter's dtype, as torch's ``load_state_dict`` does; default False refuses them (DtypeError).
        storage_options: for an ``s3://`` ``input_dir`` / ``project_dir``: see :func:`save_state`. The newest
            committed manifest is read, every object it lists is checked to exist with its recorded size (an object
            it does not list is refused), read into memory by ranged parallel reads (nothing is written to local
            disk) with its crc32c summed as the bytes come in and checked (IntegrityError naming the object and
            tensor; always, whatever ``verify`` says), then loaded as a local folder: nothing live changes before
            every object checked. Sharded models: the main process picks the committed save, every process reads
            all of that save's objects (CheckpointChangedError if another save was committed meanwhile), every
            process agrees (a damaged object raises on every process), then the sharded load runs on it.

    Returns:
        ``LoadResult(missing_keys, unexpected_keys)`` for the model(s).

    Raises:
        OptionTypeError: a flag (``model_only``, ``strict``, ``trust_pickle``, ``verify``, ``cast``) that is not True
            or False, or an ``input_dir`` that is no path; OptionError (a ValueError): a bad ``threads`` or
            ``map_location``. Raised before anything is read.
        MissingStateError: no checkpoint, or a part asked for is absent (a full load of a model-only
            checkpoint names the missing files); raised before anything is changed.
        KeyMismatchError: ``strict`` and model keys differ (both lists named), or optimizer coverage fails.
        ShapeMismatchError / DtypeError: a stored tensor does not fit its destination (no silent casts; the
            DtypeError names ``cast=True``), or a destination cannot be written (an expanded tensor).
        FrozenWeightsError: a ``trainable_only`` checkpoint and ``strict``: a frozen tensor of the model is absent
            or differs (dtype, shape or xxh3-128 content) from the one it was saved with; names the first.
            ``strict=False`` skips the check and reports the frozen names as missing keys.
        HeaderError / TruncatedFileError / IntegrityError: a damaged checkpoint, or a shard index that disagrees with
            its shards; a shard index naming absent shards raises MissingStateError listing all of them.
        UnsafePickleError: an accelerate file needs full unpickling and ``trust_pickle`` is False.
        CheckpointChangedError: other saves replaced the folder while it was being read, 5 times in a row (each
            time the load started over; every file of a load comes from one save, see :mod:`fastckpt._io.storage.local.folder`).
        RngRestoreWarning (warning): RNG states for CUDA devices this machine lacks are skipped; a process whose
            rank the sharded save did not have keeps its RNG states; a checkpoint saved by more processes than this
            run has: the warning names the ``random_states_{rank}`` files not restored.
        CollectiveTimeoutError: another process did not take part within ``timeout`` (names it and the step).
        CheckpointError: another process failed (names it and its error); nothing changed here.
    """
    if model is None:
        raise OptionTypeError("model is None; pass the torch.nn.Module (or a list of them) to load into")
    _check_flags(model_only=model_only, strict=strict, trust_pickle=trust_pickle, verify=verify, cast=cast)
    _check_common(threads)
    _check_map_location(map_location)
    models, optimizers, schedulers = (_as_list(model, "model"), _as_list(optimizer, "optimizer"),
                                      _as_list(scheduler, "scheduler"))
    timeout = check_timeout(timeout)
    storage = resolve(input_dir, project_dir=project_dir, storage_options=storage_options, what="input_dir")
    wait_for_saves_to(storage.root)  # async saves to it, in flight
    if is_sharded(models):  # a sharded plan: DCP reads each rank's shards
        return LoadResult(*load_sharded(storage, models, optimizers, schedulers, model_only=model_only,
                                        strict=strict, threads=threads, verify=verify, timeout=timeout))
    started = time.perf_counter()
    for attempt in range(RETRIES):  # another save may replace the folder while phase 1 reads it: start over
        try:
            with storage.open(model_only=model_only, verify=verify, threads=threads) as view:
                manifest = view.manifest  # read once, when the storage opened the view; handed down
                if is_sharded_checkpoint(view.path, manifest):  # saved sharded, loaded into plain models
                    return LoadResult(*load_sharded_state(
                        view.path, models, optimizers, schedulers, model_only=model_only, strict=strict,
                        threads=threads, verify=verify and not view.checked, timeout=timeout))
                if attempt == 0 and not model_only and not is_distributed():  # random_states_0 only is restored
                    warn_unrestored(view.path, 1)
                plan = plan_load(view.folder, models, optimizers, schedulers, model_only=model_only, strict=strict,
                                 map_location=map_location, trust_pickle=trust_pickle, cast=cast, manifest=manifest)
                files = opened_files(view.folder)
            break
        except CheckpointChangedError:
            if attempt == RETRIES - 1:
                raise
    plan.apply(threads=threads)
    log_load(view.path, len(files), sum(files.values()), time.perf_counter() - started, model_only=model_only)
    return LoadResult(plan.missing_keys, plan.unexpected_keys, plan.skipped)


def latest_checkpoint(project_dir: str | os.PathLike[str] | None = None, *, model_only: bool = False,
                      storage_options: Mapping[str, Any] | None = None) -> Path | str | None:
    """The newest committed checkpoint (largest number, numeric order), or None.

    ``project_dir`` defaults to the current directory; an ``s3://bucket/prefix`` project gives an ``s3://`` URL
    (only checkpoints whose manifest object is committed count). Without ``model_only``: the newest *full*
    checkpoint in ``{project_dir}/checkpoints`` (what a full ``load_state(input_dir=None)`` resumes from); with it:
    the newest model-only snapshot in ``{project_dir}/model_only``. Unfinished saves are never chosen; stock
    accelerate checkpoints count.

    Raises:
        ValueError: a URL of a scheme fastckpt does not serve.
    """
    storage = resolve(None, project_dir=project_dir, storage_options=storage_options, what="project_dir")
    found = newest(storage, model_only=model_only)
    return None if found is None else found.named


def verify_checkpoint(folder: str | os.PathLike[str], *, threads: int = 0, progress: Any = None,
                      storage_options: Mapping[str, Any] | None = None) -> VerifyReport:
    """Check every file of a checkpoint against the sizes and crc32c checksums its manifest records.

    An ``s3://`` checkpoint is read in full: every object's size and crc32c against its manifest object, then
    every tensor as for a local folder.

    Raises:
        IntegrityError: a file (object) is missing, has another size, or a file or tensor has another crc32c than
            recorded; the message lists every problem with the file, the tensor and both values.
        MissingStateError, HeaderError, OSError: no manifest, a malformed one, a file that cannot be read.

    Example:
        >>> fastckpt.verify_checkpoint("checkpoints/checkpoint_3").tensors_checked
        42
    """
    if folder is None:  # None would name the project's newest checkpoint: verify_checkpoint wants one checkpoint
        raise OptionTypeError("folder is None; pass the checkpoint folder (or its s3:// URL) to verify")
    storage = resolve(folder, storage_options=storage_options, what="folder")
    with storage.as_local() as view:  # an s3:// checkpoint: fetched and checked into memory; errors name the URL
        report = _verify_local(view.path, threads=threads, progress=progress)
    report.folder = view.named  # a fetched copy is gone once this returns
    return report

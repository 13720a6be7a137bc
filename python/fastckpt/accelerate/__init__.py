"""``Accelerator.save_state`` / ``load_state`` done by fastckpt: change one call in an accelerate training loop.

    accelerator.save_state("ckpt")                       ->  fastckpt.accelerate.save_state(accelerator, "ckpt")
    accelerator.load_state("ckpt")                       ->  fastckpt.accelerate.load_state(accelerator, "ckpt")

Everything the Accelerator tracks is saved, as ``Accelerator.save_state`` saves it: every prepared model, optimizer
and scheduler (``model.safetensors``, ``model_1...``), objects registered with ``register_for_checkpointing``, the
GradScaler, dataloader/sampler state, one RNG file per process, and the registered save/load pre-hooks run with the
same arguments. What changes: no pickle (unless ``compat="accelerate"``), files written in parallel and committed
atomically, ``model_only`` on both sides, loads validated before anything changes, RNG restore failures raised, and
``ProjectConfiguration``'s ``iteration`` restored on load (numeric ``total_limit`` rotation after the commit), so the
next automatic save neither clashes with nor deletes the wrong folder.

Several processes (``torchrun`` / ``accelerate launch``): every process calls these functions. On save the main
process writes the shared files and every process's ``random_states_{rank}`` file (gathered to it) in one atomic
commit; a broadcast of the outcome ends the save on every process (the barrier), and all raise if it failed. On load
every process reads the shared files and its own RNG file; if any process finds a problem, all raise before any
object changes. No step waits forever: a process that died or never called the function makes the others raise
:class:`~fastckpt.errors.CollectiveTimeoutError` within ``timeout`` seconds.

The diffusers pattern, ``if accelerator.is_main_process: fastckpt.accelerate.save_state(accelerator, path)``, works
as with stock accelerate: when none of the other processes joins the save within
:data:`fastckpt._io.group.participation.GRACE` seconds (3 s), the main process saves alone (the shared files and its own
``random_states_0`` file; a later load on several processes warns on the others that their RNG states were not
saved and keeps them). A sharded FSDP2 model cannot be saved that way (every process holds part of its state): the
main process says so after those seconds instead of waiting out ``timeout``.

:func:`checkpoint_manager` gives an accelerate loop a :class:`fastckpt.CheckpointManager` over the same objects
(periodic and preemption saves, the memory tier; see :mod:`fastckpt.accelerate.manager`).

FSDP2 (``DistributedType.FSDP``, ``fsdp_version=2``): with ``SHARDED_STATE_DICT`` every process writes its shards
through torch.distributed.checkpoint into the same atomic commit (see :mod:`fastckpt._plan.sharded_save`), and a
load reshards to any number of processes; with ``FULL_STATE_DICT`` the state is gathered to the main process and
written in the usual single-file layout. FSDP1, DeepSpeed, Megatron-LM and XLA are not handled.

Layer 5 (public). May import every private layer and :mod:`fastckpt.checkpoint`; ``tracked_objects`` holds the
state of objects the Accelerator tracks beyond models, optimizers and schedulers.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, overload

import torch

from fastckpt._io.async_save.writer import AsyncSave, wait_for_saves_to
from fastckpt._io.group.distributed import DEFAULT_TIMEOUT, agree, alone, check_timeout
from fastckpt._io.group.participation import GRACE, participants
from fastckpt._io.log import log_load
from fastckpt._io.storage.local.folder import opened_files, pinned
from fastckpt._io.storage.local.layout import checkpoint_layout, random_states_name
from fastckpt._plan.load import plan_load
from fastckpt._plan.sharded_load import is_sharded_checkpoint
from fastckpt._state.rng import RngRestoreWarning, warn_unrestored
from fastckpt.accelerate.checks import check_save_args, check_supported
from fastckpt.accelerate.fsdp import load_sharded_state, plan_full
from fastckpt.accelerate.location import (
    check_remote_save,
    check_total_limit,
    checkpoint_storage,
    fetched_on_every_rank,
    set_iteration,
)
from fastckpt.accelerate.manager import checkpoint_manager
from fastckpt.accelerate.saving import DEFAULT_MAX_SHARD_SIZE, UNSET, save_tracked
from fastckpt.checkpoint import LoadResult
from fastckpt.errors import CheckpointError

__all__ = ["save_state", "load_state", "checkpoint_manager", "DEFAULT_MAX_SHARD_SIZE"]

_DEFAULT = UNSET


@overload
def save_state(accelerator: Any, output_dir: str | os.PathLike[str] | None = ..., *, model_only: bool = ...,
               compat: str | None = ..., max_shard_size: int | str | None = ..., durable: bool = ..., threads: int = ...,
               trainable_only: bool = ..., trainable_buffers: Sequence[str] = ..., dtype: torch.dtype | None = ...,
               share_unchanged: bool = ..., timeout: float = ..., async_save: Literal[False] = ...,
               host_memory_budget: int | str | None = ...) -> Path: ...
@overload
def save_state(accelerator: Any, output_dir: str | os.PathLike[str] | None = ..., *, model_only: bool = ...,
               compat: str | None = ..., max_shard_size: int | str | None = ..., durable: bool = ..., threads: int = ...,
               trainable_only: bool = ..., trainable_buffers: Sequence[str] = ..., dtype: torch.dtype | None = ...,
               share_unchanged: bool = ..., timeout: float = ..., async_save: Literal[True, "stream", "snapshot"],
               host_memory_budget: int | str | None = ...) -> AsyncSave: ...
@overload
def save_state(accelerator: Any, output_dir: str | os.PathLike[str] | None = ..., *, model_only: bool = ...,
               compat: str | None = ..., max_shard_size: int | str | None = ..., durable: bool = ..., threads: int = ...,
               trainable_only: bool = ..., trainable_buffers: Sequence[str] = ..., dtype: torch.dtype | None = ...,
               share_unchanged: bool = ..., timeout: float = ..., async_save: bool | str = ...,
               host_memory_budget: int | str | None = ...) -> Path | AsyncSave: ...


def save_state(
    accelerator: Any,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    model_only: bool = False,
    compat: str | None = None,
    max_shard_size: int | str | None = _DEFAULT,
    durable: bool = True,
    threads: int = 0,
    trainable_only: bool = False,
    trainable_buffers: Sequence[str] = (),
    dtype: torch.dtype | None = None,
    share_unchanged: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    async_save: bool | str = False,
    host_memory_budget: int | str | None = None,
) -> Path | AsyncSave | str:
    """Save everything ``accelerator`` tracks (or only the model weights) to a checkpoint folder, crash-safely.

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare``.
        output_dir: the checkpoint folder (replaced atomically if it exists); always used when given (no
            rotation then). None with ``ProjectConfiguration(automatic_checkpoint_naming=True)``: a full save goes
            to ``{project_dir}/checkpoints/checkpoint_{n}`` with n = max(``iteration``, largest committed + 1), a
            model-only save to ``{project_dir}/model_only/checkpoint_{n}`` (numbered apart, ``iteration``
            unchanged); ``total_limit`` then removes the oldest committed ones of that kind (numeric order) after
            the commit, so model-only snapshots never rotate full checkpoints away.
        model_only: write only the model weights (+ ``config.json`` for a transformers model); optimizers,
            schedulers, RNG and registered objects are not read.
        compat: None (fastckpt's layout, no pickle) or ``"accelerate"``: exactly the files
            ``Accelerator.save_state`` writes (plus ``fastckpt.json``), so stock ``Accelerator.load_state`` reads it.
        max_shard_size: split model and optimizer files over this size (bytes, or ``"10GB"`` / ``"10GiB"``);
            default ``"10GB"`` (accelerate's), None for one file each. Not with ``compat="accelerate"``.
        durable: fsync files and folders before returning (default True).
        threads: writer threads; 0 picks min(8, cores).
        trainable_only, trainable_buffers, dtype: as :func:`fastckpt.save_state` (only parameters with
            ``requires_grad``, frozen ones recorded and checked on load; ``dtype`` for model-only exports).
        share_unchanged: as :func:`fastckpt.save_state`: frozen tensors in shards of their own, hard-linked from
            the previous checkpoint of ``project_dir`` when unchanged. Not with ``compat="accelerate"``.
        timeout: seconds each process waits for the others at any step before raising
            :class:`~fastckpt.errors.CollectiveTimeoutError` (a process died, or some but not all called save_state).
        async_save: as :func:`fastckpt.save_state`: ``True`` streams parameters and optimizer state in the
            background (each prepared optimizer's next ``step()`` waits only for its tensors not yet written)
            after hashing them at the call, and fails the save if any was written with other bytes (CUDA: a
            snapshot the caller's stream waits for); ``"stream"`` skips the hashes (a write that bypasses torch's
            version counters, such as ``p.data``, after the call is then saved undetected); ``"snapshot"``
            copies the whole state at the call. Every process gets an ``AsyncSave`` handle that
            completes after the one atomic commit on the main process (and raises on every process if it failed).
        host_memory_budget: as :func:`fastckpt.save_state` (with ``async_save=True`` or ``"stream"``).

    Object storage: ``output_dir="s3://bucket/prefix"``, or ``ProjectConfiguration(project_dir="s3://bucket/run",
    automatic_checkpoint_naming=True, total_limit=...)`` with ``output_dir=None`` (numbered and rotated by
    committed manifests): the main process uploads every process's files (one RNG file per process) from memory
    as one commit, the manifest object last (see :mod:`fastckpt.accelerate.location`; S3 settings from the
    ``AWS_*`` environment); FSDP2 states too (every process uploads its own shards). Not with ``async_save``,
    ``share_unchanged`` or save-state pre-hooks (ValueError).

    Returns:
        The committed checkpoint folder (the same on every process); with ``async_save``, an ``AsyncSave``; for
        ``s3://``, the checkpoint's URL (a ``str``).

    Raises:
        ValueError: no ``output_dir`` without automatic naming; a bad ``compat`` / ``max_shard_size``; with
            automatic naming, a ``ProjectConfiguration.total_limit`` below 1 (before anything is written).
        NotImplementedError: DeepSpeed, FSDP1, Megatron-LM or XLA (the message says what to use instead).
        CollectiveTimeoutError: another process did not take part within ``timeout`` (names it and the step).
        TypeError: state that cannot be stored without pickle (fastckpt layout; names its path).
        KeyMismatchError, DtypeError, OSError: as :func:`fastckpt.save_state`; nothing is left behind.
        DestinationNotWritableError: as :func:`fastckpt.save_state`: a folder that takes no files fails the call in
            every ``async_save`` mode in a single process; with several processes every process's handle raises
            it (CheckpointError naming it on the others), so that no process is left alone in a collective.
        CheckpointError: on the other processes when the main process failed (names its error); on the main
            process when it alone called save_state for an FSDP2 model (sharded or gathered state needs every
            process).

    Called on the main process only (``if accelerator.is_main_process:``, the diffusers examples), the main process
    saves alone once no other process has joined within 3 s (:mod:`fastckpt._io.group.participation`): the shared files
    and ``random_states_0`` only, as stock accelerate writes them there. Called on every process, it is the one
    atomic commit of every process's files.

    Example:
        >>> model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        >>> path = fastckpt.accelerate.save_state(accelerator, "ckpt")
        >>> if accelerator.is_main_process:  # also works: the main process's files and RNG state
        ...     fastckpt.accelerate.save_state(accelerator, "ckpt")
    """
    return save_with_files(accelerator, output_dir, model_only=model_only, compat=compat,
                           max_shard_size=max_shard_size, durable=durable, threads=threads,
                           trainable_only=trainable_only, trainable_buffers=trainable_buffers, dtype=dtype,
                           share_unchanged=share_unchanged, timeout=timeout, async_save=async_save,
                           host_memory_budget=host_memory_budget)


def save_with_files(accelerator: Any, output_dir: Any, *, files: dict[str, str | bytes] | None = None,
                    after_commit: Callable[[Path], None] | None = None, every_process: bool = False,
                    model_only: bool = False,
                    compat: str | None = None, max_shard_size: Any = _DEFAULT, durable: bool = True,
                    threads: int = 0, trainable_only: bool = False, trainable_buffers: Sequence[str] = (),
                    dtype: Any = None, share_unchanged: bool = False, timeout: float = DEFAULT_TIMEOUT,
                    async_save: bool | str = False, host_memory_budget: Any = None) -> Path | AsyncSave:
    """:func:`save_state` for adapters built on it (:mod:`fastckpt.transformers`): ``files`` (name -> text or
    bytes, written by the main process) go into the same atomic commit, listed and checksummed in the manifest;
    ``after_commit(folder)`` runs on the main process once the checkpoint is committed (on the writer thread for
    async saves), e.g. to rotate older checkpoints; ``every_process=True``: the caller knows every process calls
    this save (Trainer does), so the main process does not check who joins (no main-process-only save). Other
    arguments: as :func:`save_state`."""
    storage = checkpoint_storage(accelerator, output_dir, "output_dir")
    fsdp = check_supported(accelerator)
    timeout = check_timeout(timeout)
    check_remote_save(storage, fsdp=fsdp, async_save=async_save, share_unchanged=share_unchanged,
                      hooks=list(accelerator._save_model_state_pre_hook.values()))
    check_save_args(fsdp, compat=compat, trainable_only=trainable_only, dtype=dtype, share_unchanged=share_unchanged,
                     async_save=async_save, extras=bool(files) or after_commit is not None)
    check_total_limit(accelerator, output_dir)
    kwargs = dict(model_only=model_only, compat=compat, max_shard_size=max_shard_size, durable=durable,
                  threads=threads, trainable_only=trainable_only, trainable_buffers=trainable_buffers, dtype=dtype,
                  share_unchanged=share_unchanged, timeout=timeout, async_save=async_save,
                  host_memory_budget=host_memory_budget, files=files, after_commit=after_commit,
                  storage=storage)
    what = f"save_state to {output_dir}" if output_dir is not None else "save_state"
    if every_process or participants(what, timeout) == "all":
        return save_tracked(accelerator, output_dir, fsdp, **kwargs)
    if fsdp is not None:  # the state is sharded or gathered: every process holds part of it
        raise CheckpointError(
            f"{what}: called on the main process only, but the model is sharded (FSDP2 {fsdp}): every process "
            f"holds part of its state, so every process must call fastckpt.accelerate.save_state (none of the "
            f"other {accelerator.num_processes - 1} joined within {min(GRACE, timeout):g} s); "
            "call it outside `if accelerator.is_main_process:`")
    with alone():  # the diffusers pattern: the main process's files and its RNG file, as stock accelerate writes
        return save_tracked(accelerator, output_dir, fsdp, **kwargs)


def _rng_rank(folder: Path, layout: str, rank: int) -> int | None:
    """This process's rank, or None (with a warning) when the checkpoint was saved by fewer processes."""
    name = f"random_states_{rank}.pkl" if layout == "accelerate" else random_states_name(rank)
    first = "random_states_0.pkl" if layout == "accelerate" else random_states_name(0)
    if rank > 0 and not (folder / name).is_file() and (folder / first).is_file():
        warnings.warn(f"{folder}: holds no {name} (saved by fewer processes); process {rank} keeps its RNG states",
                      RngRestoreWarning, stacklevel=3)
        return None
    return rank


def load_state(
    accelerator: Any,
    input_dir: str | os.PathLike[str] | None = None,
    *,
    model_only: bool = False,
    strict: bool = True,
    map_location: Any = None,
    trust_pickle: bool = False,
    threads: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    cast: bool = False,
) -> LoadResult:
    """Restore everything ``accelerator`` tracks from a fastckpt or a stock accelerate checkpoint.

    Args:
        accelerator: the ``accelerate.Accelerator``, with the same objects prepared and registered as when saving.
        input_dir: the checkpoint folder; None: the latest committed ``{project_dir}/checkpoints/checkpoint_N``
            (numeric order; for a full load the latest saved in full; stock accelerate folders count, unfinished
            saves never do).
        model_only: restore only the model weights (from a model-only or a full checkpoint); ``accelerator.step``,
            RNG states and everything else are left as they are.
        strict: as :func:`fastckpt.load_state` (model keys; optimizer coverage).
        map_location: device for optimizer state before torch places it (None: where the parameters live).
        trust_pickle: accelerate's files only: allow full unpickling where ``weights_only=True`` with accelerate's
            allowlist refuses a file (a pickled sampler or custom object). It can run arbitrary code.
        threads: reader threads; 0 picks min(8, cores).
        timeout: seconds each process waits for the others at any step (CollectiveTimeoutError after it).
        cast: cast model weights stored in another dtype to the live dtype (as torch's ``load_state_dict``);
            default False refuses them (DtypeError).

    Object storage: an ``s3://`` ``input_dir`` (or, with ``input_dir=None``, an ``s3://`` ``project_dir``: its
    latest committed checkpoint): the main process picks it, every process reads it (crc32c checked) into memory of its own
    (nothing written to local disk), and the processes check they fetched the same committed save before anything is applied.

    Returns:
        ``LoadResult(missing_keys, unexpected_keys)`` for the models. Also sets ``accelerator.step`` from the RNG
        file and, when the folder is ``{project_dir}/checkpoints/checkpoint_N``, ``project_configuration.iteration``
        to N + 1.

    Raises:
        MissingStateError: no checkpoint, or a file the load needs is absent (a full load of a model-only
            checkpoint, a registered object without its file); raised before anything changes.
        KeyMismatchError, ShapeMismatchError, DtypeError, HeaderError, IntegrityError, UnsafePickleError: as
            :func:`fastckpt.load_state`; nothing changed on any process.
        CheckpointError: another process could not validate its part (names it); nothing changed here.
        NotImplementedError: DeepSpeed, FSDP1, Megatron-LM or XLA (the message says what to use instead).
        CollectiveTimeoutError: another process did not take part within ``timeout``.
        RngRestoreWarning (warning): this process has no RNG file (the checkpoint was saved by fewer processes);
            or, on the main process, the checkpoint holds RNG files of ranks this run does not have (saved by more
            processes), named in the warning: they are not restored.

    Example:
        >>> fastckpt.accelerate.load_state(accelerator, "ckpt")
    """
    storage = checkpoint_storage(accelerator, input_dir, "input_dir")
    fsdp = check_supported(accelerator)
    timeout = check_timeout(timeout)
    wait_for_saves_to(storage.root)
    with fetched_on_every_rank(storage, input_dir, model_only=model_only, timeout=timeout) as view:
        result = _load_folder(accelerator, view.path.absolute(), model_only=model_only, strict=strict,
                              map_location=map_location, trust_pickle=trust_pickle, threads=threads,
                              timeout=timeout, cast=cast, fsdp=fsdp)
    set_iteration(accelerator, view)
    return result


def _load_folder(accelerator: Any, folder: Path, *, model_only: bool, strict: bool, map_location: Any,
                 trust_pickle: bool, threads: int, timeout: float, cast: bool, fsdp: str | None) -> LoadResult:
    if not model_only and int(accelerator.process_index) == 0:  # saved by more processes than this run has
        warn_unrestored(folder, int(accelerator.num_processes))
    models = list(accelerator._models)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(models, str(folder))  # a hook may take models out of the list (it loaded them itself)
    targets = [accelerator.unwrap_model(m) for m in models]
    everything = [accelerator.unwrap_model(m) for m in accelerator._models]
    if fsdp == "SHARDED_STATE_DICT" and model_only and not is_sharded_checkpoint(folder):
        fsdp = "FULL_STATE_DICT"  # a model-only save's files (what FSDP2 model-only saves write): full tensors
    if is_sharded_checkpoint(folder) or fsdp == "SHARDED_STATE_DICT":
        result = load_sharded_state(accelerator, folder, targets, model_only=model_only, strict=strict,
                               trust_pickle=trust_pickle, timeout=timeout)
        return result
    plan, error = None, None
    full: list = []
    started = time.perf_counter()
    files: dict[str, int] = {}
    try:
        with pinned(folder) as handle:  # every file is opened through one handle on the folder (one save)
            layout = checkpoint_layout(handle)
            rank = None if model_only else _rng_rank(handle, layout, int(accelerator.process_index))
            optimizers = list(accelerator._optimizers)
            if fsdp == "FULL_STATE_DICT":
                full = plan_full(handle, targets, optimizers, model_only=model_only, strict=strict, layout=layout)
                targets, optimizers = [], []
            plan = plan_load(handle, targets, optimizers, list(accelerator._schedulers),
                             model_only=model_only, strict=strict, map_location=map_location,
                             trust_pickle=trust_pickle, rank=rank, fqn_models=everything, cast=cast)
            if not model_only:
                from fastckpt.accelerate.tracked_objects import plan_tracked_objects

                plan_tracked_objects(plan, handle, accelerator, layout=layout, trust_pickle=trust_pickle)
            files = opened_files(handle)
    except Exception as exc:  # every process learns of it before any object changes
        error = exc
    agree(error, what=f"loading {folder}", timeout=timeout)
    assert plan is not None
    if full:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        for kind, model, *rest in full:
            if kind == "model":
                set_model_state_dict(model, rest[0], options=StateDictOptions(full_state_dict=True, strict=strict))
                plan.missing_keys += rest[1]
                plan.unexpected_keys += rest[2]
            else:
                set_optimizer_state_dict(model, rest[0], rest[1], options=StateDictOptions(full_state_dict=True))
    plan.apply(threads=threads)
    log_load(folder, len(files), sum(files.values()), time.perf_counter() - started, model_only=model_only)
    if plan.rng is not None:
        accelerator.step = plan.rng.step
    return LoadResult(plan.missing_keys, plan.unexpected_keys, plan.skipped)

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
object changes. DeepSpeed, FSDP, Megatron-LM and XLA are not handled (use ``accelerator.save_state``).

Layer 5 (public). May import every private layer and :mod:`fastckpt.checkpoint`; ``tracked_objects`` holds the
state of objects the Accelerator tracks beyond models, optimizers and schedulers.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from fastckpt._io.async_writer import AsyncSave, wait_for_saves_to
from fastckpt._io.distributed import agree, gather_to_main, on_main
from fastckpt._io.layout import checkpoint_layout, checkpoint_numbers, random_states_name, rotate_checkpoints
from fastckpt._plan.load import plan_load
from fastckpt._plan.save import build_save_plan
from fastckpt._state.rng import RngRestoreWarning, rng_payload
from fastckpt.checkpoint import LoadResult
from fastckpt.errors import MissingStateError

__all__ = ["save_state", "load_state", "DEFAULT_MAX_SHARD_SIZE"]

#: accelerate's ``save_model`` default; applies to fastckpt's layout (``compat="accelerate"`` is unsharded).
DEFAULT_MAX_SHARD_SIZE = "10GB"
_UNSUPPORTED = {"DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA"}
_DEFAULT: Any = object()


def _check_supported(accelerator: Any) -> None:
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind in _UNSUPPORTED:
        raise NotImplementedError(
            f"fastckpt.accelerate does not handle DistributedType.{kind} (sharded engine state); "
            "use accelerator.save_state / load_state for it"
        )


def _project_root(accelerator: Any) -> Path:
    return Path(accelerator.project_dir if accelerator.project_dir is not None else os.getcwd()).absolute()


def _choose_target(accelerator: Any, output_dir: Any) -> tuple[Path, int | None]:
    """(target folder, automatic number or None). Runs on the main process."""
    config = accelerator.project_configuration
    if config.automatic_checkpoint_naming:
        numbers = checkpoint_numbers(_project_root(accelerator))
        n = max(int(config.iteration), max(numbers) + 1 if numbers else 0)
        return _project_root(accelerator) / "checkpoints" / f"checkpoint_{n}", n
    if output_dir is None:
        raise ValueError("output_dir is required unless the Accelerator's ProjectConfiguration has "
                         "automatic_checkpoint_naming=True")
    return Path(output_dir).expanduser().absolute(), None


def save_state(
    accelerator: Any,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    model_only: bool = False,
    compat: str | None = None,
    max_shard_size: int | str | None = _DEFAULT,
    durable: bool = True,
    threads: int = 0,
    async_save: bool | str = False,
    host_memory_budget: int | str | None = None,
) -> Path | AsyncSave:
    """Save everything ``accelerator`` tracks (or only the model weights) to a checkpoint folder, crash-safely.

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare``.
        output_dir: the checkpoint folder (replaced atomically if it exists). Ignored, as accelerate ignores it,
            when ``ProjectConfiguration(automatic_checkpoint_naming=True)``: the folder is then
            ``{project_dir}/checkpoints/checkpoint_{n}`` with n = max(``iteration``, largest committed + 1), and
            ``total_limit`` removes the oldest committed checkpoints (numeric order) after the commit.
        model_only: write only the model weights (+ ``config.json`` for a transformers model); optimizers,
            schedulers, RNG and registered objects are not read.
        compat: None (fastckpt's layout, no pickle) or ``"accelerate"``: exactly the files
            ``Accelerator.save_state`` writes (plus ``fastckpt.json``), so stock ``Accelerator.load_state`` reads it.
        max_shard_size: split model and optimizer files over this size (bytes, or ``"10GB"`` / ``"10GiB"``);
            default ``"10GB"`` (accelerate's), None for one file each. Not with ``compat="accelerate"``.
        durable: fsync files and folders before returning (default True).
        threads: writer threads; 0 picks min(8, cores).
        async_save: as :func:`fastckpt.save_state`: ``True`` streams parameters and optimizer state in the
            background (each prepared optimizer's next ``step()`` waits only for its tensors not yet written),
            ``"snapshot"`` copies the whole state at the call. Every process gets an ``AsyncSave`` handle that
            completes after the one atomic commit on the main process (and raises on every process if it failed).
        host_memory_budget: as :func:`fastckpt.save_state` (with ``async_save=True``).

    Returns:
        The committed checkpoint folder (the same on every process); with ``async_save``, an ``AsyncSave``.

    Raises:
        ValueError: no ``output_dir`` without automatic naming; a bad ``compat`` / ``max_shard_size``.
        NotImplementedError: DeepSpeed, FSDP, Megatron-LM or XLA.
        TypeError: state that cannot be stored without pickle (fastckpt layout; names its path).
        KeyMismatchError, DtypeError, OSError: as :func:`fastckpt.save_state`; nothing is left behind.
        CheckpointError: on the other processes when the main process failed (names its error).

    Example:
        >>> model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        >>> path = fastckpt.accelerate.save_state(accelerator, "ckpt")
    """
    _check_supported(accelerator)
    if async_save not in (False, True, "snapshot"):
        raise ValueError(f"async_save must be False, True or 'snapshot', got {async_save!r}")
    if compat not in (None, "accelerate"):
        raise ValueError(f"compat must be None or 'accelerate', got {compat!r}")
    if max_shard_size is _DEFAULT:
        max_shard_size = None if compat else DEFAULT_MAX_SHARD_SIZE
    elif compat and max_shard_size is not None:
        raise ValueError("compat='accelerate' writes an unsharded model.safetensors as Accelerator.save_state does; "
                         "pass max_shard_size=None")
    target, number = on_main(lambda: _choose_target(accelerator, output_dir), what="choosing the checkpoint folder")
    models = list(accelerator._models)
    unwrapped = [accelerator.unwrap_model(m) for m in models]
    if compat:
        weights = [accelerator.get_state_dict(m, unwrap=False) for m in models]
    else:
        weights = [m.state_dict() for m in unwrapped]
    hooks = list(accelerator._save_model_state_pre_hook.values())
    if hooks:
        os.makedirs(target, exist_ok=True)
        for hook in hooks:
            hook(models, weights, str(target))
    step = int(accelerator.step)
    rng = None
    if not model_only:
        if compat:
            from fastckpt._plan.accelerate_format import accelerate_rng_state, torch_save_bytes

            rng = gather_to_main(torch_save_bytes(accelerate_rng_state(step)))
        else:  # tensors travel as numpy arrays: torch's object collectives cannot unpickle tensors reliably
            tensors, metadata = rng_payload(step)
            gathered = gather_to_main(({k: v.cpu().numpy() for k, v in tensors.items()}, metadata))
            rng = None if gathered is None else [({k: torch.from_numpy(a) for k, a in t.items()}, m)
                                                 for t, m in gathered]

    optimizers, schedulers = list(accelerator._optimizers), list(accelerator._schedulers)

    def build() -> Any:
        from fastckpt._plan.accelerate_format import build_accelerate_plan
        from fastckpt.accelerate.tracked_objects import add_tracked_objects

        if compat:
            plan = build_accelerate_plan(unwrapped, optimizers, schedulers, model_only=model_only, step=step,
                                         model_states=weights, rng_pickles=rng)
        else:
            plan = build_save_plan(unwrapped, optimizers, schedulers, model_only=model_only, step=step,
                                   max_shard_size=max_shard_size, model_states=weights, rng_states=rng)
        if not model_only:
            plan.counts["processes"] = len(rng or [])
            add_tracked_objects(plan, accelerator, compat=bool(compat))
        return plan

    def rotate() -> None:
        limit = accelerator.project_configuration.total_limit
        if number is not None and limit is not None:
            rotate_checkpoints(_project_root(accelerator), limit)

    def write() -> Path:
        from fastckpt._io.commit import write_checkpoint

        write_checkpoint(build(), target, durable=durable, threads=threads)
        rotate()
        return target

    if async_save:
        from fastckpt.accelerate.async_save import save_async

        handle = save_async(build, rotate, target, [] if model_only else optimizers, durable=durable,
                            threads=threads, budget=host_memory_budget, mode=async_save)
        config = accelerator.project_configuration
        config.iteration = number + 1 if number is not None else config.iteration + 1
        return handle

    path = on_main(write, what=f"saving {target}")  # the outcome broadcast is the barrier that ends the save
    config = accelerator.project_configuration
    config.iteration = number + 1 if number is not None else config.iteration + 1
    return path


def _resolve(accelerator: Any, input_dir: Any) -> Path:
    if input_dir is not None:
        folder = Path(input_dir).expanduser()
        if not folder.is_dir():
            raise MissingStateError(f"{folder}: no such checkpoint folder")
        return folder.absolute()
    numbers = checkpoint_numbers(_project_root(accelerator))
    if not numbers:
        raise MissingStateError(f"{_project_root(accelerator) / 'checkpoints'}: no committed checkpoint_N to load")
    return numbers[max(numbers)].absolute()


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
) -> LoadResult:
    """Restore everything ``accelerator`` tracks from a fastckpt or a stock accelerate checkpoint.

    Args:
        accelerator: the ``accelerate.Accelerator``, with the same objects prepared and registered as when saving.
        input_dir: the checkpoint folder; None: the latest committed ``{project_dir}/checkpoints/checkpoint_N``
            (numeric order; stock accelerate folders count, unfinished saves never do).
        model_only: restore only the model weights (from a model-only or a full checkpoint); ``accelerator.step``,
            RNG states and everything else are left as they are.
        strict: as :func:`fastckpt.load_state` (model keys; optimizer coverage).
        map_location: device for optimizer state before torch places it (None: where the parameters live).
        trust_pickle: accelerate's files only: allow full unpickling where ``weights_only=True`` with accelerate's
            allowlist refuses a file (a pickled sampler or custom object). It can run arbitrary code.
        threads: reader threads; 0 picks min(8, cores).

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
        NotImplementedError: DeepSpeed, FSDP, Megatron-LM or XLA.
        RngRestoreWarning (warning): this process has no RNG file (the checkpoint was saved by fewer processes).

    Example:
        >>> fastckpt.accelerate.load_state(accelerator, "ckpt")
    """
    _check_supported(accelerator)
    wait_for_saves_to(Path(input_dir).expanduser() if input_dir is not None else _project_root(accelerator) / "checkpoints")
    folder = on_main(lambda: _resolve(accelerator, input_dir), what="finding the checkpoint")
    models = list(accelerator._models)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(models, str(folder))  # a hook may take models out of the list (it loaded them itself)
    targets = [accelerator.unwrap_model(m) for m in models]
    everything = [accelerator.unwrap_model(m) for m in accelerator._models]
    plan, error = None, None
    try:
        layout = checkpoint_layout(folder)
        rank = None if model_only else _rng_rank(folder, layout, int(accelerator.process_index))
        plan = plan_load(folder, targets, list(accelerator._optimizers), list(accelerator._schedulers),
                         model_only=model_only, strict=strict, map_location=map_location, trust_pickle=trust_pickle,
                         rank=rank, fqn_models=everything)
        if not model_only:
            from fastckpt.accelerate.tracked_objects import plan_tracked_objects

            plan_tracked_objects(plan, folder, accelerator, layout=layout, trust_pickle=trust_pickle)
    except Exception as exc:  # every process learns of it before any object changes
        error = exc
    agree(error, what=f"loading {folder}")
    assert plan is not None
    plan.apply(threads=threads)
    if plan.rng is not None:
        accelerator.step = plan.rng.step
    m = re.fullmatch(r"checkpoint_(\d+)", folder.name)
    root = _project_root(accelerator) / "checkpoints"
    if m and folder.parent.resolve() == root.resolve():
        accelerator.project_configuration.iteration = int(m.group(1)) + 1
    return LoadResult(plan.missing_keys, plan.unexpected_keys)

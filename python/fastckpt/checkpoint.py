"""``save_state`` / ``load_state``: a whole training state in one crash-safe, pickle-free checkpoint folder.

The Python side decides *which* tensors go where (the model-only policy, tied weights, optimizer fqns) and hands
only those to the Rust core, which writes every file of the checkpoint in one parallel pass straight from tensor
memory. The folder is assembled in a staging folder beside the target, the manifest is written last, and the
staging folder is put in place in one step (``fastckpt._core.commit_dir``), so a reader sees the previous
checkpoint or the new complete one, never a mix.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch

from fastckpt._io.async_stream import submit_stream
from fastckpt._io.async_writer import AsyncSave, finish_pending, submit, wait_for_saves_to
from fastckpt._io.commit import check_target, write_checkpoint
from fastckpt._io.integrity import verify_checkpoint
from fastckpt._io.layout import next_checkpoint_dir, rotate_checkpoints
from fastckpt._io.snapshot import has_device_tensors
from fastckpt._plan.load import plan_load, resolve_input_dir
from fastckpt._plan.save import build_save_plan

__all__ = ["save_state", "load_state", "LoadResult"]


class LoadResult(NamedTuple):
    """What :func:`load_state` returns, like torch's ``load_state_dict``: names (fqns) not loaded.

    With several models the names carry a ``model_{i}.`` prefix.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


_KIND_CHECKS = {
    "model": (lambda o: isinstance(o, torch.nn.Module), "a torch.nn.Module"),
    "optimizer": (lambda o: isinstance(o, torch.optim.Optimizer)
                  or (hasattr(o, "param_groups") and hasattr(o, "load_state_dict")), "a torch.optim.Optimizer"),
    "scheduler": (lambda o: not isinstance(o, (torch.optim.Optimizer, torch.nn.Module))
                  and hasattr(o, "state_dict") and hasattr(o, "load_state_dict"),
                  "an LR scheduler (an object with state_dict() and load_state_dict())"),
}


def _as_list(obj: Any, kind: str) -> list:
    """``obj`` as a list of ``kind`` objects (one, a list or tuple, or None for none).

    Raises:
        TypeError: an entry is not a ``kind`` (names its position and type; a path passed positionally is the
            usual cause).
    """
    if obj is None:
        return []
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    check, what = _KIND_CHECKS[kind]
    for i, item in enumerate(items):
        if not check(item):
            hint = " (pass folders as output_dir= / input_dir=)" if isinstance(item, (str, os.PathLike)) else ""
            raise TypeError(f"{kind}[{i}] is a {type(item).__name__}, expected {what}{hint}")
    return items


def _check_common(threads: int) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be an int >= 0 (0 picks min(8, cores)), got {threads!r}")


def _check_save_args(model: Any, threads: int, step: int, total_limit: int | None) -> None:
    if model is None:
        raise TypeError("model is None; pass the torch.nn.Module (or a list of them) to save")
    _check_common(threads)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise ValueError(f"step must be an int in [0, 2**63), got {step!r}")
    if total_limit is not None and (isinstance(total_limit, bool) or not isinstance(total_limit, int)
                                    or total_limit < 1):
        raise ValueError(f"total_limit must be an int >= 1 (or None to keep every checkpoint), got {total_limit!r}")


def _check_map_location(map_location: Any) -> None:
    if map_location is None:
        return
    try:
        device = torch.device(map_location)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"map_location {map_location!r} is not a torch device: {exc}") from None
    if device.type == "meta":
        raise ValueError("map_location='meta' would load no data; use a real device or None")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"map_location={map_location!r} but CUDA is not available on this machine")


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
    host_memory_budget: int | str | None = None,
) -> Path | AsyncSave:
    """Save a training state (or only the model weights) to a checkpoint folder, crash-safely.

    Mirrors ``accelerate.Accelerator.save_state``'s layout and file names without pickle; see
    :mod:`fastckpt._io.layout` for the files.

    Args:
        model: a module or a list of modules (``model.safetensors``, ``model_1.safetensors``, ...).
        optimizer: an optimizer, a list, or None. Ignored (never touched) when ``model_only``.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``), a list, or None.
            Ignored when ``model_only``.
        output_dir: the checkpoint folder; replaced atomically if it exists (other files in it are kept).
            None: ``{project_dir}/checkpoints/checkpoint_{n}``, n = largest present + 1.
        model_only: write only the model files (+ ``config.json`` for a model with a config) and the manifest.
        project_dir: root for automatic naming; defaults to the current directory.
        total_limit: with automatic naming, keep only the newest ``total_limit`` checkpoints (numeric order),
            removed after the new one is committed.
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
        async_save: ``True``: return once the module buffers, small tensors and parameters no passed optimizer
            owns are copied; parameters and optimizer state are written in the background straight from the live
            tensors (CUDA: copied on a side stream), and each passed optimizer's next ``step()`` first waits for
            (CPU: copies) only its tensors not yet written. The checkpoint holds the values as of the call; a
            tensor changed in place outside ``step()`` before it was written fails the save with
            ``ConcurrentModificationError`` (see :mod:`fastckpt._io.async_stream`). ``"snapshot"``: copy the
            whole state into a reused host buffer pool at the call, then write in the background (see
            :mod:`fastckpt._io.async_writer`). At most one async save is in flight: a second one waits for the
            first to be written.
        host_memory_budget: with ``async_save=True``, host bytes (pinned with CUDA) the save may hold for
            copies (an int, or ``"4GB"``, ``"512MiB"``); None: as needed, at most the state's size. Below what a
            step must copy, the step copies what fits and waits for the writer to write the rest. The buffers are
            reused across saves and freed by :func:`fastckpt.release_buffers` or after 60 s without a save.

    Returns:
        The committed checkpoint folder; with ``async_save``, an :class:`~fastckpt._io.async_writer.AsyncSave` handle whose
        ``wait()`` returns it once committed.

    Raises:
        KeyMismatchError: an optimizer holds a parameter of no passed model (names its group and shape).
        DtypeError: a tensor dtype the format cannot store (names the tensor).
        TypeError: scheduler / optimizer state that cannot be stored without pickle (names its path).
        ValueError: a bad ``max_shard_size`` or ``compat``, or both ``max_shard_size`` and ``compat="accelerate"``.
        OSError: the folder cannot be written; nothing is left behind and the previous checkpoint is intact.
        Exception: an earlier async save failed and its exception was not yet raised by ``wait()``: it is
            raised here, once (this save is then not made).

    Example:
        >>> path = fastckpt.save_state(model, optimizer, scheduler, output_dir="ckpt")
        >>> fastckpt.save_state(model, model_only=True, output_dir="weights")
        >>> handle = fastckpt.save_state(model, optimizer, output_dir="ckpt", async_save=True)
        >>> optimizer.step()  # training goes on; the checkpoint keeps the values as of the call
        >>> handle.wait()
    """
    if async_save not in (False, True, "snapshot"):
        raise ValueError(f"async_save must be False, True or 'snapshot', got {async_save!r}")
    finish_pending(wait=async_save != "snapshot")  # a streaming save first waits for the one in flight
    _check_save_args(model, threads, step, total_limit)
    models = _as_list(model, "model")
    if output_dir is not None:
        output_dir = check_target(output_dir)
    plan = build_save_plan(models, _as_list(optimizer, "optimizer"), _as_list(scheduler, "scheduler"),
                           model_only=model_only, step=step, max_shard_size=max_shard_size, compat=compat)
    auto = output_dir is None
    root = Path(project_dir if project_dir is not None else os.getcwd())
    target = next_checkpoint_dir(root) if auto else Path(output_dir)
    write = functools.partial(write_checkpoint, durable=durable, threads=threads)
    rotate = functools.partial(rotate_checkpoints, root, total_limit) if auto and total_limit is not None else None
    if async_save is True:  # stream from the live tensors; the optimizers' steps wait for what is not yet safe
        return submit_stream(plan, [] if model_only else _as_list(optimizer, "optimizer"), target.absolute(),
                             write=write, budget=host_memory_budget, auto_named=auto, after=rotate)
    if async_save or has_device_tensors(plan):  # snapshot into the host buffer pool, write on the writer thread
        handle = submit(plan, target.absolute(), write=write, blocking=not async_save, auto_named=auto, after=rotate)
        return handle if async_save else handle.wait()
    write_checkpoint(plan, target, durable=durable, threads=threads)
    if auto and total_limit is not None:
        rotate_checkpoints(root, total_limit)
    return target.absolute()


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
    verify: bool = False,
) -> LoadResult:
    """Restore a state saved by :func:`save_state` (or by stock ``Accelerator.save_state``): validate, then apply.

    A folder without ``fastckpt.json`` that holds accelerate's files (``model.safetensors`` or
    ``pytorch_model.bin``, ``optimizer.bin``, ``scheduler.bin``, ``random_states_0.pkl``) is read as accelerate
    wrote it; its optimizer state is keyed by position and must match the live ``param_groups``.

    Args:
        model: a module or a list (the same number as were saved, or fewer).
        optimizer: optimizers to restore (ignored when ``model_only``).
        scheduler: schedulers to restore (ignored when ``model_only``).
        input_dir: the checkpoint folder; None picks the latest committed ``{project_dir}/checkpoints/checkpoint_N``.
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
        verify: first read every file of the checkpoint and check the sizes and crc32c checksums recorded in
            ``fastckpt.json`` (see :func:`fastckpt.verify_checkpoint`); nothing is applied if one differs.

    Returns:
        ``LoadResult(missing_keys, unexpected_keys)`` for the model(s).

    Raises:
        MissingStateError: no checkpoint, or a part asked for is absent (a full load of a model-only
            checkpoint names the missing files); raised before anything is changed.
        KeyMismatchError: ``strict`` and model keys differ (both lists named), or optimizer coverage fails.
        ShapeMismatchError / DtypeError: a stored tensor does not fit its destination (no silent casts).
        HeaderError / TruncatedFileError / IntegrityError: a damaged checkpoint, or a shard index that disagrees with
            its shards; a shard index naming absent shards raises MissingStateError listing all of them.
        UnsafePickleError: an accelerate file needs full unpickling and ``trust_pickle`` is False.
        RngRestoreWarning (warning): RNG states for CUDA devices this machine lacks are skipped.
    """
    if model is None:
        raise TypeError("model is None; pass the torch.nn.Module (or a list of them) to load into")
    _check_common(threads)
    _check_map_location(map_location)
    models, optimizers, schedulers = (_as_list(model, "model"), _as_list(optimizer, "optimizer"),
                                      _as_list(scheduler, "scheduler"))
    wait_for_saves_to(Path(input_dir) if input_dir is not None
                      else Path(project_dir if project_dir is not None else os.getcwd()) / "checkpoints")
    folder = resolve_input_dir(input_dir, project_dir)
    if verify:
        verify_checkpoint(folder, threads=threads)
    plan = plan_load(folder, models, optimizers, schedulers, model_only=model_only, strict=strict,
                     map_location=map_location, trust_pickle=trust_pickle)
    plan.apply(threads=threads)
    return LoadResult(plan.missing_keys, plan.unexpected_keys)

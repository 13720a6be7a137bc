"""``save_state`` / ``load_state``: a whole training state in one crash-safe, pickle-free checkpoint folder.

The Python side decides *which* tensors go where (the model-only policy, tied weights, optimizer fqns) and hands
only those to the Rust core, which writes every file of the checkpoint in one parallel pass straight from tensor
memory. The folder is assembled in a staging folder beside the target, the manifest is written last, and the
staging folder is put in place in one step (``fastckpt._core.commit_dir``), so a reader sees the previous
checkpoint or the new complete one, never a mix.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch

from . import _core
from ._codec import decode, encode
from ._layout import (
    MANIFEST,
    latest_checkpoint,
    manifest_dict,
    next_checkpoint_dir,
    part_name,
    random_states_name,
    read_manifest,
    rotate_checkpoints,
)
from ._optimizer import optimizer_payload, param_fqns, read_optimizer_state
from ._rng import read_rng_state, rng_payload
from ._state_dict import apply_module_load, collect_model_state, plan_module_load
from ._tensors import tensor_sources
from .errors import HeaderError, MissingStateError

__all__ = ["save_state", "load_state", "LoadResult"]


class LoadResult(NamedTuple):
    """What :func:`load_state` returns, like torch's ``load_state_dict``: names (fqns) not loaded.

    With several models the names carry a ``model_{i}.`` prefix.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def _as_list(obj: Any, kind: str) -> list:
    if obj is None:
        return []
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    for i, item in enumerate(items):
        if item is None:
            raise TypeError(f"{kind}[{i}] is None")
    return items


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: Path, text: str, durable: bool) -> int:
    data = text.encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    return len(data)


def _model_config_json(model: Any) -> str | None:
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json() if callable(to_json) else None


def _existing_mode(target: Path) -> tuple[int | None, int | None]:
    """(file mode, folder mode) of a checkpoint being replaced, so an overwrite keeps them (case C13)."""
    if not target.is_dir():
        return None, None
    folder_mode = target.stat().st_mode & 0o7777
    for name in (MANIFEST, "model.safetensors"):
        if (target / name).is_file():
            return (target / name).stat().st_mode & 0o7777, folder_mode
    return None, folder_mode


def _carry_foreign_entries(target: Path, staging: Path, ours: set[str]) -> None:
    """Hard-link into ``staging`` whatever the user keeps in ``target`` that this save does not write."""
    if not target.is_dir():
        return
    for entry in target.iterdir():
        if entry.name in ours or entry.name == MANIFEST or _is_layout_name(entry.name):
            continue
        dest = staging / entry.name
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, dest, symlinks=True, copy_function=os.link)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), dest)
        else:
            os.link(entry, dest)


def _is_layout_name(name: str) -> bool:
    stem = name.split(".", 1)[0]
    base = stem.rsplit("_", 1)[0] if stem.rsplit("_", 1)[-1].isdigit() else stem
    return base in {"model", "optimizer", "scheduler", "random_states"} or name == "config.json"


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
) -> Path:
    """Save a training state (or only the model weights) to a checkpoint folder, crash-safely.

    Mirrors ``accelerate.Accelerator.save_state``'s layout and file names without pickle; see
    :mod:`fastckpt._layout` for the files.

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

    Returns:
        The committed checkpoint folder.

    Raises:
        KeyMismatchError: an optimizer holds a parameter of no passed model (names its group and shape).
        DtypeError: a tensor dtype the format cannot store (names the tensor).
        TypeError: scheduler / optimizer state that cannot be stored without pickle (names its path).
        OSError: the folder cannot be written; nothing is left behind and the previous checkpoint is intact.

    Example:
        >>> path = fastckpt.save_state(model, optimizer, scheduler, output_dir="ckpt")
        >>> fastckpt.save_state(model, model_only=True, output_dir="weights")
    """
    models = _as_list(model, "model")
    optimizers = [] if model_only else _as_list(optimizer, "optimizer")
    schedulers = [] if model_only else _as_list(scheduler, "scheduler")
    auto = output_dir is None
    root = Path(project_dir if project_dir is not None else os.getcwd())
    target = next_checkpoint_dir(root) if auto else Path(output_dir)
    target = target.absolute()

    jobs: list[tuple[str, list, list[tuple[str, str]] | None]] = []
    texts: dict[str, str] = {}
    for i, m in enumerate(models):
        tensors, aliases = collect_model_state(m)
        jobs.append((part_name("model", i, ".safetensors"), tensor_sources(tensors),
                     [("format", "pt"), *aliases.items()]))
    if models and (config := _model_config_json(models[0])) is not None:
        texts["config.json"] = config
    if not model_only:
        fqns = param_fqns(models)
        for j, opt in enumerate(optimizers):
            label = part_name("optimizer", j, "")
            tensors, metadata = optimizer_payload(opt, fqns, label=label)
            jobs.append((part_name("optimizer", j, ".safetensors"), tensor_sources(tensors), list(metadata.items())))
        for k, sched in enumerate(schedulers):
            label = part_name("scheduler", k, "")
            texts[part_name("scheduler", k, ".json")] = json.dumps(encode(sched.state_dict(), path=label))
        tensors, metadata = rng_payload(step)
        jobs.append((random_states_name(0), tensor_sources(tensors), list(metadata.items())))

    file_mode, folder_mode = _existing_mode(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.fastckpt-staging-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        sizes = _core.write_files([(str(staging / name), src, md) for name, src, md in jobs],
                                  durable=durable, threads=threads)
        files = {name: size for (name, _, _), size in zip(jobs, sizes)}
        for name, text in texts.items():
            files[name] = _write_text(staging / name, text, durable)
        counts = {"models": len(models), "optimizers": len(optimizers), "schedulers": len(schedulers)}
        mode = "model_only" if model_only else "full"
        manifest = json.dumps(manifest_dict(mode, files, counts, step), indent=2)
        _write_text(staging / MANIFEST, manifest, durable)
        if file_mode is not None:
            for name in [*files, MANIFEST]:
                os.chmod(staging / name, file_mode)
        if folder_mode is not None:
            os.chmod(staging, folder_mode)
        _carry_foreign_entries(target, staging, set(files))
        if durable:
            _fsync_dir(staging)
        _core.commit_dir(str(staging), str(target), durable=durable)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if auto and total_limit is not None:
        rotate_checkpoints(root, total_limit)
    return target


def _resolve_input_dir(input_dir: Any, project_dir: Any) -> Path:
    if input_dir is not None:
        folder = Path(input_dir)
        if not folder.is_dir():
            raise MissingStateError(f"{folder}: no such checkpoint folder")
        return folder
    root = Path(project_dir if project_dir is not None else os.getcwd())
    latest = latest_checkpoint(root)
    if latest is None:
        raise MissingStateError(f"{root / 'checkpoints'}: no committed checkpoint (no checkpoint_N with {MANIFEST})")
    return latest


def _open(folder: Path, name: str, what: str) -> Any:
    path = folder / name
    if not path.is_file():
        raise MissingStateError(f"{folder}: {what} needs {name}, which the checkpoint does not hold")
    return _core.SafetensorsFile(str(path))


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
) -> LoadResult:
    """Restore a state saved by :func:`save_state`: validate everything first, then apply.

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

    Returns:
        ``LoadResult(missing_keys, unexpected_keys)`` for the model(s).

    Raises:
        MissingStateError: no checkpoint, or a part asked for is absent (a full load of a model-only
            checkpoint names the missing files); raised before anything is changed.
        KeyMismatchError: ``strict`` and model keys differ (both lists named), or optimizer coverage fails.
        ShapeMismatchError / DtypeError: a stored tensor does not fit its destination (no silent casts).
        HeaderError / TruncatedFileError / IntegrityError: a damaged checkpoint.
        RngRestoreWarning (warning): RNG states for CUDA devices this machine lacks are skipped.
    """
    folder = _resolve_input_dir(input_dir, project_dir)
    manifest = read_manifest(folder)
    models = _as_list(model, "model")
    optimizers = [] if model_only else _as_list(optimizer, "optimizer")
    schedulers = [] if model_only else _as_list(scheduler, "scheduler")
    saved = {k: int(manifest.get(k, 0)) for k in ("models", "optimizers", "schedulers")}

    if manifest.get("mode") == "model_only" and (optimizers or schedulers):
        wanted = [part_name("optimizer", j, ".safetensors") for j in range(len(optimizers))]
        wanted += [part_name("scheduler", k, ".json") for k in range(len(schedulers))]
        raise MissingStateError(
            f"{folder}: saved with model_only=True, so it holds no {', '.join(wanted)}; load it with "
            "model_only=True, or pass no optimizer/scheduler. Nothing was changed."
        )
    for kind, objs in (("models", models), ("optimizers", optimizers), ("schedulers", schedulers)):
        if len(objs) > saved[kind]:
            raise MissingStateError(
                f"{folder}: {len(objs)} {kind} passed but the checkpoint holds {saved[kind]}. Nothing was changed."
            )

    # Phase 1: read and validate everything; nothing live is touched.
    plans, missing, unexpected = [], [], []
    for i, m in enumerate(models):
        plan = plan_module_load(m, [_open(folder, part_name("model", i, ".safetensors"), f"model {i}")],
                                strict=strict)
        prefix = f"model_{i}." if len(models) > 1 else ""
        missing += [prefix + k for k in plan.missing_keys]
        unexpected += [prefix + k for k in plan.unexpected_keys]
        plans.append(plan)
    fqns = param_fqns(models)
    optimizer_states = [
        read_optimizer_state(opt, _open(folder, part_name("optimizer", j, ".safetensors"), f"optimizer {j}"), fqns,
                             strict=strict, map_location=map_location, label=part_name("optimizer", j, ""))
        for j, opt in enumerate(optimizers)
    ]
    scheduler_states = []
    for k in range(len(schedulers)):
        path = folder / part_name("scheduler", k, ".json")
        try:
            scheduler_states.append(decode(json.loads(path.read_text(encoding="utf-8"))))
        except FileNotFoundError:
            raise MissingStateError(f"{folder}: scheduler {k} needs {path.name}, which is absent") from None
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
            raise HeaderError(f"{path}: not a valid fastckpt scheduler state: {exc}") from None
    rng = None
    if not model_only and manifest.get("mode") == "full":
        rng = read_rng_state(_open(folder, random_states_name(0), "the RNG restore"))

    # Phase 2: apply.
    for plan in plans:
        apply_module_load(plan, threads=threads)
    for opt, state in zip(optimizers, optimizer_states):
        opt.load_state_dict(state)
    for sched, state in zip(schedulers, scheduler_states):
        sched.load_state_dict(state)
    if rng is not None:
        rng.restore()
    return LoadResult(missing, unexpected)

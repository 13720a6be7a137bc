"""Restoring a checkpoint folder: read and validate every part first (:func:`plan_load`), then apply.

Phase 1 opens and validates every file the load needs (headers, names, shapes, dtypes, optimizer coverage,
scheduler JSON, RNG states) and reads optimizer state into fresh tensors; nothing live is touched. Phase 2
(:meth:`LoadPlan.apply`) fills the model parameters in place straight from the files and hands the optimizers,
schedulers and RNGs their states. A failure in phase 1 leaves every object as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastckpt._format.json_input import decode_json, load_json
from fastckpt._io.storage.local.backend import LocalStorage, check_input_dir
from fastckpt._io.storage.local.folder import open_safetensors
from fastckpt._io.storage.local.layout import MANIFEST, checkpoint_layout, part_name, random_states_name, read_manifest
from fastckpt._io.storage.local.shards import open_state_file, open_state_files
from fastckpt._plan.apply import LoadPlan
from fastckpt._state.model import matching_module, plan_module_load
from fastckpt._state.optimizer import optimizer_class_name, param_fqns, read_optimizer_state
from fastckpt._state.peft_adapter import ADAPTER_FILE, is_peft_model, key_map
from fastckpt._state.rng import read_rng_state
from fastckpt._state.scheduler import scheduler_class_name, scheduler_fits
from fastckpt._state.state_check import check_state_like
from fastckpt._state.trainable import check_frozen
from fastckpt.errors import MissingStateError

__all__ = ["resolve_input_dir", "check_input_dir", "LoadPlan", "plan_load"]


def resolve_input_dir(input_dir: Any, project_dir: Any, *, full: bool = False) -> Path:
    """The folder to load: ``input_dir``, or the latest committed checkpoint (``full``: saved in full); see
    :meth:`fastckpt._io.storage.local.backend.LocalStorage.locate` for the errors."""
    return LocalStorage(input_dir, project_dir).locate(model_only=not full)


def _open_part(folder: Path, name: str, what: str) -> Any:
    path = folder / name
    if not path.is_file():
        raise MissingStateError(f"{folder}: {what} needs {name}, which the checkpoint does not hold")
    return open_safetensors(path)


def positional_fqns(optimizer: Any) -> dict[int, str]:
    """``{id(param): "#k"}`` by position in ``param_groups``: the keys of optimizer state converted from
    accelerate without a model (manifest ``"optimizer_keys": "positional"``)."""
    return {id(p): f"#{k}" for k, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}


def plan_load(folder: Path, models: list, optimizers: list, schedulers: list, *, model_only: bool = False,
              strict: bool = True, map_location: Any = None, trust_pickle: bool = False, rank: int | None = 0,
              fqn_models: list | None = None, cast: bool = False,
              manifest: dict[str, Any] | None = None) -> LoadPlan:
    """Phase 1 of a load: read and validate everything ``folder`` must provide; change nothing.

    Reads fastckpt's layout (sharded model / optimizer files included) and accelerate's (see
    :func:`fastckpt._io.storage.local.layout.checkpoint_layout` and :mod:`fastckpt._plan.accelerate_load`).

    Args:
        trust_pickle: accelerate's layout only: allow full unpickling where ``weights_only=True`` refuses a file.
        rank: whose ``random_states_{rank}`` file to restore; None restores no RNG state.
        fqn_models: the models whose parameter names key the optimizer state (default: ``models``; accelerate's
            load hooks may take models out of ``models``).
        cast: model tensors stored in another dtype are cast to the live tensor's dtype (as torch's
            ``load_state_dict`` does) instead of refused.
        manifest: ``fastckpt.json`` as the storage read it to open the view (``CheckpointView.manifest``): checked
            here, not read again (one reading of the manifest per load); None reads it through ``folder``.

    Raises:
        MissingStateError, KeyMismatchError, ShapeMismatchError, DtypeError, HeaderError, IntegrityError,
        UnsafePickleError: see :func:`fastckpt.load_state`.
    """
    if checkpoint_layout(folder) == "accelerate":
        from fastckpt._plan.accelerate_load import plan_accelerate_load

        # a compat="accelerate" save has a manifest: check the recorded file sizes, take its mode
        mode = read_manifest(folder, parsed=manifest).get("mode") if (folder / MANIFEST).is_file() else None
        return plan_accelerate_load(folder, models, optimizers, schedulers, model_only=model_only, strict=strict,
                                    map_location=map_location, trust_pickle=trust_pickle, rank=rank,
                                    manifest_mode=mode, cast=cast)
    manifest = read_manifest(folder, model_files_only=model_only, parsed=manifest)
    if manifest.get("layout") == "dict":
        raise MissingStateError(f"{folder}: a checkpoint dict saved by fastckpt.save (state.safetensors + state.json), "
                                "not a training state; read it with fastckpt.load. Nothing was changed.")
    if model_only:
        optimizers, schedulers = [], []
    saved = {k: int(manifest.get(k, 0)) for k in ("models", "optimizers", "schedulers")}


    def check_count(kind: str, objs: list) -> None:
        # Checked kind by kind, each just before it is read: the most fundamental mismatch (the model's keys)
        # is reported first, not a scheduler count of a checkpoint of another model.
        if len(objs) > saved[kind]:
            raise MissingStateError(
                f"{folder}: {len(objs)} {kind} passed but the checkpoint holds {saved[kind]}. Nothing was changed."
            )

    check_count("models", models)
    load = LoadPlan()
    frozen = manifest.get("frozen") if isinstance(manifest.get("frozen"), dict) else {}
    for i, m in enumerate(models):
        record = frozen.get(part_name("model", i, ""))
        exempt = check_frozen(m, record, where=str(folder)) if record and strict else set()
        if i == 0 and manifest.get("peft") == ADAPTER_FILE:
            files, rename = [_open_part(folder, ADAPTER_FILE, "a PEFT adapter load")], key_map(m) if is_peft_model(m) else {}
        else:
            files, rename = open_state_files(folder, part_name("model", i, ""), f"model {i}"), None
        plan = plan_module_load(matching_module(m, files) if rename is None else m, files, strict=strict,
                                rename=rename, exempt=exempt, cast=cast)
        prefix = f"model_{i}." if len(models) > 1 else ""
        load.missing_keys += [prefix + k for k in plan.missing_keys]
        load.unexpected_keys += [prefix + k for k in plan.unexpected_keys]
        load.models.append(plan)
    if manifest.get("mode") == "model_only" and (optimizers or schedulers):
        wanted = [part_name("optimizer", j, ".safetensors") for j in range(len(optimizers))]
        wanted += [part_name("scheduler", k, ".json") for k in range(len(schedulers))]
        raise MissingStateError(
            f"{folder}: saved with model_only=True, so it holds no {', '.join(wanted)}; load it with "
            "model_only=True, or pass no optimizer/scheduler. Nothing was changed."
        )
    check_count("optimizers", optimizers)
    fqns = param_fqns(models if fqn_models is None else fqn_models)
    positional = manifest.get("optimizer_keys") == "positional"
    for j, opt in enumerate(optimizers):
        file = open_state_file(folder, part_name("optimizer", j, ""), f"optimizer {j}")
        state = read_optimizer_state(opt, file, positional_fqns(opt) if positional else fqns, strict=strict,
                                     map_location=map_location, defer=load.live_reads,
                                     label=part_name("optimizer", j, ""), skipped=load.skipped)
        if state is None:
            load.skipped.append(f"{part_name('optimizer', j, '')}: saved by {(file.metadata() or {}).get('optimizer')}, "
                                f"the live optimizer is {optimizer_class_name(opt)}; it keeps its own state")
        else:
            load.optimizers.append((opt, state))
    check_count("schedulers", schedulers)
    saved_classes = manifest.get("scheduler_classes")
    for k, sched in enumerate(schedulers):
        path = folder / part_name("scheduler", k, ".json")
        saved_class = saved_classes[k] if isinstance(saved_classes, list) and k < len(saved_classes) else None
        if not scheduler_fits(saved_class, sched, strict=strict, where=str(path)):
            load.skipped.append(f"{path.name}: saved by {saved_class}, the live scheduler is "
                                f"{scheduler_class_name(sched)}; it keeps its own state")
            continue
        try:
            where = f"{path}: not a valid fastckpt scheduler state"
            state = decode_json(load_json(path.read_bytes(), where), where)
        except FileNotFoundError:
            raise MissingStateError(f"{folder}: scheduler {k} needs {path.name}, which is absent") from None
        check_state_like(state, sched.state_dict(), path=path, what=f"scheduler {k}")
        load.schedulers.append((sched, state))
    if not model_only and manifest.get("mode") == "full" and rank is not None:
        load.rng = read_rng_state(_open_part(folder, random_states_name(rank), "the RNG restore"))
    return load

"""Restoring a checkpoint folder: read and validate every part first (:func:`plan_load`), then apply.

Phase 1 opens and validates every file the load needs (headers, names, shapes, dtypes, optimizer coverage,
scheduler JSON, RNG states) and reads optimizer state into fresh tensors; nothing live is touched. Phase 2
(:meth:`LoadPlan.apply`) fills the model parameters in place straight from the files and hands the optimizers,
schedulers and RNGs their states. A failure in phase 1 leaves every object as it was.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _core
from ._codec import decode
from ._layout import MANIFEST, latest_checkpoint, part_name, random_states_name, read_manifest
from ._optimizer import param_fqns, read_optimizer_state
from ._rng import RngState, read_rng_state
from ._state_dict import ModelLoadPlan, apply_module_load, plan_module_load
from .errors import HeaderError, MissingStateError

__all__ = ["resolve_input_dir", "LoadPlan", "plan_load"]


def resolve_input_dir(input_dir: Any, project_dir: Any) -> Path:
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


def _open_part(folder: Path, name: str, what: str) -> Any:
    path = folder / name
    if not path.is_file():
        raise MissingStateError(f"{folder}: {what} needs {name}, which the checkpoint does not hold")
    return _core.SafetensorsFile(str(path))


@dataclass
class LoadPlan:
    """A validated load: apply it with :meth:`apply`."""

    models: list[ModelLoadPlan] = field(default_factory=list)
    optimizers: list[tuple[Any, dict]] = field(default_factory=list)
    schedulers: list[tuple[Any, dict]] = field(default_factory=list)
    rng: RngState | None = None
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)

    def apply(self, *, threads: int = 0) -> None:
        """Phase 2: change the live objects."""
        for plan in self.models:
            apply_module_load(plan, threads=threads)
        for opt, state in self.optimizers:
            opt.load_state_dict(state)
        for sched, state in self.schedulers:
            sched.load_state_dict(state)
        if self.rng is not None:
            self.rng.restore()


def plan_load(folder: Path, models: list, optimizers: list, schedulers: list, *, model_only: bool = False,
              strict: bool = True, map_location: Any = None) -> LoadPlan:
    """Phase 1 of a load: read and validate everything ``folder`` must provide; change nothing.

    Raises:
        MissingStateError, KeyMismatchError, ShapeMismatchError, DtypeError, HeaderError, IntegrityError:
            see :func:`fastckpt.load_state`.
    """
    manifest = read_manifest(folder)
    if model_only:
        optimizers, schedulers = [], []
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

    load = LoadPlan()
    for i, m in enumerate(models):
        plan = plan_module_load(m, [_open_part(folder, part_name("model", i, ".safetensors"), f"model {i}")],
                                strict=strict)
        prefix = f"model_{i}." if len(models) > 1 else ""
        load.missing_keys += [prefix + k for k in plan.missing_keys]
        load.unexpected_keys += [prefix + k for k in plan.unexpected_keys]
        load.models.append(plan)
    fqns = param_fqns(models)
    for j, opt in enumerate(optimizers):
        file = _open_part(folder, part_name("optimizer", j, ".safetensors"), f"optimizer {j}")
        state = read_optimizer_state(opt, file, fqns, strict=strict, map_location=map_location,
                                     label=part_name("optimizer", j, ""))
        load.optimizers.append((opt, state))
    for k, sched in enumerate(schedulers):
        path = folder / part_name("scheduler", k, ".json")
        try:
            load.schedulers.append((sched, decode(json.loads(path.read_text(encoding="utf-8")))))
        except FileNotFoundError:
            raise MissingStateError(f"{folder}: scheduler {k} needs {path.name}, which is absent") from None
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
            raise HeaderError(f"{path}: not a valid fastckpt scheduler state: {exc}") from None
    if not model_only and manifest.get("mode") == "full":
        load.rng = read_rng_state(_open_part(folder, random_states_name(0), "the RNG restore"))
    return load

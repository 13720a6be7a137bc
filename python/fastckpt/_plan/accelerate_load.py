"""Loading a checkpoint written by stock accelerate (or with ``compat="accelerate"``) into live objects.

The same two phases as fastckpt's own layout (:mod:`fastckpt._plan.load`): every file the load needs is read and
checked against the live objects first (names, shapes, dtypes; the positional optimizer state against the live
``param_groups``), and only a fully valid plan changes anything. accelerate itself overwrites the weights and then
fails on a missing ``optimizer.bin``.

- Models: ``model{_i}.safetensors`` (or its shard index), else ``pytorch_model{_i}.bin``. A state dict saved from a
  ``DistributedDataParallel`` wrapper (keys ``module.*``) loads into the bare model, and the other way round.
- Optimizers: ``optimizer{_i}.bin`` is keyed by position; the saved ``param_groups`` must have the live group
  sizes, and moment tensors the shapes of the parameters they belong to.
- Schedulers, RNG: ``scheduler{_i}.bin``, ``random_states_{rank}.pkl`` (a failed RNG restore raises; accelerate
  logs it at INFO and goes on). A folder with no ``random_states_*`` and no ``optimizer*`` file holds weights only
  (``save_model`` / ``save_pretrained`` output): it loads as a model-only checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastckpt._format.dtypes import stored_shape, to_safetensors_dtype
from fastckpt._io.storage.local.layout import part_name
from fastckpt._io.storage.local.shards import has_state_file, open_state_files
from fastckpt._plan.accelerate_format import model_file, rng_file, rng_state_from_accelerate, torch_load
from fastckpt._plan.apply import LoadPlan
from fastckpt._state.model import matching_module, plan_module_load
from fastckpt._state.state_check import check_state_like
from fastckpt.errors import HeaderError, KeyMismatchError, MissingStateError, ShapeMismatchError

__all__ = ["TensorDictFile", "open_model_files", "positional_optimizer_state", "plan_accelerate_load"]

#: optimizer state entries that have their parameter's shape (torch's Adam, AdamW, SGD, RMSprop, Adagrad, ...)
_MOMENTS = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum",
            "grad_avg", "ax", "eta", "mu"}


class TensorDictFile(bytearray):
    """An in-memory stand-in for ``fastckpt._core.SafetensorsFile`` over a ``{name: tensor}`` dict (a ``.bin``).

    The tensors are packed into this bytearray (one copy), so the validated two-phase model load
    (:func:`fastckpt._state.model.plan_module_load`) treats a pickled state dict like a safetensors file.
    """

    def __init__(self, tensors: dict[str, Any], path: str) -> None:
        entries, chunks, offset = [], [], 0
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise HeaderError(f"{path}: entry {name!r} is a {type(t).__name__}, not a tensor")
            t = t.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
            dtype = to_safetensors_dtype(t.dtype, name=name)
            entries.append((name, dtype, stored_shape(t), offset, offset + raw.size))
            chunks.append(raw)
            offset += raw.size
        super().__init__(offset)
        view = np.frombuffer(self, dtype=np.uint8)
        for (_, _, _, begin, end), raw in zip(entries, chunks):
            view[begin:end] = raw
        self.path = path
        self.data_start = 0
        self._entries = entries
        self._by_name = {e[0]: e for e in entries}

    def metadata(self) -> dict[str, str] | None:
        return None

    def tensors(self) -> list[tuple[str, str, list[int], int, int]]:
        return list(self._entries)

    def read_into(self, targets: list[tuple[str, Any]], *, threads: int = 0) -> None:
        view = np.frombuffer(self, dtype=np.uint8)
        for name, buf in targets:
            try:
                _, _, _, begin, end = self._by_name[name]
            except KeyError:
                raise KeyMismatchError(f"{self.path}: no tensor {name!r}") from None
            dst = np.frombuffer(buf, dtype=np.uint8)
            if dst.size != end - begin:
                raise ValueError(f"{self.path}: tensor {name!r} has {end - begin} bytes, target {dst.size}")
            dst[:] = view[begin:end]


def open_model_files(folder: Path, i: int, *, trust_pickle: bool = False) -> list[Any]:
    """Model ``i``'s files in accelerate's layout: ``model{_i}.safetensors`` (or shards), else ``pytorch_model{_i}.bin``.

    Raises:
        MissingStateError: neither exists (names both); see also :func:`fastckpt._io.storage.local.shards.open_state_files`.
    """
    base = part_name("model", i, "")
    if has_state_file(folder, base):
        return open_state_files(folder, base, f"model {i}")
    legacy = folder / model_file(i, safe=False)
    if not legacy.is_file():
        raise MissingStateError(f"{folder}: model {i} needs {model_file(i)} or {legacy.name}; neither is there")
    state = torch_load(legacy, trust_pickle=trust_pickle, what=f"model {i}")
    if not isinstance(state, dict):
        raise HeaderError(f"{legacy}: holds a {type(state).__name__}, not a state dict")
    return [TensorDictFile(state, str(legacy))]


def positional_optimizer_state(optimizer: Any, state: Any, *, path: Path, map_location: Any = None) -> dict:
    """Check a positional ``optimizer.state_dict()`` (accelerate's ``optimizer.bin``) against the live optimizer.

    Returns:
        The state dict to hand to ``optimizer.load_state_dict`` (tensors moved to ``map_location`` if given).

    Raises:
        HeaderError: not an optimizer state dict.
        KeyMismatchError: group count or group sizes differ from the live ``param_groups`` (positions would map
            state onto the wrong parameters).
        ShapeMismatchError: a moment tensor's shape differs from its parameter's (names group, position, shapes).
    """
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list) \
            or not isinstance(state.get("state"), dict):
        raise HeaderError(f"{path}: not an optimizer state_dict (needs 'state' and 'param_groups')")
    saved_sizes = [len(g.get("params", [])) for g in state["param_groups"]]
    live_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != live_sizes:
        raise KeyMismatchError(
            f"{path}: the saved param_groups have sizes {saved_sizes} but the live optimizer's have {live_sizes}; "
            "accelerate keys optimizer state by position, so it cannot be mapped onto these parameters"
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_positions = [i for g in state["param_groups"] for i in g["params"]]
    where = {pos: k for k, pos in enumerate(saved_positions)}
    out: dict[Any, dict] = {}
    for pos, values in state["state"].items():
        if pos not in where or not isinstance(values, dict):
            raise HeaderError(f"{path}: state entry {pos!r} belongs to no saved param group")
        param = params[where[pos]]
        for name, value in values.items():
            if name in _MOMENTS and isinstance(value, torch.Tensor) and value.shape != param.shape:
                raise ShapeMismatchError(
                    f"{path}: state[{pos}][{name!r}] has shape {list(value.shape)} but the live parameter at "
                    f"position {where[pos]} has shape {list(param.shape)}"
                )
        if map_location is not None:
            values = {k: v.to(map_location) if isinstance(v, torch.Tensor) and k != "step" else v
                      for k, v in values.items()}
        out[pos] = values
    return {"state": out, "param_groups": state["param_groups"]}


def plan_accelerate_load(folder: Path, models: list, optimizers: list, schedulers: list, *, model_only: bool = False,
                         strict: bool = True, map_location: Any = None, trust_pickle: bool = False,
                         rank: int | None = 0, manifest_mode: str | None = None, cast: bool = False) -> Any:
    """Phase 1 of loading an accelerate-layout folder: read and validate everything; change nothing.

    Args:
        manifest_mode: ``"full"`` / ``"model_only"`` from the manifest of a ``compat="accelerate"`` save; None for
            stock accelerate folders, which are full when they hold ``random_states_*`` or ``optimizer*`` files.

    Returns:
        A :class:`fastckpt._plan.apply.LoadPlan`.

    Raises:
        MissingStateError: a file the load needs is absent (names it); nothing was changed.
        UnsafePickleError: a file needs full unpickling and ``trust_pickle`` is False.
        KeyMismatchError, ShapeMismatchError, DtypeError, HeaderError: as :func:`fastckpt.load_state`.
    """
    if model_only:
        optimizers, schedulers = [], []
    saved_state = manifest_mode == "full" or (manifest_mode is None and any(
        n.startswith(("random_states_", "optimizer")) for n in os.listdir(folder)))
    load = LoadPlan()
    for i, m in enumerate(models):
        files = open_model_files(folder, i, trust_pickle=trust_pickle)
        plan = plan_module_load(matching_module(m, files), files, strict=strict, cast=cast)
        prefix = f"model_{i}." if len(models) > 1 else ""
        load.missing_keys += [prefix + k for k in plan.missing_keys]
        load.unexpected_keys += [prefix + k for k in plan.unexpected_keys]
        load.models.append(plan)
    # after the model's keys: a weights-only folder of another model is reported by its keys first
    if not saved_state and not model_only and (optimizers or schedulers or manifest_mode is None):
        wanted = [part_name("optimizer", j, ".bin") for j in range(len(optimizers))]
        wanted += [part_name("scheduler", k, ".bin") for k in range(len(schedulers))]
        wanted += [] if manifest_mode else [rng_file(rank)]
        raise MissingStateError(
            f"{folder}: holds model weights only (no fastckpt.json and no training state: {', '.join(wanted)} "
            "absent); load it with model_only=True. Nothing was changed."
        )
    for j, opt in enumerate(optimizers):
        path = folder / part_name("optimizer", j, ".bin")
        state = torch_load(path, trust_pickle=trust_pickle, what=f"optimizer {j}")
        load.optimizers.append((opt, positional_optimizer_state(opt, state, path=path, map_location=map_location)))
    for k, sched in enumerate(schedulers):
        path = folder / part_name("scheduler", k, ".bin")
        state = torch_load(path, trust_pickle=trust_pickle, what=f"scheduler {k}")
        if not isinstance(state, dict):
            raise HeaderError(f"{path}: holds a {type(state).__name__}, not a scheduler state_dict")
        check_state_like(state, sched.state_dict(), path=path, what=f"scheduler {k}")
        load.schedulers.append((sched, state))
    if not model_only and saved_state and rank is not None:
        path = folder / rng_file(rank)
        load.rng = rng_state_from_accelerate(torch_load(path, trust_pickle=trust_pickle, what="the RNG restore"),
                                             path)
    return load

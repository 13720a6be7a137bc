"""Converting a checkpoint folder between fastckpt's layout, accelerate's, and a Hugging Face model folder.

A conversion works on saved state alone (no model is built): the source is read into a :class:`Snapshot` (model
tensors, optimizer state by position, scheduler / RNG / object states), then written as one crash-safe commit.

Optimizer state: accelerate keys it by position in ``param_groups``; fastckpt by parameter fqn. fastckpt -> accelerate
needs nothing (the saved ``param_groups`` list the fqns in position order). accelerate -> fastckpt needs the fqn of
each position: given the model (and, for custom param groups, its optimizer) they are taken from it and checked
against the saved moment shapes; without it the keys stay positional (``#0``, ``#1``, ...) and the manifest says
``"optimizer_keys": "positional"`` (:func:`fastckpt.load_state` then maps them by position).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from fastckpt import _core
from fastckpt._format.codec import decode, encode
from fastckpt._format.tensors import file_tensors, tensor_from_buffer
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.storage.local.commit import write_checkpoint
from fastckpt._io.storage.local.integrity import verify_checkpoint
from fastckpt._io.storage.local.layout import MANIFEST, checkpoint_layout, part_name, random_states_name, read_manifest
from fastckpt._io.storage.local.shards import has_state_file, open_state_file, open_state_files
from fastckpt._plan.accelerate_format import (
    SCALER_NAME,
    custom_file,
    dl_state_file,
    rng_file,
    rng_state_from_accelerate,
    sampler_file,
    torch_load,
    torch_save_bytes,
)
from fastckpt._plan.accelerate_load import open_model_files
from fastckpt._plan.save import _shard
from fastckpt._plan.sharded_load import is_sharded_checkpoint
from fastckpt._state.model import collect_model_state
from fastckpt._state.objects import object_state_payload, read_object_state
from fastckpt._state.optimizer import optimizer_payload, param_fqns, read_optimizer_state
from fastckpt._state.rng import FORMAT as RNG_FORMAT
from fastckpt._state.rng import RngState, read_rng_state
from fastckpt.errors import HeaderError, KeyMismatchError, MissingStateError, ShapeMismatchError

__all__ = ["Snapshot", "read_snapshot", "convert", "TARGETS"]

TARGETS = ("fastckpt", "accelerate", "hf-model")
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg")


@dataclass
class Snapshot:
    """A checkpoint's saved state, layout-free. Optimizer states are positional ``state_dict()`` s; ``fqns[j]`` is
    the fqn of each position of optimizer ``j`` (None when unknown)."""

    mode: str = "full"
    step: int = 0
    models: list[dict[str, torch.Tensor]] = field(default_factory=list)
    config: str | None = None
    generation_config: str | None = None  # generation_config.json, carried with config.json
    optimizers: list[dict] = field(default_factory=list)
    fqns: list[list[str] | None] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    rng: list[RngState] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)  # "custom_checkpoint_0", "scaler", "dl_state_dict" ...
    notes: list[str] = field(default_factory=list)


class _SavedOptimizer:
    """Stands in for a live optimizer: placeholder parameters shaped like the saved ``param_groups``."""

    def __init__(self, group_sizes: list[int], state: dict | None = None) -> None:
        self.param_groups = [{"params": [object() for _ in range(n)]} for n in group_sizes]
        self._state = state

    def state_dict(self) -> dict:
        return self._state  # type: ignore[return-value]

    def placeholders(self, names: list[str]) -> dict[int, str]:
        flat = [p for g in self.param_groups for p in g["params"]]
        return {id(p): n for p, n in zip(flat, names)}


def _count(folder: Path, base: str, suffix: str) -> int:
    n = 0
    while (folder / part_name(base, n, suffix)).is_file() or (suffix == ".safetensors" and
                                                               has_state_file(folder, part_name(base, n, ""))):
        n += 1
    return n


def _files_tensors(files: list[Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(file_tensors(f) if isinstance(f, _core.SafetensorsFile) else _bin_tensors(f))
    return out


def _bin_tensors(f: Any) -> dict[str, torch.Tensor]:
    view = memoryview(f)
    return {n: tensor_from_buffer(view, d, s, b, e, name=n, path=f.path) for n, d, s, b, e in f.tensors()}


def _read_fastckpt(folder: Path, snap: Snapshot) -> None:
    manifest = read_manifest(folder)
    snap.mode, snap.step = manifest.get("mode", "full"), int(manifest.get("step", 0))
    for i in range(int(manifest.get("models", 0))):
        snap.models.append(_files_tensors(open_state_files(folder, part_name("model", i, ""), f"model {i}")))
    for j in range(int(manifest.get("optimizers", 0))):
        file = open_state_file(folder, part_name("optimizer", j, ""), f"optimizer {j}")
        try:
            groups = json.loads((file.metadata() or {})["param_groups"])
        except (KeyError, json.JSONDecodeError) as exc:
            raise HeaderError(f"{file.path}: not a fastckpt optimizer file ({exc})") from None
        names = [n for g in groups for n in g["params"]]
        duck = _SavedOptimizer([len(g["params"]) for g in groups])
        snap.optimizers.append(read_optimizer_state(duck, file, duck.placeholders(names)))  # type: ignore[arg-type]
        snap.fqns.append(None if manifest.get("optimizer_keys") == "positional" else names)
    for k in range(int(manifest.get("schedulers", 0))):
        path = folder / part_name("scheduler", k, ".json")
        snap.schedulers.append(decode(json.loads(path.read_text(encoding="utf-8"))))
    r = 0
    while (folder / random_states_name(r)).is_file():
        snap.rng.append(read_rng_state(_core.SafetensorsFile(str(folder / random_states_name(r)))))
        r += 1
    for path in sorted(folder.glob("*.safetensors")):
        stem = path.name.removesuffix(".safetensors")
        if stem.startswith(("custom_checkpoint_", "scaler", "dl_state_dict")):
            snap.objects[stem] = read_object_state(_core.SafetensorsFile(str(path)))
    if any(folder.glob("sampler*.json")):
        snap.notes.append("sampler*.json (seedable sampler epoch/seed) has no accelerate equivalent without the "
                          "sampler object; not converted")


def _read_accelerate(folder: Path, snap: Snapshot, trust_pickle: bool) -> None:
    n_models = _count(folder, "model", ".safetensors") or _count(folder, "pytorch_model", ".bin")
    for i in range(n_models):
        snap.models.append(_files_tensors(open_model_files(folder, i, trust_pickle=trust_pickle)))
    for j in range(_count(folder, "optimizer", ".bin")):
        snap.optimizers.append(torch_load(folder / part_name("optimizer", j, ".bin"), trust_pickle=trust_pickle,
                                          what=f"optimizer {j}"))
        snap.fqns.append(None)
    for k in range(_count(folder, "scheduler", ".bin")):
        snap.schedulers.append(torch_load(folder / part_name("scheduler", k, ".bin"), trust_pickle=trust_pickle,
                                          what=f"scheduler {k}"))
    r = 0
    while (folder / rng_file(r)).is_file():
        path = folder / rng_file(r)
        snap.rng.append(rng_state_from_accelerate(torch_load(path, trust_pickle=trust_pickle, what="RNG"), path))
        r += 1
    snap.step = snap.rng[0].step if snap.rng else 0
    snap.mode = "full" if snap.rng or snap.optimizers else "model_only"
    i = 0
    while (folder / custom_file(i)).is_file():
        snap.objects[f"custom_checkpoint_{i}"] = torch_load(folder / custom_file(i), trust_pickle=trust_pickle,
                                                            what=f"custom object {i}")
        i += 1
    if (folder / SCALER_NAME).is_file():
        snap.objects["scaler"] = torch_load(folder / SCALER_NAME, trust_pickle=trust_pickle, what="the GradScaler")
    for i in range(_count(folder, "dl_state_dict", ".bin")):
        snap.objects[part_name("dl_state_dict", i, "")] = torch_load(folder / dl_state_file(i),
                                                                     trust_pickle=trust_pickle, what="dataloader")
    if (folder / sampler_file(0)).is_file():
        snap.notes.append("sampler*.bin (a pickled sampler object) is not converted")


def read_snapshot(folder: Path, *, trust_pickle: bool = False) -> Snapshot:
    """Read any checkpoint folder (fastckpt or accelerate layout, or a Hugging Face model folder).

    Raises:
        MissingStateError, HeaderError, IntegrityError, UnsafePickleError: as :func:`fastckpt.load_state`.
    """
    snap = Snapshot()
    if checkpoint_layout(folder) == "accelerate":
        _read_accelerate(folder, snap, trust_pickle)
    else:
        _read_fastckpt(folder, snap)
    if (folder / "config.json").is_file():
        snap.config = (folder / "config.json").read_text(encoding="utf-8")
    if (folder / "generation_config.json").is_file():
        snap.generation_config = (folder / "generation_config.json").read_text(encoding="utf-8")
    return snap


def map_positions(snap: Snapshot, models: list[torch.nn.Module], optimizers: list[Any] | None = None) -> None:
    """Name every optimizer position of ``snap`` by the fqn of its parameter in ``models``.

    Positions follow ``optimizers[j].param_groups`` when given, else ``models``' ``named_parameters()`` order (the
    order of ``Optimizer(model.parameters())``).

    Raises:
        KeyMismatchError: the saved position count (or, with ``optimizers``, the group sizes) differs.
        ShapeMismatchError: a saved moment's shape differs from its parameter's (the order does not fit).
    """
    fqn_of = param_fqns(models)
    by_fqn = {fqn_of[id(p)]: p for m in models for p in m.parameters() if id(p) in fqn_of}
    for j, state in enumerate(snap.optimizers):
        if optimizers is not None:
            sizes = [len(g["params"]) for g in optimizers[j].param_groups]
            saved_sizes = [len(g["params"]) for g in state["param_groups"]]
            if sizes != saved_sizes:
                raise KeyMismatchError(f"optimizer {j}: saved param_groups have sizes {saved_sizes}, the factory's "
                                       f"optimizer {sizes}")
            names = [fqn_of[id(p)] for g in optimizers[j].param_groups for p in g["params"]]
        else:
            names = list(dict.fromkeys(fqn_of.values()))
        saved = sum(len(g["params"]) for g in state["param_groups"])
        if saved != len(names):
            raise KeyMismatchError(f"optimizer {j}: {saved} saved positions but the model gives {len(names)} "
                                   "parameters; return (model, optimizer) from the factory to give the param groups")
        for pos, values in state["state"].items():
            param = by_fqn[names[pos]]
            for key in _MOMENTS:
                value = values.get(key)
                if isinstance(value, torch.Tensor) and value.shape != param.shape:
                    raise ShapeMismatchError(
                        f"optimizer {j}: position {pos} holds {key} of shape {list(value.shape)} but {names[pos]!r} "
                        f"has shape {list(param.shape)}; the positions do not follow this parameter order"
                    )
        snap.fqns[j] = names


def _rng_payload(s: RngState) -> tuple[dict[str, torch.Tensor], list[tuple[str, str]]]:
    kind, keys, pos, has_gauss, cached = s.numpy
    tensors = {"step": torch.tensor(s.step, dtype=torch.int64), "python": torch.tensor(s.python[1], dtype=torch.int64),
               "numpy": torch.from_numpy(keys.astype("uint32")), "torch": s.torch_cpu}
    tensors.update({f"cuda.{i}": c for i, c in enumerate(s.cuda)})
    return tensors, [("format", RNG_FORMAT),
                     ("python", json.dumps({"version": s.python[0], "gauss_next": s.python[2]})),
                     ("numpy", json.dumps({"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss),
                                           "cached_gaussian": float(cached)}))]


def _rng_dict(s: RngState) -> dict[str, Any]:
    states = {"step": s.step, "random_state": s.python, "numpy_random_seed": s.numpy, "torch_manual_seed": s.torch_cpu}
    if s.cuda:
        states["torch_cuda_manual_seed"] = s.cuda
    return states


def _plan(snap: Snapshot, to: str, max_shard_size: Any) -> SavePlan:
    model_only = to == "hf-model" or snap.mode == "model_only"
    models = snap.models[:1] if to == "hf-model" else snap.models
    counts: dict[str, Any] = {"models": len(models), "optimizers": 0 if model_only else len(snap.optimizers),
                              "schedulers": 0 if model_only else len(snap.schedulers)}
    plan = SavePlan(mode="model_only" if model_only else "full", step=snap.step, counts=counts)
    accel = to == "accelerate"
    for i, sd in enumerate(models):
        tensors, aliases = collect_model_state(sd)
        meta = [("format", "pt")] if accel else [("format", "pt"), *aliases.items()]
        plan.parts.append(FilePart(part_name("model", i, ".safetensors"), tensors, meta))
    if snap.config is not None and (model_only or not accel):
        plan.texts["config.json"] = snap.config
        if snap.generation_config is not None:
            plan.texts["generation_config.json"] = snap.generation_config
    if model_only:
        return _shard(plan, max_shard_size)
    if accel:
        counts["layout"] = "accelerate"
        for j, state in enumerate(snap.optimizers):
            plan.texts[part_name("optimizer", j, ".bin")] = torch_save_bytes(state)
        for k, state in enumerate(snap.schedulers):
            plan.texts[part_name("scheduler", k, ".bin")] = torch_save_bytes(state)
        for r, s in enumerate(snap.rng):
            plan.texts[rng_file(r)] = torch_save_bytes(_rng_dict(s))
        for name, state in snap.objects.items():
            file = SCALER_NAME if name == "scaler" else name + (".bin" if name.startswith("dl_") else ".pkl")
            plan.texts[file] = torch_save_bytes(state)
        return plan
    for j, state in enumerate(snap.optimizers):
        names = snap.fqns[j] or [f"#{k}" for k in range(sum(len(g["params"]) for g in state["param_groups"]))]
        if snap.fqns[j] is None:
            counts["optimizer_keys"] = "positional"
        duck = _SavedOptimizer([len(g["params"]) for g in state["param_groups"]], state)
        label = part_name("optimizer", j, "")
        tensors, metadata = optimizer_payload(duck, duck.placeholders(names), label=label)  # type: ignore[arg-type]
        plan.parts.append(FilePart(label + ".safetensors", tensors, list(metadata.items())))
    for k, state in enumerate(snap.schedulers):
        plan.texts[part_name("scheduler", k, ".json")] = json.dumps(encode(state, path=part_name("scheduler", k, "")))
    for r, s in enumerate(snap.rng):
        tensors, meta = _rng_payload(s)
        plan.parts.append(FilePart(random_states_name(r), tensors, meta))
    for name, state in snap.objects.items():
        tensors, meta = object_state_payload(state, label=name)
        plan.parts.append(FilePart(name + ".safetensors", tensors, meta))
    return _shard(plan, max_shard_size)


def convert(src: Path, dst: Path, *, to: str = "fastckpt", models: list[torch.nn.Module] | None = None,
            optimizers: list[Any] | None = None, max_shard_size: int | str | None = None,
            trust_pickle: bool = False, durable: bool = True,
            progress: Callable[[int, int], None] | None = None) -> Snapshot:
    """Convert the checkpoint folder ``src`` into ``dst`` (committed atomically) in the layout ``to``.

    Args:
        to: ``"fastckpt"`` (pickle-free), ``"accelerate"`` (stock ``Accelerator.load_state`` reads it) or
            ``"hf-model"`` (model 0's weights + ``config.json``: ``from_pretrained`` reads it).
        models / optimizers: the live model(s) (and optimizer(s)) that give positional optimizer state its fqns.
        max_shard_size: shard model and optimizer files (fastckpt / hf-model targets); bytes or ``"10GB"``.
        trust_pickle: allow full unpickling of accelerate files that need it.
        progress: ``progress(bytes_done, bytes_total)`` while the source's checksums are verified (a progress bar).

    Returns:
        The :class:`Snapshot` that was written (``notes`` lists what could not be converted).

    Raises:
        ValueError: an unknown ``to``, sharding with ``to="accelerate"``, or ``dst`` is ``src``, inside it, or
            contains it (nothing is written).
        KeyMismatchError / ShapeMismatchError: ``models`` do not fit the positional optimizer state.
        MissingStateError, HeaderError, UnsafePickleError: an unreadable source.
        IntegrityError: a source with recorded checksums (``fastckpt.json``) does not match them; nothing is written.
    """
    if to not in TARGETS:
        raise ValueError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    if to == "accelerate" and max_shard_size is not None:
        raise ValueError("accelerate's layout is unsharded; drop --max-shard-size")
    src_r, dst_r = Path(src).resolve(), Path(dst).resolve()
    if dst_r == src_r or src_r in dst_r.parents or dst_r in src_r.parents:
        raise ValueError(f"DST must not be SRC, inside it, or contain it: {src} -> {dst}")
    if (Path(src) / MANIFEST).is_file():
        verify_checkpoint(src, progress=progress)  # refuse to launder damaged bytes into a freshly checksummed copy
    if is_sharded_checkpoint(Path(src)):
        return _consolidate_sharded(Path(src), Path(dst), to=to, max_shard_size=max_shard_size, durable=durable)
    snap = read_snapshot(Path(src), trust_pickle=trust_pickle)
    if models is not None and to == "fastckpt":
        map_positions(snap, models, optimizers)
    write_checkpoint(_plan(snap, to, max_shard_size), Path(dst), durable=durable)
    return snap


def _consolidate_sharded(src: Path, dst: Path, *, to: str, max_shard_size: int | str | None,
                         durable: bool) -> Snapshot:
    """``to="hf-model"`` of a sharded (FSDP2 / DTensor) checkpoint: its model's DCP shards consolidated (what
    ``fastckpt consolidate`` does); the other targets are refused, naming what reads the checkpoint instead.

    Raises:
        MissingStateError: ``to`` is not ``"hf-model"``.
    """
    from fastckpt._io.dcp.consolidate import consolidate
    from fastckpt._io.sizes import parse_size

    if to != "hf-model":
        raise MissingStateError(f"{src}: a sharded (FSDP2 / DTensor) checkpoint, whose tensors are DCP shards; "
                                f"--to {to} needs unsharded files. `fastckpt convert --to hf-model` (or `fastckpt "
                                "consolidate SRC OUT`) writes its model as a Hugging Face folder, and "
                                "fastckpt.load_state reads it as it is on any number of processes")
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    consolidate(src, dst, max_shard_size=limit, durable=durable)
    snap = Snapshot(mode="model_only")
    if (src / "config.json").is_file():
        snap.config = (src / "config.json").read_text(encoding="utf-8")
    return snap

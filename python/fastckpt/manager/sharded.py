"""Sharded (FSDP2 / DTensor) states in a :class:`~fastckpt.CheckpointManager`: each rank's memory tier holds its
own local shards; the durable tier is a normal fastckpt sharded checkpoint.

Memory tier (:func:`local_plan`, :func:`plan_local_restore`): every rank writes a plain fastckpt folder of its own
(the Rust writer, crc32c summed on the way, the manifest last) holding, per model / optimizer part, the local
tensors of its DTensors (``{part}.local_rank{r}.safetensors``: ``model.local_rank0.safetensors``,
``optimizer.local_rank0.safetensors``; tensor names as a sharded save's DCP parts name them, ``{fqn}`` and
``state.{fqn}.{name}``), each recorded with its global shape, placements, mesh shape and global offset (the
file's metadata ``fastckpt.local_shards``, JSON); the optimizer and scheduler JSON a sharded save writes; this
rank's RNG states and the registered objects. The state is taken as :func:`fastckpt.save_state` takes it
(:func:`fastckpt._state.sharded.model_tensors` / ``optimizer_tensors``) and restored through the sharded load's
own planning (``model_destination`` / ``optimizer_destination`` check every name, shape and dtype; the tensors are
applied by :class:`fastckpt._plan.sharded_load.ShardedLoad`), only read from this rank's file instead of DCP: a
restore needs the same world size and the same placements, and refuses anything else (the manager then restores
the durable tier, which DCP reshards).

Durable tier (:func:`save_durable`): every rank takes part in a sharded save of the step
(:func:`fastckpt._plan.sharded_save.save_sharded`) into ``{project}/checkpoints/checkpoint_{step}``, inside
``step()`` (a memory copy cannot be turned into it by one process), with the registered objects added.

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastckpt._format.codec import encode
from fastckpt._format.json_input import decode_json
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.storage.local.folder import open_safetensors, read_checked_json, read_fresh
from fastckpt._io.storage.local.layout import CHECKPOINTS_DIR, part_name, random_states_name, read_manifest
from fastckpt._io.storage.local.numbering import rotate_checkpoints
from fastckpt._plan.sharded_load import ShardedLoad, assemble_load
from fastckpt._plan.sharded_save import save_sharded
from fastckpt._state.rng import read_rng_state
from fastckpt._state.sharded import (
    model_destination,
    model_tensors,
    optimizer_destination,
    optimizer_tensors,
    owner_model,
)
from fastckpt.errors import HeaderError, MissingStateError, ShapeMismatchError
from fastckpt.manager.state import Registered, add_objects, read_objects

__all__ = ["LAYOUT", "local_plan", "snapshot_world", "snapshot_owner", "check_sharding", "plan_local_restore",
           "save_durable", "save_step"]

#: the manifest's ``layout`` of a rank's local-shards snapshot (``local_shards``: ``{"rank", "world_size", ...}``)
LAYOUT = "local_shards"
_META = "fastckpt.local_shards"


def _file(sub: str, rank: int) -> str:
    return f"{sub}.local_rank{rank}.safetensors"


def _local(t: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The local tensor of ``t`` and its record: global shape, placements, mesh shape, global offset."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.detach(), {"shape": list(t.shape), "placements": None, "offset": [0] * t.dim()}
    return t._local_tensor.detach(), {"shape": list(t.shape), "placements": str(tuple(t.placements)),
                                      "mesh": list(t.device_mesh.shape), "offset": _offset(t)}


def _offset(t: Any) -> list[int]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return [int(o) for o in compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1]]


def _part(name: str, tensors: dict[str, torch.Tensor]) -> FilePart:
    local, records = {}, {}
    for key, t in tensors.items():
        lt, records[key] = _local(t)
        local[key] = lt if lt.is_contiguous() else lt.contiguous()
    return FilePart(name, local, [(_META, json.dumps(records))])


def local_plan(models: list, optimizers: list, schedulers: list, objects: list[Registered], *, step: int, rank: int,
               world: int, rank_states: list[tuple[Any, dict]]) -> SavePlan:
    """This rank's memory-tier snapshot (see the module docs); the tensors are the live local shards (no copies).

    Raises:
        TypeError: a state value that cannot be stored without pickle (names its path).
    """
    plan = SavePlan(mode="full", step=step, counts={"layout": LAYOUT, "processes": world})
    aliases, parts = [], []
    for i, m in enumerate(models):
        sub = part_name("model", i, "")
        tensors, ties = model_tensors(m, "")
        plan.parts.append(_part(_file(sub, rank), tensors))
        aliases.append(ties)
        parts.append(sub)
    for j, opt in enumerate(optimizers):
        base = part_name("optimizer", j, "")
        tensors, text = optimizer_tensors(owner_model(opt, models, base), opt, base)
        plan.parts.append(_part(_file(base, rank), tensors))
        plan.texts[base + ".json"] = text
        parts.append(base)
    for k, sched in enumerate(schedulers):
        name = part_name("scheduler", k, ".json")
        plan.texts[name] = json.dumps(encode(sched.state_dict(), path=part_name("scheduler", k, "")))
    rng, _ = rank_states[rank]
    plan.parts.append(FilePart(random_states_name(rank), rng[0], list(rng[1].items())))
    plan.counts[LAYOUT] = {"rank": rank, "world_size": world, "models": len(models), "optimizers": len(optimizers),
                           "schedulers": len(schedulers), "parts": parts, "aliases": aliases}
    add_objects(plan, objects, rank_states)
    return plan


def snapshot_world(folder: Path) -> int | None:
    """The world size of the local-shards snapshot in ``folder``; None for any other checkpoint."""
    owner = snapshot_owner(folder)
    return None if owner is None else owner[1]


def snapshot_owner(folder: Path) -> tuple[int, int] | None:
    """``(rank, world size)`` of the local-shards snapshot in ``folder`` (whose shards it holds); None for any
    other checkpoint."""
    try:
        info = read_manifest(folder, check_sizes=False).get(LAYOUT)
    except (MissingStateError, ValueError, OSError):
        return None
    try:
        return (int(info["rank"]), int(info["world_size"])) if isinstance(info, dict) else None
    except (KeyError, TypeError, ValueError):
        return None


def check_sharding(folder: Path, models: list) -> None:
    """Whether the local-shards snapshot in ``folder`` was cut as the live ``models`` are (each DTensor's placements
    and mesh shape; a key the live models lack is left to the restore's own checks).

    Raises:
        MissingStateError: a tensor saved with other placements or on a mesh of another shape (names the file, the
            tensor and both): only the durable tier, which DCP reshards, can restore it.
    """
    owner = snapshot_owner(folder)
    if owner is None:
        return
    for i, m in enumerate(models):
        where = folder / _file(part_name("model", i, ""), owner[0])
        if not where.is_file():
            return  # the restore names it
        records = _records(open_safetensors(where), str(where))
        for key, t in model_tensors(m, "")[0].items():
            rec, live = records.get(key), _local(t)[1]
            if rec is not None and (rec.get("placements"), rec.get("mesh")) != (live["placements"], live.get("mesh")):
                raise MissingStateError(f"{where}: {key} was saved with placements {rec.get('placements')} on a mesh "
                                        f"{rec.get('mesh')}, the live one has {live['placements']} on "
                                        f"{live.get('mesh')}; the memory tier restores the same sharding only")


@dataclass
class _Md:
    """What ``model_destination`` / ``optimizer_destination`` read of a stored tensor (DCP's metadata shape)."""

    size: tuple
    properties: Any


def _records(file: Any, where: str) -> dict[str, dict[str, Any]]:
    meta = (file.metadata() or {}).get(_META)
    if meta is None:
        raise MissingStateError(f"{where}: no {_META} record; not a CheckpointManager local-shards file")
    try:
        records = json.loads(meta)
    except ValueError:
        records = None
    if not isinstance(records, dict) or not all(isinstance(r, dict) for r in records.values()):
        raise HeaderError(f"{where}: its {_META} record is not a JSON object of one object per tensor")
    return records


def _metadata(file: Any, records: dict[str, dict[str, Any]], where: str) -> dict[str, _Md]:
    """``{name: metadata}`` of the stored tensors: the global shape recorded, the dtype stored."""
    from types import SimpleNamespace

    from fastckpt._format.dtypes import to_torch_dtype

    stored = {name: to_torch_dtype(dtype, name=name, path=where) for name, dtype, *_ in file.tensors()}
    missing = sorted(set(records) - set(stored))
    if missing:
        raise MissingStateError(f"{where}: {missing[:5]} recorded but not stored")
    return {k: _Md(tuple(r["shape"]), SimpleNamespace(dtype=stored[k])) for k, r in records.items()}


def _fill(file: Any, dest: dict[str, torch.Tensor], records: dict[str, dict[str, Any]], where: str,
          threads: int) -> None:
    """Read this rank's stored local tensor into each destination's local tensor, after checking that it is the
    same shard (placements, mesh, offset, local shape) of the same global tensor."""
    from torch.distributed.tensor import DTensor

    fresh, device = [], []
    shapes = {name: shape for name, _, shape, *_ in file.tensors()}
    for key, t in dest.items():
        want = _local(t)[1] if isinstance(t, DTensor) else {"placements": None}
        rec = records[key]
        lt = t._local_tensor if isinstance(t, DTensor) else t
        if rec.get("placements") != want["placements"] or rec.get("mesh") != want.get("mesh") or (
                want["placements"] is not None and rec.get("offset") != want["offset"]):
            raise ShapeMismatchError(f"{where}: {key} was saved as the shard at offset {rec.get('offset')} of "
                                     f"placements {rec.get('placements')} on a mesh {rec.get('mesh')}, the live one "
                                     f"is at {want.get('offset')} of {want['placements']} on {want.get('mesh')}; "
                                     "the memory tier restores the same sharding only")
        shape = shapes[key]
        if list(shape) != list(lt.shape):
            raise ShapeMismatchError(f"{where}: {key}'s local shard is stored with shape {list(shape)}, the live one "
                                     f"has {list(lt.shape)}")
        if lt.device.type == "cpu" and lt.is_contiguous():
            fresh.append((key, lt))
        else:
            tmp = torch.empty(lt.shape, dtype=lt.dtype)
            fresh.append((key, tmp))
            device.append((lt, tmp))
    from fastckpt._format.tensors import destination_buffer

    read_fresh(file, [(k, destination_buffer(t)) for k, t in fresh if t.numel()], threads=threads)
    for lt, tmp in device:
        lt.copy_(tmp)


def plan_local_restore(folder: Path, models: list, optimizers: list, schedulers: list, objects: list, *, rank: int,
                       world: int, threads: int = 0) -> ShardedLoad:
    """Phase 1 of a restore from this rank's local-shards snapshot ``folder`` (a pinned handle): read and check
    everything into fresh tensors; nothing live changes until the returned plan's ``apply()``.

    Raises:
        MissingStateError: not a snapshot of this rank and world size, or a part / file missing.
        KeyMismatchError / ShapeMismatchError / DtypeError: another model, or another sharding.
        IntegrityError: damaged bytes (names file and tensor).
    """
    manifest = read_manifest(folder)
    info = manifest.get(LAYOUT)
    if not isinstance(info, dict) or info.get("rank") != rank or info.get("world_size") != world:
        got = (info.get("rank"), info.get("world_size")) if isinstance(info, dict) else None
        raise MissingStateError(f"{folder}: a local-shards snapshot of (rank, world size) {got}, this is rank {rank} "
                                f"of {world}; restore it from the durable tier")
    for kind, objs in (("models", models), ("optimizers", optimizers), ("schedulers", schedulers)):
        if len(objs) != info.get(kind):
            raise MissingStateError(f"{folder}: {len(objs)} {kind} passed, the snapshot holds {info.get(kind)}")
    records_of = manifest.get("files", {})
    load, dest, served, saved_optimizers = ShardedLoad(strict=True), {}, [], []
    for i, m in enumerate(models):
        sub = part_name("model", i, "")
        file = open_safetensors(folder / _file(sub, rank))
        where = str(folder / _file(sub, rank))
        records = _records(file, where)
        d, s, _, _ = model_destination(m, "", _metadata(file, records, where), info["aliases"][i], strict=True, where=where)
        _fill(file, d, records, where, threads)
        dest[sub] = d
        served.append(s)
    for j, opt in enumerate(optimizers):
        base = part_name("optimizer", j, "")
        saved = read_checked_json(folder, base + ".json", f"optimizer {j}", records_of.get(base + ".json"))
        owner = owner_model(opt, models, base)
        file = open_safetensors(folder / _file(base, rank))
        where = str(folder / _file(base, rank))
        records = _records(file, where)
        d, opt_info = optimizer_destination(owner, opt, base, saved, _metadata(file, records, where), strict=True,
                                            where=where)
        _fill(file, d, records, where, threads)
        dest[base] = d
        saved_optimizers.append((owner, opt, base, opt_info))
    for k, sched in enumerate(schedulers):
        name = part_name("scheduler", k, ".json")
        data = read_checked_json(folder, name, f"scheduler {k}", records_of.get(name))
        load.schedulers.append((sched, decode_json(data, f"{folder / name}: not a valid fastckpt scheduler state")))
    load.rng = read_rng_state(open_safetensors(folder / random_states_name(rank)))
    load.step = load.rng.step
    load.objects += read_objects(folder, objects, rank=rank)
    return assemble_load(load, dest, models, served, saved_optimizers)


def save_durable(models: list, optimizers: list, schedulers: list, objects: list[Registered], *, project: Path,
                 step: int, rank_states: list[tuple[Any, dict]], keep: int | None, threads: int,
                 timeout: float) -> Path:
    """Every rank: a sharded save of ``step`` into ``{project}/checkpoints/checkpoint_{step}`` with the registered
    objects, then (main process) the older ones beyond ``keep`` rotated out. Returns the committed folder.

    Raises:
        CollectiveTimeoutError / CheckpointError / OSError: as :func:`fastckpt.save_state` of a sharded state.
    """
    from fastckpt.checkpoint_sharded import dcp_storage_writer

    target = (project / CHECKPOINTS_DIR / f"checkpoint_{step}").absolute()
    path = save_sharded(models, optimizers, schedulers, target=target, model_only=False, step=step, durable=True,
                        threads=threads, timeout=timeout, writer_factory=dcp_storage_writer,
                        add_files=lambda plan: add_objects(plan, objects, rank_states), what="CheckpointManager")
    import torch.distributed as dist

    if keep is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        rotate_checkpoints(project, keep)
    return Path(path)


def save_step(mgr: Any, rank_states: list[tuple[Any, dict]], step: int) -> Path:
    """A manager's save of a sharded state: this rank's local shards committed in its memory tier (when it has
    one: ``mgr._save_memory``, replicas included), then the durable sharded checkpoint (every rank). Returns the
    memory-tier folder (the durable one without a memory tier)."""
    path = None
    if mgr.memory is not None:
        path = mgr._save_memory(local_plan(*mgr._state, step=step, rank=mgr.rank, world=mgr.world,
                                           rank_states=rank_states), step)
    durable = save_durable(*mgr._state, project=mgr.project, step=step, rank_states=rank_states, keep=mgr.keep,
                           threads=mgr.threads, timeout=mgr.timeout)
    return durable if path is None else path

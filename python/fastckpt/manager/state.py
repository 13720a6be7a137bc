"""What a :class:`~fastckpt.CheckpointManager` checkpoints, as one save plan, and how it is read back.

A manager's checkpoint is a normal fastckpt folder (``fastckpt.load_state`` reads it): the models, optimizers and
schedulers as :func:`fastckpt.save_state` writes them, every process's RNG states (``random_states_{rank}``,
gathered through the store at each save: a few KB per process), and each object registered with
``register_for_checkpointing`` as ``custom_checkpoint_{i}.safetensors`` (its tensors as tensors, the rest as exact
JSON through fastckpt's pickle-free codec; the file accelerate's ``register_for_checkpointing`` gets from
:mod:`fastckpt.accelerate`): this process's state, as accelerate saves the main process's. An object registered
with ``per_rank=True`` (a sampler or counter that differs across processes) is gathered like the RNG states and
stored once per process, ``custom_checkpoint_{i}_rank{r}.safetensors``; each process restores its own. Every process's memory-tier copy is complete, so any one of them is a durable
checkpoint when copied, and a replica restores the rank it came from.

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.group.distributed import Session, is_distributed
from fastckpt._io.storage.local.folder import open_safetensors
from fastckpt._plan.apply import LoadPlan
from fastckpt._plan.load import plan_load
from fastckpt._plan.save import build_save_plan
from fastckpt._state.objects import object_state_payload, read_object_state
from fastckpt._state.rng import rng_payload
from fastckpt._state.state_check import check_state_like
from fastckpt.errors import KeyMismatchError, MissingStateError

__all__ = ["Registered", "gather_rank_states", "build_plan", "plan_restore", "read_objects", "add_objects",
           "custom_name"]

_CUSTOM = re.compile(r"^custom_checkpoint_(\d+)(?:_rank\d+)?\.safetensors$")


@dataclass
class Registered:
    """An object registered for checkpointing; ``per_rank``: stored once per process."""

    obj: Any
    per_rank: bool = False


def custom_name(i: int, rank: int | None = None) -> str:
    """The file of the ``i``-th registered object (``rank``: of a per-rank object)."""
    return f"custom_checkpoint_{i}.safetensors" if rank is None else f"custom_checkpoint_{i}_rank{rank}.safetensors"


def _payload(obj: Any, label: str) -> tuple[dict[str, torch.Tensor], list[tuple[str, str]]]:
    return object_state_payload(obj.state_dict(), label=label)


def gather_rank_states(step: int, objects: list[Registered], timeout: float) -> list[tuple[Any, list]]:
    """Every process's RNG payload and per-rank object payloads, on every process, through the store:
    ``[(rng (tensors, metadata), {i: (tensors, metadata)}) per rank]``.

    Raises:
        TypeError: a per-rank object's state cannot be stored without pickle (names its path).
        CollectiveTimeoutError: a process did not take part within ``timeout`` seconds.
    """
    rng = rng_payload(step)
    own = {i: _payload(r.obj, f"custom_checkpoint_{i}") for i, r in enumerate(objects) if r.per_rank}
    if not is_distributed():
        return [(rng, own)]

    # tensors travel as numpy arrays: torch's object collectives cannot unpickle tensors reliably
    def out(payload: tuple) -> tuple:
        return {k: v.detach().cpu().numpy() for k, v in payload[0].items()}, payload[1]

    def back(payload: tuple) -> tuple:
        return {k: torch.from_numpy(a.copy()) for k, a in payload[0].items()}, payload[1]

    session = Session(f"gathering RNG states for step {step}", timeout)
    gathered = session.gather((out(rng), {i: out(p) for i, p in own.items()}), step="per-rank states")
    gathered = session.broadcast(gathered, step="per-rank states")
    return [(back(r), {i: back(p) for i, p in objs.items()}) for r, objs in gathered]


def build_plan(models: list, optimizers: list, schedulers: list, objects: list[Registered], *, step: int,
               rank_states: list[tuple[Any, dict]]) -> SavePlan:
    """The plan of one manager checkpoint (see the module docs); the tensors are the live ones (no copies).

    Raises:
        TypeError: a state value that cannot be stored without pickle (names its path).
    """
    plan = build_save_plan(models, optimizers, schedulers, model_only=False, step=step,
                           rng_states=[rng for rng, _ in rank_states])
    plan.counts["processes"] = len(rank_states)
    add_objects(plan, objects, rank_states)
    return plan


def add_objects(plan: SavePlan, objects: list[Registered], rank_states: list[tuple[Any, dict]]) -> None:
    """Add the registered objects' files to ``plan`` (a per-rank object once per process, from ``rank_states``).

    Raises:
        TypeError: a state value that cannot be stored without pickle (names its path).
    """
    plan.counts["custom_objects"] = len(objects)
    for i, reg in enumerate(objects):
        if reg.per_rank:
            for r, (_, objs) in enumerate(rank_states):
                plan.parts.append(FilePart(custom_name(i, r), *objs[i]))
        else:
            plan.parts.append(FilePart(custom_name(i), *_payload(reg.obj, f"custom_checkpoint_{i}")))


def plan_restore(folder: Path, models: list, optimizers: list, schedulers: list, objects: list, *,
                 rank: int) -> LoadPlan:
    """Phase 1 of a restore from ``folder`` (a pinned handle): read and check everything; changes nothing.

    Raises:
        MissingStateError / KeyMismatchError: the registered objects differ in number from the saved ones, or
            anything :func:`fastckpt.load_state` raises (IntegrityError for damaged bytes, ...).
    """
    load = plan_load(folder, models, optimizers, schedulers, strict=True, rank=rank)
    load.objects += read_objects(folder, objects, rank=rank)
    return load


def read_objects(folder: Path, objects: list, *, rank: int) -> list[tuple[Any, Any]]:
    """The registered objects' saved states in ``folder``, checked against the live ones: ``[(obj, state)]``.

    Raises:
        MissingStateError / KeyMismatchError: the registered objects differ in number or kind from the saved ones.
    """
    out = []
    saved = len({m.group(1) for e in folder.iterdir() if (m := _CUSTOM.match(e.name))})
    if saved != len(objects):
        cls = MissingStateError if len(objects) > saved else KeyMismatchError
        raise cls(f"{folder}: {len(objects)} object(s) are registered for checkpointing but the checkpoint holds "
                  f"{saved}; register the same objects in the same order as when saving. Nothing was changed.")
    for i, reg in enumerate(objects):
        name = custom_name(i, rank if reg.per_rank else None)
        if not (folder / name).is_file():
            raise MissingStateError(f"{folder}: registered object {i} ({'per rank' if reg.per_rank else 'shared'}) "
                                    f"needs {name}, which the checkpoint does not hold (registered with another "
                                    "per_rank, or saved by fewer processes). Nothing was changed.")
        state = read_object_state(open_safetensors(folder / name))
        check_state_like(state, reg.obj.state_dict(), path=folder / name, what=f"registered object {i}")
        out.append((reg.obj, state))
    return out

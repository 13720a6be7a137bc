"""What a :class:`~fastckpt.CheckpointManager` checkpoints, as one save plan, and how it is read back.

A manager's checkpoint is a normal fastckpt folder (``fastckpt.load_state`` reads it): the models, optimizers and
schedulers as :func:`fastckpt.save_state` writes them, every process's RNG states (``random_states_{rank}``,
gathered through the store at each save: a few KB per process), and each object registered with
``register_for_checkpointing`` as ``custom_checkpoint_{i}.safetensors`` (its tensors as tensors, the rest as exact
JSON through fastckpt's pickle-free codec; the file accelerate's ``register_for_checkpointing`` gets from
:mod:`fastckpt.accelerate`). Every process's memory-tier copy is complete, so any one of them is a durable
checkpoint when copied, and a replica restores the rank it came from.

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fastckpt._io.distributed import Session, is_distributed
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.folder import open_safetensors
from fastckpt._plan.apply import LoadPlan
from fastckpt._plan.load import plan_load
from fastckpt._plan.save import build_save_plan
from fastckpt._state.objects import object_state_payload, read_object_state
from fastckpt._state.rng import rng_payload
from fastckpt._state.state_check import check_state_like
from fastckpt.errors import KeyMismatchError, MissingStateError

__all__ = ["gather_rng", "build_plan", "plan_restore", "custom_name"]


def custom_name(i: int) -> str:
    """The file of the ``i``-th registered object."""
    return f"custom_checkpoint_{i}.safetensors"


def gather_rng(step: int, timeout: float) -> list[tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """Every process's RNG payload (``random_states_{rank}``), on every process, through the store.

    Raises:
        CollectiveTimeoutError: a process did not take part within ``timeout`` seconds.
    """
    tensors, metadata = rng_payload(step)
    if not is_distributed():
        return [(tensors, metadata)]
    session = Session(f"gathering RNG states for step {step}", timeout)
    # tensors travel as numpy arrays: torch's object collectives cannot unpickle tensors reliably
    gathered = session.gather(({k: v.cpu().numpy() for k, v in tensors.items()}, metadata), step="rng")
    gathered = session.broadcast(gathered, step="rng")
    return [({k: torch.from_numpy(a.copy()) for k, a in t.items()}, m) for t, m in gathered]


def build_plan(models: list, optimizers: list, schedulers: list, objects: list, *, step: int,
               rng_states: list) -> SavePlan:
    """The plan of one manager checkpoint (see the module docs); the tensors are the live ones (no copies).

    Raises:
        TypeError: a state value that cannot be stored without pickle (names its path).
    """
    plan = build_save_plan(models, optimizers, schedulers, model_only=False, step=step, rng_states=rng_states)
    plan.counts["processes"] = len(rng_states)
    plan.counts["custom_objects"] = len(objects)
    for i, obj in enumerate(objects):
        tensors, metadata = object_state_payload(obj.state_dict(), label=custom_name(i).removesuffix(".safetensors"))
        plan.parts.append(FilePart(custom_name(i), tensors, metadata))
    return plan


def plan_restore(folder: Path, models: list, optimizers: list, schedulers: list, objects: list, *,
                 rank: int) -> LoadPlan:
    """Phase 1 of a restore from ``folder`` (a pinned handle): read and check everything; changes nothing.

    Raises:
        MissingStateError / KeyMismatchError: the registered objects differ in number from the saved ones, or
            anything :func:`fastckpt.load_state` raises (IntegrityError for damaged bytes, ...).
    """
    load = plan_load(folder, models, optimizers, schedulers, strict=True, rank=rank)
    saved = sum(1 for e in folder.iterdir() if e.name.startswith("custom_checkpoint_") and e.name.endswith(
        ".safetensors"))
    if saved != len(objects):
        cls = MissingStateError if len(objects) > saved else KeyMismatchError
        raise cls(f"{folder}: {len(objects)} object(s) are registered for checkpointing but the checkpoint holds "
                  f"{saved}; register the same objects in the same order as when saving. Nothing was changed.")
    for i, obj in enumerate(objects):
        state = read_object_state(open_safetensors(folder / custom_name(i)))
        check_state_like(state, obj.state_dict(), path=folder / custom_name(i), what=f"registered object {i}")
        load.objects.append((obj, state))
    return load

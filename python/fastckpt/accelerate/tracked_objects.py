"""The objects an ``Accelerator`` tracks besides models, optimizers and schedulers, in both layouts.

============================  ====================================  ==========================================
object                        fastckpt layout (no pickle)           accelerate layout (``compat="accelerate"``)
============================  ====================================  ==========================================
``register_for_checkpointing``  ``custom_checkpoint_{i}.safetensors``   ``custom_checkpoint_{i}.pkl``
GradScaler                    ``scaler.safetensors``                ``scaler.pt``
SeedableRandomSampler         ``sampler{_i}.json`` (epochs, seed)   ``sampler{_i}.bin`` (the pickled sampler,
                                                                    only for an ``IterableDatasetShard``)
stateful dataloader           ``dl_state_dict{_i}.safetensors``     ``dl_state_dict{_i}.bin``
shuffling generator           ``dl_generator{_i}.json`` (state,     not saved by accelerate (accelerate#3158):
(several processes)           ``iteration``)                        a load warns
============================  ====================================  ==========================================

(The object-state files are described in :mod:`fastckpt._state.objects`.) fastckpt saves a seedable sampler's
``epoch`` and ``initial_seed`` and its dataloader's epoch counter (``iteration``, which sets the sampler's epoch when
the next epoch starts) for every prepared dataloader that has one, so a resumed run shuffles as the uninterrupted
one would; accelerate pickles the whole sampler, and only in the rare iterable-dataset case.

With several processes and a shuffled map-style dataset (accelerate's default, ``use_seedable_sampler=False``),
accelerate gives the ``RandomSampler`` a generator of its own (seeded once at ``prepare``) that it synchronises
across processes at the start of every epoch; stock accelerate does not save it, so a resumed run's next epoch
replays the first epoch's order (accelerate#3158). fastckpt saves that generator's state (the same on every
process at the end of an epoch) and the dataloader's epoch counter, so the resumed run shuffles its next epoch as
the uninterrupted one would; a load that cannot restore it (a checkpoint without the file) warns.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.storage.local.folder import open_safetensors
from fastckpt._io.storage.local.layout import part_name
from fastckpt._plan.accelerate_format import (
    SCALER_NAME,
    custom_file,
    dl_state_file,
    sampler_file,
    torch_load,
    torch_save_bytes,
)
from fastckpt._plan.apply import LoadPlan
from fastckpt._state.objects import object_state_payload, read_object_state
from fastckpt._state.rng import RngRestoreWarning
from fastckpt._state.state_check import check_state_like
from fastckpt.errors import HeaderError, KeyMismatchError, MissingStateError

__all__ = ["add_tracked_objects", "plan_tracked_objects"]

_CUSTOM_PKL_RE = re.compile(r"^custom_checkpoint_\d+\.pkl$")
_CUSTOM_ST_RE = re.compile(r"^custom_checkpoint_\d+\.safetensors$")


def _seedable_sampler(dataloader: Any) -> Any:
    from accelerate.data_loader import SeedableRandomSampler, get_sampler

    try:
        sampler = get_sampler(dataloader)
    except AttributeError:
        return None
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


def _shuffle_generator(dataloader: Any) -> Any:
    """The generator accelerate synchronises across processes for ``dataloader``'s ``RandomSampler`` (several
    processes, ``use_seedable_sampler=False``), or None."""
    import torch

    gen = getattr(dataloader, "synchronized_generator", None)
    return gen if isinstance(gen, torch.Generator) else None


def _generator_state(dataloader: Any, gen: Any) -> str:
    return json.dumps({"iteration": int(getattr(dataloader, "iteration", 0)),
                       "state": gen.get_state().numpy().tobytes().hex()})


def _iterable_shard(dataloader: Any) -> bool:
    from accelerate.data_loader import IterableDatasetShard

    return isinstance(getattr(dataloader, "dataset", None), IterableDatasetShard)


def _state_part(name: str, state: Any) -> FilePart:
    tensors, metadata = object_state_payload(state, label=name.removesuffix(".safetensors"))
    return FilePart(name, tensors, metadata)


def add_tracked_objects(plan: SavePlan, accelerator: Any, *, compat: bool) -> None:
    """Add the custom objects, GradScaler and dataloader states of ``accelerator`` to ``plan``.

    Raises:
        TypeError: (fastckpt layout) a state value that cannot be stored without pickle, naming its path.
    """
    objects = list(accelerator._custom_objects)
    plan.counts["custom_objects"] = len(objects)
    for i, obj in enumerate(objects):
        if compat:
            plan.texts[custom_file(i)] = torch_save_bytes(obj.state_dict())
        else:
            plan.parts.append(_state_part(f"custom_checkpoint_{i}.safetensors", obj.state_dict()))
    if accelerator.scaler is not None:
        if compat:
            plan.texts[SCALER_NAME] = torch_save_bytes(accelerator.scaler.state_dict())
        else:
            plan.parts.append(_state_part("scaler.safetensors", accelerator.scaler.state_dict()))
    for i, dl in enumerate(accelerator._dataloaders):
        sampler = _seedable_sampler(dl)
        stateful = getattr(dl, "use_stateful_dataloader", False)
        if compat:
            if sampler is not None and _iterable_shard(dl):
                plan.texts[sampler_file(i)] = torch_save_bytes(sampler)
            if stateful:
                plan.texts[dl_state_file(i)] = torch_save_bytes(dl.state_dict())
        else:
            if sampler is not None:
                state = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed),
                         "iteration": int(getattr(dl, "iteration", 0))}
                plan.texts[part_name("sampler", i, ".json")] = json.dumps(state)
            if stateful:
                plan.parts.append(_state_part(part_name("dl_state_dict", i, ".safetensors"), dl.state_dict()))
            gen = _shuffle_generator(dl)
            if gen is not None:
                plan.texts[part_name("dl_generator", i, ".json")] = _generator_state(dl, gen)


class _SamplerPosition:
    """Restores a SeedableRandomSampler's ``epoch`` and ``initial_seed`` and its dataloader's ``iteration``."""

    def __init__(self, sampler: Any, dataloader: Any) -> None:
        self.sampler = sampler
        self.dataloader = dataloader

    def load_state_dict(self, state: dict) -> None:
        self.sampler.epoch = state["epoch"]
        self.sampler.initial_seed = state["initial_seed"]
        if hasattr(self.dataloader, "iteration"):
            self.dataloader.iteration = state["iteration"]


class _GeneratorPosition:
    """Restores the shuffling generator accelerate synchronises across processes and the dataloader's
    ``iteration``."""

    def __init__(self, generator: Any, dataloader: Any) -> None:
        self.generator = generator
        self.dataloader = dataloader

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["state"])
        if hasattr(self.dataloader, "iteration"):
            self.dataloader.iteration = state["iteration"]


def _read_generator(path: Path, gen: Any) -> dict:
    import torch

    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        state = torch.frombuffer(bytearray.fromhex(doc["state"]), dtype=torch.uint8).clone()
        iteration = int(doc["iteration"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise HeaderError(f"{path}: not a valid generator state ({type(exc).__name__}: {exc})") from None
    expected = gen.get_state().numel()
    if state.numel() != expected:
        raise HeaderError(f"{path}: a generator state of {state.numel()} bytes, the live generator's has {expected}")
    try:
        gen.clone_state().set_state(state)  # refused now, before anything changes
    except RuntimeError as exc:
        raise HeaderError(f"{path}: a state the generator refuses ({exc})") from None
    return {"state": state, "iteration": iteration}


def _plan_generator(load: LoadPlan, folder: Path, i: int, dl: Any, *, stored: bool) -> None:
    gen = _shuffle_generator(dl)
    if gen is None:
        return
    name = part_name("dl_generator", i, ".json")
    if stored and (folder / name).is_file():
        load.objects.append((_GeneratorPosition(gen, dl), _read_generator(folder / name, gen)))
        return
    warnings.warn(f"{folder}: holds no {name}: dataloader {i}'s shuffling generator (synchronised across "
                  "processes) is not restored, so its next epoch replays the order of a fresh run's first epoch, "
                  "not the order the interrupted run would have taken (accelerate#3158); save with fastckpt's "
                  "layout, or prepare with DataLoaderConfiguration(use_seedable_sampler=True)",
                  RngRestoreWarning, stacklevel=4)


class _SamplerSwap:
    """Puts a sampler unpickled from accelerate's ``sampler.bin`` into its dataloader."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader

    def load_state_dict(self, sampler: Any) -> None:
        self.dataloader.set_sampler(sampler)


def _read_state(folder: Path, name: str, what: str) -> Any:
    path = folder / name
    if not path.is_file():
        raise MissingStateError(f"{folder}: {what} needs {name}, which the checkpoint does not hold")
    return read_object_state(open_safetensors(path))


def _check_dl_state(state: Any, path: Path) -> None:
    if not isinstance(state, dict):
        raise HeaderError(f"{path}: holds a {type(state).__name__}, not a dataloader state_dict; nothing was changed")


def _check_custom_count(folder: Path, saved: int, registered: int) -> None:
    if registered > saved:
        raise MissingStateError(
            f"{folder}: {registered} object(s) are registered for checkpointing but the checkpoint holds {saved} "
            f"(custom_checkpoint_{saved}... absent). Nothing was changed."
        )
    if saved > registered:
        raise KeyMismatchError(
            f"{folder}: the checkpoint holds {saved} custom object state(s) but {registered} object(s) are "
            "registered; register the same objects in the same order as when saving. Nothing was changed."
        )


def plan_tracked_objects(load: LoadPlan, folder: Path, accelerator: Any, *, layout: str,
                         trust_pickle: bool = False) -> None:
    """Read and validate the tracked objects' states into ``load.objects``; changes nothing.

    Raises:
        MissingStateError: a registered object, the GradScaler or a sampler needs a file the checkpoint lacks.
        KeyMismatchError: the checkpoint holds more custom objects than are registered.
        UnsafePickleError: (accelerate layout) a file needs full unpickling and ``trust_pickle`` is False.
        HeaderError: a malformed state file.
    """
    names = [e.name for e in folder.iterdir()]
    objects = list(accelerator._custom_objects)
    accel = layout == "accelerate"
    _check_custom_count(folder, sum(bool((_CUSTOM_PKL_RE if accel else _CUSTOM_ST_RE).match(n)) for n in names),
                        len(objects))
    for i, obj in enumerate(objects):
        name = custom_file(i) if accel else f"custom_checkpoint_{i}.safetensors"
        state = (torch_load(folder / name, trust_pickle=trust_pickle, what=f"custom object {i}")
                 if accel else _read_state(folder, name, f"custom object {i}"))
        check_state_like(state, obj.state_dict(), path=folder / name, what=f"custom object {i}")
        load.objects.append((obj, state))
    if accelerator.scaler is not None:
        name = SCALER_NAME if accel else "scaler.safetensors"
        state = (torch_load(folder / name, trust_pickle=trust_pickle, what="the GradScaler")
                 if accel else _read_state(folder, name, "the GradScaler"))
        check_state_like(state, accelerator.scaler.state_dict(), path=folder / name, what="GradScaler")
        load.objects.append((accelerator.scaler, state))
    for i, dl in enumerate(accelerator._dataloaders):
        sampler = _seedable_sampler(dl)
        stateful = getattr(dl, "use_stateful_dataloader", False)
        if accel:
            if sampler is not None and _iterable_shard(dl):
                swap = torch_load(folder / sampler_file(i), trust_pickle=trust_pickle, what=f"dataloader {i}")
                if not callable(getattr(swap, "__iter__", None)):
                    raise HeaderError(f"{folder / sampler_file(i)}: holds a {type(swap).__name__}, not a sampler")
                load.objects.append((_SamplerSwap(dl), swap))
            if stateful and (folder / dl_state_file(i)).is_file():
                state = torch_load(folder / dl_state_file(i), trust_pickle=trust_pickle, what=f"dataloader {i}")
                _check_dl_state(state, folder / dl_state_file(i))
                load.objects.append((dl, state))
            _plan_generator(load, folder, i, dl, stored=False)
            continue
        path = folder / part_name("sampler", i, ".json")
        if sampler is not None and path.is_file():
            try:
                state = json.loads(path.read_text(encoding="utf-8"))
                state = {"epoch": int(state["epoch"]), "initial_seed": int(state["initial_seed"]),
                         "iteration": int(state.get("iteration", 0))}
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise HeaderError(f"{path}: not a valid sampler state ({type(exc).__name__}: {exc})") from None
            load.objects.append((_SamplerPosition(sampler, dl), state))
        dl_name = part_name("dl_state_dict", i, ".safetensors")
        if stateful and (folder / dl_name).is_file():
            state = _read_state(folder, dl_name, f"dataloader {i}")
            _check_dl_state(state, folder / dl_name)
            load.objects.append((dl, state))
        _plan_generator(load, folder, i, dl, stored=True)

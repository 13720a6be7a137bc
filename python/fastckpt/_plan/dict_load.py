"""Reading a checkpoint-dict folder (``fastckpt.load``): check every file, then build the object.

The folder is read once, through the pinned folder handle (:mod:`fastckpt._io.storage.local.folder`): the manifest, then
``state.json`` and ``state.pkl`` (size and crc32c compared with the manifest on read), then ``state.safetensors``
(header validated in full). The structure must refer to exactly the tensors the file holds; any disagreement is a
:class:`~fastckpt.errors.HeaderError` naming the file, before any tensor is moved to a device. A pickle part is read
only with ``trust_pickle=True``; without it the load raises :class:`~fastckpt.errors.UnsafePickleError` naming the
part and the key paths it holds.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from fastckpt._format.json_input import load_json
from fastckpt._format.tensors import file_tensors
from fastckpt._io.storage.local.folder import open_safetensors
from fastckpt._io.storage.local.layout import (
    DICT_LAYOUT,
    DICT_PICKLE,
    DICT_STRUCTURE,
    DICT_TENSORS,
    MANIFEST,
    read_manifest,
)
from fastckpt._state.plain_dict import check_structure, rebuild
from fastckpt.errors import HeaderError, MissingStateError, UnsafePickleError

__all__ = ["read_dict_checkpoint", "target_device"]


def target_device(map_location: Any, recorded: str | None, *, name: str, where: str) -> torch.device:
    """The device tensor ``name`` loads to: ``map_location`` (a device, or a ``{saved: wanted}`` dict as
    ``torch.load`` takes), else the device it was saved from (``recorded``; None: CPU).

    Raises:
        ValueError: the device does not exist on this machine (CUDA without CUDA): names the tensor and says to
            pass ``map_location``.
    """
    saved = recorded or "cpu"
    if isinstance(map_location, dict):
        wanted = map_location.get(saved, saved)
    else:
        wanted = saved if map_location is None else map_location
    device = torch.device(wanted)
    if device.type == "cuda" and (not torch.cuda.is_available()
                                  or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"{where}: tensor {name!r} was saved from {saved}, which this machine does not have; "
                         "pass map_location='cpu' (or another device)")
    return device


def read_dict_checkpoint(folder: Path, *, map_location: Any = None, trust_pickle: bool = False) -> Any:
    """The object saved by ``fastckpt.save`` in ``folder`` (a pinned folder path); tensors land on
    ``map_location`` (see :func:`target_device`), CPU tensors as zero-copy views of a private mapping.

    Raises:
        MissingStateError: no manifest, or a folder saved by ``save_state`` (another layout).
        HeaderError / IntegrityError: a damaged or inconsistent folder (names the file).
        UnsafePickleError: the folder has a pickle part and ``trust_pickle`` is False.
        ValueError: a saved device this machine lacks and no ``map_location``.
    """
    manifest = read_manifest(folder)
    if manifest.get("layout") != DICT_LAYOUT:
        raise MissingStateError(f"{folder}: not a checkpoint dict (its {MANIFEST} records layout "
                                f"{manifest.get('layout')!r}, mode {manifest.get('mode')!r}); a training state "
                                "saved by save_state loads with fastckpt.load_state")
    files = manifest.get("files", {})
    for name in (DICT_STRUCTURE, DICT_TENSORS):
        if name not in files:
            raise MissingStateError(f"{folder}: {MANIFEST} lists no {name}; not a complete checkpoint dict")
    where = str(folder / DICT_STRUCTURE)
    structure = load_json((folder / DICT_STRUCTURE).read_bytes(), where)
    file = open_safetensors(folder / DICT_TENSORS)
    names = [entry[0] for entry in file.tensors()]
    check_structure(structure, where, set(names))
    pickled_paths = structure["pickled"]
    if (DICT_PICKLE in files) != bool(pickled_paths):
        raise HeaderError(f"{where}: records {len(pickled_paths)} pickled values but {MANIFEST} "
                          f"{'lists' if DICT_PICKLE in files else 'does not list'} {DICT_PICKLE}")
    values = _read_pickle_part(folder, pickled_paths, trust_pickle, map_location) if pickled_paths else []
    devices = structure["devices"]
    tensors = file_tensors(file)
    placed = {}
    for name, t in tensors.items():
        device = target_device(map_location, devices.get(name), name=name, where=str(folder / DICT_TENSORS))
        placed[name] = t if device.type == "cpu" else t.to(device)

    def pickled(index: Any) -> Any:
        if type(index) is not int or not 0 <= index < len(values):
            raise HeaderError(f"{where}: pickled value {index!r} is not in {DICT_PICKLE} ({len(values)} values)")
        return values[index]

    return rebuild(structure, placed, where=where, pickled=pickled)


def _read_pickle_part(folder: Path, paths: list[str], trust_pickle: bool, map_location: Any) -> list[Any]:
    part = folder / DICT_PICKLE
    if not trust_pickle:
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        raise UnsafePickleError(
            f"{part}: the checkpoint's pickle part holds {len(paths)} values only pickle can restore ({shown}); "
            "unpickling can run arbitrary code, so it is read only with trust_pickle=True. Nothing was loaded."
        )
    data = part.read_bytes()  # size and crc32c checked against the manifest
    location = map_location if map_location is not None else None
    values = torch.load(io.BytesIO(data), map_location=location, weights_only=False)
    if not isinstance(values, list) or len(values) != len(paths):
        raise HeaderError(f"{part}: holds {type(values).__name__} of {len(values) if isinstance(values, list) else '?'}"
                          f" values, {len(paths)} recorded in {DICT_STRUCTURE}")
    return values

"""Pickle-free files for the other objects a training loop checkpoints: anything with ``state_dict()``.

accelerate pickles them (``custom_checkpoint_{i}.pkl``, ``scaler.pt``, ``dl_state_dict.bin``). fastckpt writes each
as one safetensors file: the tensors of the state (an EMA model's weights, say) as tensors ``t.{k}``, and the rest of
the structure as JSON in the metadata key ``state`` through :mod:`fastckpt._format.codec` (exact floats, tuples, Counters,
numpy scalars; tensors referenced by key). Anything the codec cannot express raises ``TypeError`` at save time,
naming the path, instead of being pickled.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fastckpt._format.codec import decode, encode
from fastckpt._format.tensors import file_tensors
from fastckpt.errors import HeaderError

__all__ = ["FORMAT", "object_state_payload", "read_object_state"]

FORMAT = "fastckpt.object_state"


def object_state_payload(state: Any, *, label: str) -> tuple[dict[str, torch.Tensor], list[tuple[str, str]]]:
    """The tensors and metadata of one object-state file.

    Args:
        state: the object's ``state_dict()`` (nested dicts, lists, tuples, scalars, tensors, numpy values).
        label: where the state comes from, for error messages (``"custom_checkpoint_0"``).

    Returns:
        ``({tensor_name: tensor}, metadata pairs)``; the tensors are the object's own (no copies).

    Raises:
        TypeError: a value that cannot be stored without pickle (names its path and type).
    """
    tensors: dict[str, torch.Tensor] = {}

    def sink(path: str, t: torch.Tensor) -> str:
        key = f"t.{len(tensors)}"
        tensors[key] = t
        return key

    encoded = encode(state, path=label, tensor_sink=sink)
    return tensors, [("format", FORMAT), ("state", json.dumps(encoded))]


def read_object_state(file: Any) -> Any:
    """Read an object-state file (an opened ``fastckpt._core.SafetensorsFile``) into fresh CPU values.

    Raises:
        HeaderError: not an object-state file, or its JSON refers to a tensor the file lacks.
    """
    metadata = file.metadata() or {}
    if metadata.get("format") != FORMAT or "state" not in metadata:
        raise HeaderError(f"{file.path}: not a fastckpt object-state file (metadata format {metadata.get('format')!r})")
    tensors = {k: v.clone() for k, v in file_tensors(file).items()}

    def resolve(key: str) -> torch.Tensor:
        try:
            return tensors[key]
        except KeyError:
            raise HeaderError(f"{file.path}: state refers to tensor {key!r}, which the file does not hold") from None

    try:
        return decode(json.loads(metadata["state"]), tensors=resolve)
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        raise HeaderError(f"{file.path}: state is not valid fastckpt JSON: {exc}") from None

"""Trainable-only saves: write the parameters that train, record the frozen ones, check them on load.

``save_state(..., trainable_only=True)`` stores, per model, only the parameters with ``requires_grad`` (plus the
buffers the caller names in ``trainable_buffers``); every other state_dict entry is *frozen* and recorded in the
manifest by name, dtype, shape and content hash (xxh3-128, :mod:`fastckpt._io.tensor_hashes`)::

    "trainable_only": true,
    "frozen": {"model": {"base.layer.0.weight": {"dtype": "F32", "shape": [64, 64], "xxh3": "9f...e1"}, ...}}

A load of such a checkpoint into a model built from the same base checks the live frozen tensors against that
record before anything is changed (:func:`check_frozen`): a tensor missing from the model, or with another dtype,
shape or content, raises :class:`~fastckpt.errors.FrozenWeightsError` naming the first one (``strict=False``:
the check is skipped and the frozen names are reported as missing keys); then the trainable part is restored.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from fastckpt._format.dtypes import to_safetensors_dtype
from fastckpt._io.tensor_hashes import content_hashes
from fastckpt.errors import FrozenWeightsError, KeyMismatchError

__all__ = ["trainable_names", "frozen_record", "split_state", "check_frozen"]


def trainable_names(module: torch.nn.Module, buffers: Iterable[str] = ()) -> set[str]:
    """State_dict names of ``module`` that a trainable-only save writes: parameters with ``requires_grad`` and
    the buffers named in ``buffers`` (their fqns).

    Raises:
        KeyMismatchError: a name in ``buffers`` is not a buffer of ``module`` (names it and the buffers it has).
    """
    names = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    wanted = list(buffers)
    if wanted:
        have = {n for n, _ in module.named_buffers(remove_duplicate=False)}
        unknown = [b for b in wanted if b not in have]
        if unknown:
            raise KeyMismatchError(f"trainable_buffers {unknown} are not buffers of {type(module).__name__} "
                                   f"(its buffers: {sorted(have)[:10]})")
        names.update(wanted)
    return names


def frozen_record(live: Mapping[str, torch.Tensor], *, threads: int = 0) -> dict[str, dict[str, Any]]:
    """``{name: {"dtype", "shape", "xxh3"}}`` of the frozen tensors ``live`` (the live objects, so unchanged ones
    are not hashed again)."""
    hashes = content_hashes(live, threads=threads)
    return {name: {"dtype": to_safetensors_dtype(t.dtype, name=name), "shape": list(t.shape), "xxh3": hashes[name]}
            for name, t in live.items()}


def split_state(module: Any, tensors: dict[str, torch.Tensor], aliases: dict[str, str], buffers: Iterable[str],
                *, threads: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, dict[str, Any]]]:
    """Split a collected model state (``collect_model_state``'s result) into what a trainable-only save writes.

    Returns:
        ``(tensors, aliases, frozen)``: the trainable tensors, the aliases among them, and the record of every
        frozen state_dict name (tied duplicates included).
    """
    keep = trainable_names(module, buffers)
    live = module.state_dict(keep_vars=True)
    written = {n: t for n, t in tensors.items() if n in keep}
    kept_aliases = {a: k for a, k in aliases.items() if k in written}
    frozen = {n: t for n, t in live.items() if n not in written and n not in kept_aliases}
    return written, kept_aliases, frozen_record(frozen, threads=threads)


def check_frozen(module: torch.nn.Module, record: Mapping[str, Any], *, where: str, threads: int = 0) -> set[str]:
    """Check that ``module``'s frozen tensors are the ones a trainable-only checkpoint was saved from.

    Args:
        record: the manifest's ``frozen`` entry for this model (see the module docs).
        where: the checkpoint folder, for messages.

    Returns:
        The frozen names checked (they count as loaded).

    Raises:
        FrozenWeightsError: the first frozen tensor that is absent from ``module`` or differs in dtype, shape or
            content (names it, both values and the folder).
    """
    live = module.state_dict(keep_vars=True)
    cls = type(module).__name__
    for name, info in record.items():
        t = live.get(name)
        if t is None:
            raise FrozenWeightsError(f"{where}: frozen tensor {name!r} recorded by the trainable-only checkpoint is "
                                     f"not in {cls}; load it into a model built from the same base")
        dtype = to_safetensors_dtype(t.dtype, name=name)
        if dtype != info.get("dtype") or list(t.shape) != info.get("shape"):
            raise FrozenWeightsError(f"{where}: frozen tensor {name!r} was saved as {info.get('dtype')} "
                                     f"{info.get('shape')}, {cls} has {dtype} {list(t.shape)}; not the same base model")
    hashes = content_hashes({n: live[n] for n in record}, threads=threads)
    for name, info in record.items():
        if hashes[name] != info.get("xxh3"):
            raise FrozenWeightsError(
                f"{where}: frozen tensor {name!r} of {cls} differs from the one the checkpoint was saved with "
                f"(xxh3-128 {hashes[name]}, recorded {info.get('xxh3')}); not the same base weights. Pass "
                "strict=False to load the trainable part anyway. Nothing was changed."
            )
    return set(record)

"""Loading into state that already exists: read a checkpoint straight into the live optimizer tensors.

A resumed job has taken at least one step, so its optimizer already holds an ``exp_avg`` / ``exp_avg_sq`` of the
right shape, dtype and device for every parameter. Reading into fresh tensors and handing those to
``load_state_dict`` would fault in a second copy of the optimizer state (first touch of fresh memory is slow) and
then free the old one (``munmap`` of every page): profiled at about two thirds of a warm load. Instead,
:func:`live_optimizer_targets` picks the live tensors that can take the stored bytes as they are, the load plan
reads into them in phase 2 (after every file was validated in phase 1), and ``load_state_dict`` receives the very
same tensors, so torch keeps them (its ``.to(dtype, device)`` is then a no-op).

A live tensor is used only when it matches the stored tensor exactly (shape, dtype), is dense and contiguous,
sits where the state would end up (CPU, or the CUDA device of a ``map_location``-less load), and is not shared
with another state entry; anything else is read into a fresh tensor in phase 1, as before.
"""

from __future__ import annotations

from typing import Any

import torch

from fastckpt._format.dtypes import to_safetensors_dtype, torch_shape
from fastckpt.errors import DtypeError

__all__ = ["live_optimizer_targets", "read_tensors"]


def _usable(live: Any, dtype_name: str, shape: list[int], path: str, name: str, map_location: Any) -> bool:
    if not isinstance(live, torch.Tensor) or live.layout != torch.strided or live.numel() == 0:
        return False
    if live.is_conj() or live.is_neg() or not live.is_contiguous() or live.requires_grad:
        return False
    if live.device.type not in ("cpu", "cuda"):
        return False
    if map_location is not None:
        want = torch.device(map_location)
        if want.type != live.device.type or (want.index is not None and want.index != live.device.index):
            return False
    try:
        if to_safetensors_dtype(live.dtype, name=name) != dtype_name:
            return False
        return list(live.shape) == torch_shape(dtype_name, shape, name=name, path=path)
    except (DtypeError, ValueError):
        return False


def live_optimizer_targets(
    optimizer: torch.optim.Optimizer,
    flat_fqns: list[str],
    entries: dict[str, tuple],
    *,
    path: str,
    map_location: Any = None,
) -> dict[str, torch.Tensor]:
    """``{stored tensor name: live tensor}`` for every stored ``state.{fqn}.{name}`` whose live counterpart can
    receive its bytes in place (see the module docs).

    Args:
        optimizer: the live optimizer.
        flat_fqns: the fqn of each parameter, in ``param_groups`` order.
        entries: the file's tensors, ``{name: (name, dtype, shape, begin, end)}``.
        path: the file (for messages).
        map_location: the load's ``map_location``.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    found: dict[str, torch.Tensor] = {}
    owners: dict[tuple, list[str]] = {}
    for fqn, param in zip(flat_fqns, params):
        for name, live in optimizer.state.get(param, {}).items():
            key = f"state.{fqn}.{name}"
            entry = entries.get(key)
            if entry is None or not _usable(live, entry[1], entry[2], path, key, map_location):
                continue
            found[key] = live
            owners.setdefault((live.device, live.untyped_storage().data_ptr()), []).append(key)
    for keys in owners.values():  # a storage shared by two entries would be filled twice: read those fresh
        if len(keys) > 1:
            for key in keys:
                del found[key]
    return found


def read_tensors(file: Any, targets: list[tuple[str, torch.Tensor]], *, threads: int = 0) -> None:
    """Fill each live tensor with the stored tensor of that name: CPU tensors by the core's parallel positional
    reads straight into their memory, CUDA tensors through pinned bounce buffers (:mod:`fastckpt._io.device_load`).

    Raises:
        KeyMismatchError / ValueError: a name the file lacks, or a size that differs (checked in phase 1).
        OSError / TruncatedFileError: the read failed.
    """
    from fastckpt._format.tensors import destination_buffer

    host, device = [], []
    for name, t in targets:
        buf = destination_buffer(t)
        if buf is not None:
            host.append((name, buf))
        else:
            device.append((name, t))
    if host:
        file.read_into(host, threads=threads)
    if device:
        from fastckpt._io.device_load import read_to_device

        read_to_device(file, device, threads=threads)

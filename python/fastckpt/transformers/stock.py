"""Resuming from a checkpoint the stock ``transformers.Trainer`` wrote: ``optimizer.pt``, ``scheduler.pt``,
``scaler.pt`` and ``rng_state.pth`` / ``rng_state_{process_index}.pth`` are ``torch.save`` pickles.

Each is read with ``torch.load(weights_only=True)`` (and accelerate's allowlist of the numpy globals that
``np.random.get_state()`` needs; :func:`fastckpt._plan.accelerate_format.torch_load`); a file that needs full
unpickling is refused with :class:`~fastckpt.errors.UnsafePickleError` naming it, a damaged one with
:class:`~fastckpt.errors.HeaderError`. Every file of a step is read and checked before anything is applied. The
model weights (``model.safetensors``) are read by Trainer itself (safetensors, no pickle).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from fastckpt._plan.accelerate_format import torch_load
from fastckpt._state.rng import RngRestoreWarning, RngState
from fastckpt.errors import HeaderError

__all__ = ["load_optimizer_and_scheduler", "load_scaler", "load_rng_state", "rng_file_name"]

OPTIMIZER = "optimizer.pt"  # transformers.trainer.OPTIMIZER_NAME
SCHEDULER = "scheduler.pt"  # SCHEDULER_NAME
SCALER = "scaler.pt"  # SCALER_NAME


def _dict(state: Any, path: Path, what: str) -> dict:
    if not isinstance(state, dict):
        raise HeaderError(f"{path}: holds a {type(state).__name__}, not {what} state_dict; nothing was changed")
    return state


def load_optimizer_and_scheduler(folder: Path, optimizer: Any, scheduler: Any) -> None:
    """Restore ``optimizer`` and ``scheduler`` from ``optimizer.pt`` / ``scheduler.pt``; both files must be there
    (Trainer's rule: otherwise neither is loaded and both start fresh).

    Raises:
        UnsafePickleError, HeaderError: a file cannot be read with ``weights_only=True`` (names it).
        ValueError: the optimizer state does not fit the optimizer (torch's check, before it changes anything).
    """
    opt_path, sched_path = folder / OPTIMIZER, folder / SCHEDULER
    if not (opt_path.is_file() and sched_path.is_file()):
        return
    opt_state = _dict(torch_load(opt_path, what="the optimizer"), opt_path, "an optimizer")
    sched_state = _dict(torch_load(sched_path, what="the LR scheduler"), sched_path, "an LR scheduler")
    optimizer.load_state_dict(opt_state)
    scheduler.load_state_dict(sched_state)


def load_scaler(folder: Path, scaler: Any) -> None:
    """Restore the GradScaler from ``scaler.pt`` when both exist."""
    path = folder / SCALER
    if scaler is None or not path.is_file():
        return
    scaler.load_state_dict(_dict(torch_load(path, what="the GradScaler"), path, "a GradScaler"))


def rng_file_name(process_index: int, world_size: int) -> str:
    """Trainer's RNG file name: ``rng_state.pth`` in one process, ``rng_state_{process_index}.pth`` in several."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{process_index}.pth"


def load_rng_state(folder: Path, process_index: int, world_size: int) -> None:
    """Restore Python's, numpy's, torch's CPU and the CUDA RNG states from this process's RNG file (validated on
    scratch generators first, :meth:`fastckpt._state.rng.RngState.check`).

    Warns:
        RngRestoreWarning: the file is absent (the run continues with the current RNG states).

    Raises:
        UnsafePickleError, HeaderError: the file cannot be read with ``weights_only=True`` or lacks a stream.
    """
    path = folder / rng_file_name(process_index, world_size)
    if not path.is_file():
        warnings.warn(f"{folder}: holds no {path.name}; process {process_index} keeps its RNG states (the resumed "
                      "run is not exact)", RngRestoreWarning, stacklevel=3)
        return
    state = _dict(torch_load(path, what="the RNG states"), path, "an RNG")
    try:
        cuda = state.get("cuda")
        cuda = [] if cuda is None else list(cuda) if isinstance(cuda, (list, tuple)) else [cuda]
        numpy = state["numpy"]
        rng = RngState(step=0, python=tuple(state["python"]), numpy=(numpy[0], numpy[1], *numpy[2:]),
                       torch_cpu=state["cpu"], cuda=[torch.as_tensor(c) for c in cuda], path=str(path))
    except (KeyError, TypeError, IndexError) as exc:
        raise HeaderError(f"{path}: not Trainer's RNG states ({type(exc).__name__}: {exc}); nothing was "
                          "changed") from None
    rng.check().restore()

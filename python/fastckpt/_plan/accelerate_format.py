"""accelerate's own checkpoint files: their names, the pickle policy for reading them, and writing them.

``Accelerator.save_state`` writes (``i`` > 0 adds ``_i`` to the first name of each kind):

===================================  ==========================================================================
``model.safetensors``                the state dict, tied duplicates dropped, metadata ``{"format": "pt"}``
``pytorch_model.bin``                the same with ``safe_serialization=False`` (torch.save)
``optimizer.bin``                    ``optimizer.state_dict()``: state keyed by *position* in ``param_groups``
``scheduler.bin``                    ``scheduler.state_dict()``
``random_states_{rank}.pkl``         ``{"step", "random_state", "numpy_random_seed", "torch_manual_seed",
                                     "torch_cuda_manual_seed"}``, one file per process
``custom_checkpoint_{i}.pkl``        a registered object's ``state_dict()``
``scaler.pt``                        ``GradScaler.state_dict()``
``sampler.bin``, ``dl_state_dict.bin``  a pickled ``SeedableRandomSampler`` / a stateful dataloader's state
===================================  ==========================================================================

Every non-safetensors file is ``torch.save``'s zip/pickle format. Reading uses ``torch.load(weights_only=True)``
with accelerate's own allowlist of numpy globals (what RNG states need); a file that needs more (a pickled sampler
or custom object, numpy scalars in a scheduler state) loads only with ``trust_pickle=True``, otherwise
:class:`~fastckpt.errors.UnsafePickleError` names the file and the global it needs. Writing (``compat="accelerate"``)
is the one place fastckpt pickles, on request.
"""

from __future__ import annotations

import codecs
import io
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.storage.local.layout import part_name
from fastckpt._state.hf_files import hf_model_files
from fastckpt._state.model import collect_model_state
from fastckpt._state.rng import RngState
from fastckpt._state.subclasses import refuse_subclasses
from fastckpt.errors import HeaderError, MissingStateError, UnsafePickleError

__all__ = [
    "SAFE_GLOBALS", "torch_load", "torch_save_bytes", "model_file", "rng_file", "custom_file",
    "accelerate_rng_state", "rng_state_from_accelerate", "build_accelerate_plan",
    "SCALER_NAME", "sampler_file", "dl_state_file",
]

SCALER_NAME = "scaler.pt"


def _safe_globals() -> list[Any]:
    np_core = np._core if hasattr(np, "_core") else np.core  # numpy 2 renamed np.core
    allowed: list[Any] = [np_core.multiarray._reconstruct, np.ndarray, codecs.encode, np.dtype]
    if hasattr(np, "dtypes") and hasattr(np.dtypes, "UInt32DType"):
        allowed.append(np.dtypes.UInt32DType)
    return allowed


#: accelerate 1.15's ``TORCH_SAFE_GLOBALS``: what ``np.random.get_state()`` needs under ``weights_only=True``.
SAFE_GLOBALS: list[Any] = _safe_globals()


def model_file(i: int, *, safe: bool = True) -> str:
    """``model.safetensors`` / ``model_1.safetensors`` (``pytorch_model.bin`` ... when not ``safe``)."""
    return part_name("model", i, ".safetensors") if safe else part_name("pytorch_model", i, ".bin")


def rng_file(rank: int) -> str:
    """``random_states_{rank}.pkl``."""
    return f"random_states_{rank}.pkl"


def custom_file(i: int) -> str:
    """``custom_checkpoint_{i}.pkl``."""
    return f"custom_checkpoint_{i}.pkl"


def sampler_file(i: int) -> str:
    """``sampler.bin`` / ``sampler_1.bin``."""
    return part_name("sampler", i, ".bin")


def dl_state_file(i: int) -> str:
    """``dl_state_dict.bin`` / ``dl_state_dict_1.bin``."""
    return part_name("dl_state_dict", i, ".bin")


def _refusal_reason(exc: BaseException) -> str:
    text = str(exc)
    m = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if m:
        return f"it holds a {m.group(1)} object, which is outside accelerate's allowlist of safe globals"
    m = re.search(r"WeightsUnpickler error: ([^\n]+)", text)
    return m.group(1).strip() if m else text.strip().splitlines()[0]


def torch_load(path: Path, *, trust_pickle: bool = False, what: str = "state") -> Any:
    """Read one of accelerate's ``torch.save`` files onto the CPU, as safely as its content allows.

    Args:
        path: the file (``optimizer.bin``, ``random_states_0.pkl``, ...).
        trust_pickle: allow full unpickling when ``weights_only=True`` with accelerate's allowlist refuses the file.
            Full unpickling can run arbitrary code: only for files you trust.
        what: what the file holds, for messages (``"scheduler 0"``).

    Raises:
        MissingStateError: the file does not exist.
        UnsafePickleError: the file needs full unpickling and ``trust_pickle`` is False (says which global).
        HeaderError: not a readable torch.save file (truncated, not a zip archive).
    """
    if not path.is_file():
        raise MissingStateError(f"{path.parent}: {what} needs {path.name}, which the checkpoint does not hold")
    try:
        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            if not trust_pickle:
                raise UnsafePickleError(
                    f"{path}: {what} cannot be read with weights_only=True: {_refusal_reason(exc)}. Reading it needs "
                    "full unpickling, which can run arbitrary code; pass trust_pickle=True only for a checkpoint "
                    "you trust"
                ) from None
            return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise HeaderError(f"{path}: not a readable torch.save file ({type(exc).__name__}: {exc})") from None


def torch_save_bytes(obj: Any) -> bytes:
    """``torch.save(obj)``'s bytes (zip format), as accelerate writes its ``.bin`` / ``.pkl`` / ``.pt`` files."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def accelerate_rng_state(step: int) -> dict[str, Any]:
    """This process's RNG states as accelerate's ``random_states_{rank}.pkl`` dict, keys in accelerate's order."""
    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def rng_state_from_accelerate(states: Any, path: Path) -> RngState:
    """Validate an accelerate RNG dict and turn it into fastckpt's :class:`~fastckpt._state.rng.RngState`.

    Raises:
        HeaderError: a missing entry or one of the wrong kind (names the file and the entry).
    """
    try:
        if not isinstance(states, dict):
            raise TypeError(f"a {type(states).__name__}, not a dict")
        version, words, gauss_next = states["random_state"]
        kind, keys, pos, has_gauss, cached = states["numpy_random_seed"]
        torch_cpu = states["torch_manual_seed"]
        cuda = list(states.get("torch_cuda_manual_seed", []))
        if len(words) != 625 or len(keys) != 624 or not isinstance(torch_cpu, torch.Tensor):
            raise ValueError(f"python state of {len(words)} words, numpy of {len(keys)} keys")
        if not all(isinstance(c, torch.Tensor) for c in cuda):
            raise TypeError("torch_cuda_manual_seed holds a non-tensor")
        return RngState(
            step=int(states.get("step", 0)),
            python=(int(version), tuple(int(w) for w in words), gauss_next),
            numpy=(str(kind), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)),
            torch_cpu=torch_cpu.to(torch.uint8),
            cuda=[c.to(torch.uint8) for c in cuda],
            path=str(path),
        ).check()
    except HeaderError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise HeaderError(f"{path}: not a valid accelerate random states file ({type(exc).__name__}: {exc})") from None


def build_accelerate_plan(
    models: list[torch.nn.Module],
    optimizers: list[Any],
    schedulers: list[Any],
    *,
    model_only: bool,
    step: int = 0,
    model_states: list[dict[str, torch.Tensor]] | None = None,
    rng_pickles: list[bytes] | None = None,
) -> SavePlan:
    """The files ``Accelerator.save_state`` writes, as a :class:`~fastckpt._io.files.SavePlan` (``compat="accelerate"``).

    Models go to unsharded ``model{_i}.safetensors`` with accelerate's metadata ``{"format": "pt"}`` and tied
    duplicates dropped; optimizers, schedulers and RNG states are ``torch.save`` bytes. A model-only plan holds the
    model files, ``config.json`` and ``generation_config.json`` (for ``from_pretrained``); a full plan holds exactly accelerate's files.

    Args:
        model_states: state dicts to write instead of ``models``' own (accelerate's save hooks may edit them).
        rng_pickles: ``random_states_{rank}.pkl`` bytes per rank; None: this process's states as rank 0.

    Raises:
        TypeError: a model state entry that is not a tensor (safetensors stores tensors only).
    """
    if model_only:
        optimizers, schedulers = [], []
    states = model_states if model_states is not None else [m.state_dict() for m in models]
    plan = SavePlan(
        mode="model_only" if model_only else "full",
        step=step,
        counts={"models": len(states), "optimizers": len(optimizers), "schedulers": len(schedulers),
                "layout": "accelerate"},
    )
    for i, sd in enumerate(states):
        tensors, _aliases = collect_model_state(sd, unwrap_compiled=False)  # the names stock accelerate reads
        refuse_subclasses(_aliases, why="compat='accelerate' writes the files stock accelerate reads, which hold no "
                                        "tensor subclass; save with fastckpt's layout (compat=None)")
        plan.parts.append(FilePart(model_file(i), tensors, [("format", "pt")]))
    if model_only:
        if models:
            plan.texts.update(hf_model_files(models[0]))  # config.json, generation_config.json
        return plan
    for j, opt in enumerate(optimizers):
        plan.texts[part_name("optimizer", j, ".bin")] = torch_save_bytes(opt.state_dict())
    for k, sched in enumerate(schedulers):
        plan.texts[part_name("scheduler", k, ".bin")] = torch_save_bytes(sched.state_dict())
    if rng_pickles is None:
        rng_pickles = [torch_save_bytes(accelerate_rng_state(step))]
    for rank, data in enumerate(rng_pickles):
        plan.texts[rng_file(rank)] = data
    return plan

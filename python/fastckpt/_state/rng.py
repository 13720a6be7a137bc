"""Random number generator states: ``random_states_{rank}.safetensors``.

Holds what accelerate's ``random_states_{rank}.pkl`` holds, without pickle: the ``step`` counter (I64 scalar),
Python's ``random`` Mersenne Twister (625 words, I64), numpy's legacy global ``RandomState`` (624 U32 keys plus
position and Gaussian cache in metadata), the torch CPU generator (U8) and every CUDA device's generator
(``cuda.{i}``, U8). Restore failures raise instead of being logged and swallowed (accelerate's behaviour);
CUDA states for devices this machine lacks are skipped with a warning (case C24).
"""

from __future__ import annotations

import json
import os
import random
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastckpt._format.json_input import load_json
from fastckpt._format.tensors import file_tensors
from fastckpt.errors import HeaderError

__all__ = ["rng_payload", "RngState", "read_rng_state", "RngRestoreWarning", "warn_unrestored"]

FORMAT = "fastckpt.random_states"


class RngRestoreWarning(UserWarning):
    """A saved RNG stream could not be restored on this machine (e.g. more CUDA devices saved than present)."""


def rng_payload(step: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Snapshot every RNG stream: ``({tensor_name: tensor}, metadata)`` for the random states file."""
    version, words, gauss_next = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    tensors = {
        "step": torch.tensor(int(step), dtype=torch.int64, device="cpu"),
        "python": torch.tensor(words, dtype=torch.int64, device="cpu"),
        "numpy": torch.from_numpy(np.ascontiguousarray(np_keys, dtype=np.uint32)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    metadata = {
        "format": FORMAT,
        "python": json.dumps({"version": version, "gauss_next": gauss_next}),
        "numpy": json.dumps({"kind": np_kind, "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                             "cached_gaussian": float(np_cached)}),
    }
    return tensors, metadata


@dataclass
class RngState:
    """A validated RNG snapshot read from disk; :meth:`restore` applies it."""

    step: int
    python: tuple
    numpy: tuple
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor]
    path: str

    def check(self) -> RngState:
        """Set every stream on a scratch generator (changing no global one), so a state that Python, numpy or
        torch would refuse (``Invalid mt19937 state``) is refused here, in phase 1 of a load.

        Raises:
            HeaderError: a stream that does not load (names the file and the stream).
        """
        stream = "python"
        try:
            random.Random().setstate(self.python)
            stream = "numpy"
            kind, _keys, pos, has_gauss, _cached = self.numpy
            if kind != "MT19937" or not 0 <= int(pos) <= 624 or int(has_gauss) not in (0, 1):
                raise ValueError(f"kind {kind!r}, pos {pos} (0..624), has_gauss {has_gauss} (0 or 1)")
            np.random.RandomState().set_state(self.numpy)
            stream = "torch"
            torch.Generator().set_state(self.torch_cpu)
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            for i, state in enumerate(self.cuda[:available]):
                stream = f"cuda.{i}"
                torch.Generator(device=f"cuda:{i}").set_state(state)
            if not isinstance(self.step, int) or isinstance(self.step, bool):
                stream = "step"
                raise TypeError(f"step is a {type(self.step).__name__}")
        except (ValueError, TypeError, RuntimeError, OverflowError, IndexError) as exc:
            raise HeaderError(
                f"{self.path}: the saved {stream} RNG state is invalid ({type(exc).__name__}: {exc}); "
                "nothing was changed"
            ) from None
        return self

    def restore(self) -> None:
        """Set Python, numpy, torch CPU and CUDA generators; warns for CUDA devices this machine lacks."""
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if not self.cuda:
            return
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for i, state in enumerate(self.cuda[:available]):
            torch.cuda.set_rng_state(state, device=i)
        if len(self.cuda) > available:
            warnings.warn(
                f"{self.path}: holds RNG states for {len(self.cuda)} CUDA device(s) but this machine has "
                f"{available}; restored {available}, skipped devices {list(range(available, len(self.cuda)))}",
                RngRestoreWarning,
                stacklevel=3,
            )


def read_rng_state(file: Any) -> RngState:
    """Read and validate a random states file (an opened ``_core.SafetensorsFile``); changes no generator.

    Raises:
        HeaderError: missing entries, wrong shapes, or a stream its generator refuses (names the file and the entry).
    """
    path = file.path
    metadata = file.metadata() or {}
    tensors = {k: v.clone() for k, v in file_tensors(file).items()}
    try:
        py = load_json(metadata["python"], f"{path}: metadata 'python'")
        npm = load_json(metadata["numpy"], f"{path}: metadata 'numpy'")
        words = tensors["python"]
        keys = tensors["numpy"]
        state = RngState(
            step=int(tensors["step"].item()),
            python=(py["version"], tuple(int(w) for w in words.tolist()), py["gauss_next"]),
            numpy=(npm["kind"], keys.numpy().astype(np.uint32), npm["pos"], npm["has_gauss"], npm["cached_gaussian"]),
            torch_cpu=tensors["torch"],
            cuda=[tensors[f"cuda.{i}"] for i in range(sum(k.startswith("cuda.") for k in tensors))],
            path=path,
        )
    except HeaderError:
        raise
    except (KeyError, ValueError, TypeError, IndexError, AttributeError, OverflowError) as exc:
        raise HeaderError(f"{path}: not a valid fastckpt random states file ({type(exc).__name__}: {exc})") from None
    if len(state.python[1]) != 625 or keys.numel() != 624:
        raise HeaderError(
            f"{path}: python state has {len(state.python[1])} words (expected 625), numpy {keys.numel()} (expected 624)"
        )
    return state.check()


_RNG_FILE = re.compile(r"^random_states_(\d+)\.(?:safetensors|pkl)$")


def warn_unrestored(folder: Path, world_size: int, *, stacklevel: int = 3) -> list[str]:
    """Warn (:class:`RngRestoreWarning`) naming the ``random_states_{rank}`` files of ``folder`` whose rank this
    run of ``world_size`` processes does not have (a checkpoint saved by more processes): their RNG states are not
    restored. Returns those file names (empty: nothing to warn about)."""
    extra = sorted((int(m.group(1)), name) for name in os.listdir(folder)
                   if (m := _RNG_FILE.match(name)) and int(m.group(1)) >= world_size)
    if extra:
        names = [name for _, name in extra]
        warnings.warn(
            f"{folder}: saved by {extra[-1][0] + 1} processes, resumed by {world_size}: the RNG states of "
            f"processes {[k for k, _ in extra]} ({', '.join(names)}) are not restored; "
            + ("process 0 restores its own" if world_size == 1 else f"processes 0..{world_size - 1} restore their own"),
            RngRestoreWarning,
            stacklevel=stacklevel,
        )
        return names
    return []

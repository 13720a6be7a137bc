"""fastckpt: fast, pickle-free, crash-safe PyTorch checkpoints with a Rust core.

``save_state`` / ``load_state`` write and read accelerate's checkpoint layout (safetensors + JSON, no pickle) with
a ``model_only`` switch on both sides; ``fastckpt.torch`` is a drop-in ``safetensors.torch``.
"""

from __future__ import annotations

from fastckpt._io.async_save.writer import AsyncSave, release_buffers
from fastckpt._io.storage.local.integrity import VerifyReport, check_checkpoint
from fastckpt._io.storage.tiered.upload import TieredSave
from fastckpt._state.rng import RngRestoreWarning
from fastckpt._version import __version__
from fastckpt.checkpoint import LoadResult, latest_checkpoint, load_state, save_state, verify_checkpoint
from fastckpt.errors import (
    CheckpointChangedError,
    CheckpointError,
    ClosedFileError,
    CollectiveTimeoutError,
    ConcurrentModificationError,
    ConcurrentSaveError,
    DestinationNotWritableError,
    DtypeError,
    DurableSaveError,
    FrozenWeightsError,
    HeaderError,
    IntegrityError,
    KeyMismatchError,
    MemoryTierFullWarning,
    MetaTensorError,
    MissingStateError,
    OptionError,
    OptionTypeError,
    ResumeWarning,
    SaveCancelledError,
    ShapeMismatchError,
    TierSkippedWarning,
    TruncatedFileError,
    UnsafePickleError,
)
from fastckpt.manager import CheckpointManager, Preempted, release_kept

#: public submodules loaded on first attribute access (``fastckpt.torch.save_file``): torch-free tooling and an
#: optional accelerate stay out of ``import fastckpt``
_LAZY_SUBMODULES = ("accelerate", "torch", "cli", "demo", "lightning")
#: public functions loaded on first use, from the module that holds them
_LAZY_FUNCTIONS = {"save": "plain", "load": "plain"}


def __getattr__(name: str):
    import importlib

    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY_FUNCTIONS:
        return getattr(importlib.import_module(f".{_LAZY_FUNCTIONS[name]}", __name__), name)
    raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES) | set(_LAZY_FUNCTIONS))


__all__ = [
    "save",
    "load",
    "save_state",
    "load_state",
    "latest_checkpoint",
    "verify_checkpoint",
    "check_checkpoint",
    "VerifyReport",
    "LoadResult",
    "AsyncSave",
    "TieredSave",
    "RngRestoreWarning",
    "CheckpointManager",
    "Preempted",
    "release_kept",
    "TierSkippedWarning",
    "MemoryTierFullWarning",
    "ResumeWarning",
    "CheckpointError",
    "OptionError",
    "OptionTypeError",
    "DestinationNotWritableError",
    "DurableSaveError",
    "HeaderError",
    "TruncatedFileError",
    "MissingStateError",
    "KeyMismatchError",
    "IntegrityError",
    "ShapeMismatchError",
    "DtypeError",
    "FrozenWeightsError",
    "UnsafePickleError",
    "ClosedFileError",
    "MetaTensorError",
    "CollectiveTimeoutError",
    "CheckpointChangedError",
    "ConcurrentModificationError",
    "SaveCancelledError",
    "ConcurrentSaveError",
    "release_buffers",
    "__version__",
]

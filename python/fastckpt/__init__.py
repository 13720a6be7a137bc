"""fastckpt: fast, pickle-free, crash-safe PyTorch checkpoints with a Rust core.

``save_state`` / ``load_state`` write and read accelerate's checkpoint layout (safetensors + JSON, no pickle) with
a ``model_only`` switch on both sides; ``fastckpt.torch`` is a drop-in ``safetensors.torch``.
"""

from __future__ import annotations

from fastckpt._io.async_writer import AsyncSave, release_buffers
from fastckpt._io.integrity import VerifyReport, check_checkpoint, verify_checkpoint
from fastckpt._io.layout import latest_checkpoint
from fastckpt._state.rng import RngRestoreWarning
from fastckpt._version import __version__
from fastckpt.checkpoint import LoadResult, load_state, save_state
from fastckpt.errors import (
    CheckpointError,
    ConcurrentModificationError,
    DtypeError,
    HeaderError,
    IntegrityError,
    KeyMismatchError,
    MissingStateError,
    ShapeMismatchError,
    TruncatedFileError,
    UnsafePickleError,
)


def __getattr__(name: str):  # ``fastckpt.accelerate`` on first use: accelerate stays an optional dependency
    if name == "accelerate":
        import importlib

        return importlib.import_module(".accelerate", __name__)
    raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")



__all__ = [
    "save_state",
    "load_state",
    "latest_checkpoint",
    "verify_checkpoint",
    "check_checkpoint",
    "VerifyReport",
    "LoadResult",
    "AsyncSave",
    "RngRestoreWarning",
    "CheckpointError",
    "HeaderError",
    "TruncatedFileError",
    "MissingStateError",
    "KeyMismatchError",
    "IntegrityError",
    "ShapeMismatchError",
    "DtypeError",
    "UnsafePickleError",
    "ConcurrentModificationError",
    "release_buffers",
    "__version__",
]

"""fastckpt: fast, pickle-free, crash-safe PyTorch checkpoints with a Rust core.

``save_state`` / ``load_state`` write and read accelerate's checkpoint layout (safetensors + JSON, no pickle) with
a ``model_only`` switch on both sides; ``fastckpt.torch`` is a drop-in ``safetensors.torch``.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from ._async import AsyncSave
from ._integrity import VerifyReport, check_checkpoint, verify_checkpoint
from ._layout import latest_checkpoint
from ._rng import RngRestoreWarning
from .checkpoint import LoadResult, load_state, save_state
from .errors import (
    CheckpointError,
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


try:
    __version__ = _metadata.version("fastckpt")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0+unknown"

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
    "__version__",
]

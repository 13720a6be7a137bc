"""``__version__``: the installed distribution's version (``0+unknown`` in a source tree that was never installed).

Layer 0, like :mod:`fastckpt.errors`: any module may import it (the manifest records it).
"""

from __future__ import annotations

from importlib import metadata as _metadata

__all__ = ["__version__"]

try:
    __version__ = _metadata.version("fastckpt")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0+unknown"

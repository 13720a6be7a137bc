"""``__version__``: the installed distribution's version (``0+unknown`` in a source tree that was never installed).

The distribution is ``fastckpt-rs`` (:data:`DISTRIBUTION`); its version is set once, in Cargo.toml's
``[workspace.package]``, which maturin writes into the wheel's metadata. Reading ``fastckpt``'s metadata instead would
report the unrelated project of that name when it is installed.

Layer 0, like :mod:`fastckpt.errors`: any module may import it (the manifest records it).
"""

from __future__ import annotations

from importlib import metadata as _metadata

__all__ = ["__version__", "DISTRIBUTION"]

#: the name on the package index (``pip install fastckpt-rs``); the import name is ``fastckpt``
DISTRIBUTION = "fastckpt-rs"

try:
    __version__ = _metadata.version(DISTRIBUTION)
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0+unknown"

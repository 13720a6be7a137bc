"""Where checkpoints live: the storage interface (:mod:`.base`) and one sub-package per backend.

A path or URL becomes one :class:`~fastckpt._io.storage.base.Storage` exactly once, at the public call; nothing
below the entry points branches on the scheme. See docs/ARCHITECTURE.md for what a new backend implements.

May import: everything in ``_io`` (it maps each URL scheme to its backend); ``base`` imports only layers 0-1, and
each backend sub-package imports ``base``, never this package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastckpt._io.storage.base import CheckpointView, Committed, StagedSave, Storage

__all__ = ["CheckpointView", "Committed", "StagedSave", "Storage", "resolve"]


def resolve(location: str | os.PathLike[str] | None, *, project_dir: str | os.PathLike[str] | None = None,
            storage_options: Mapping[str, Any] | None = None, what: str = "output_dir", remote: Any = None) -> Storage:
    """The :class:`Storage` that ``location`` names (see :func:`fastckpt._io.storage.schemes.resolve`: one line per
    URL scheme). Imported when called, so that importing a backend module never loads every backend."""
    from fastckpt._io.storage.schemes import resolve as resolve_scheme

    return resolve_scheme(location, project_dir=project_dir, storage_options=storage_options, what=what,
                          remote=remote)

"""Where checkpoints live: the storage interface (:mod:`.base`) and one sub-package per backend.

A path or URL becomes one :class:`~fastckpt._io.storage.base.Storage` exactly once, at the public call; nothing
below the entry points branches on the scheme. See docs/ARCHITECTURE.md for what a new backend implements.
"""

from fastckpt._io.storage.base import CheckpointView, Committed, StagedSave, Storage

__all__ = ["CheckpointView", "Committed", "StagedSave", "Storage"]

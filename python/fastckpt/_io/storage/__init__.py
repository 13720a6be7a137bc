"""Where checkpoints live: the storage interface (:mod:`.base`) and one sub-package per backend.

A path or URL becomes one :class:`~fastckpt._io.storage.base.Storage` exactly once, at the public call; nothing
below the entry points branches on the scheme. See docs/ARCHITECTURE.md for what a new backend implements.

May import: everything in ``_io`` (it maps each URL scheme to its backend); ``base`` imports only layers 0-1, and
each backend sub-package imports ``base``, never this package.
"""

from fastckpt._io.storage.base import CheckpointView, Committed, StagedSave, Storage

__all__ = ["CheckpointView", "Committed", "StagedSave", "Storage"]

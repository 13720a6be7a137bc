"""PyTorch Lightning: ``Trainer(plugins=[fastckpt.lightning.CheckpointIO()])`` writes every checkpoint
(``ModelCheckpoint``'s, ``trainer.save_checkpoint``'s) as a pickle-free, crash-safe folder and resumes from it with
``trainer.fit(..., ckpt_path=...)``; see :mod:`fastckpt.lightning.checkpoint_io`. Needs ``pytorch-lightning``."""

from __future__ import annotations

from fastckpt.lightning.checkpoint_io import RNG_KEY, CheckpointIO

__all__ = ["CheckpointIO", "RNG_KEY"]

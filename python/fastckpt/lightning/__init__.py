"""PyTorch Lightning: ``Trainer(plugins=[fastckpt.lightning.CheckpointIO()])`` writes every checkpoint
(``ModelCheckpoint``'s, ``trainer.save_checkpoint``'s) as a pickle-free, crash-safe folder and resumes from it with
``trainer.fit(..., ckpt_path=...)``; see :mod:`fastckpt.lightning.checkpoint_io`. :class:`RankRNGStates` saves every
process's RNG states (:mod:`fastckpt.lightning.rng`); :func:`load_from_checkpoint` is
``LightningModule.load_from_checkpoint`` for these folders; :class:`PreemptionCheckpoint` saves the step reached on
SIGTERM / SIGUSR1 and stops the fit (:mod:`fastckpt.lightning.preemption`). Needs ``pytorch-lightning``."""

from __future__ import annotations

from fastckpt.lightning.checkpoint_io import CheckpointIO
from fastckpt.lightning.loading import load_from_checkpoint
from fastckpt.lightning.preemption import PreemptionCheckpoint
from fastckpt.lightning.rng import RNG_KEY, RankRNGStates

__all__ = ["CheckpointIO", "PreemptionCheckpoint", "RNG_KEY", "RankRNGStates", "load_from_checkpoint"]

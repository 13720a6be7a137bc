"""A mid-epoch resume draws what the uninterrupted run drew: the RNG states are restored again once the training
loader's iterator is rebuilt.

Making a DataLoader iterator draws from the global torch RNG (torch's ``_BaseDataLoaderIter`` takes its base seed
with ``torch.empty((), dtype=torch.int64).random_(generator=loader.generator)``, so from the global generator when
the loader has none: ``StatefulDataLoader(dataset, batch_size=..., sampler=sampler)`` as most users write it). The
uninterrupted run made the epoch's iterator at the epoch's start, before the checkpoint; a run resumed in that
epoch makes it again (Lightning's ``setup_data``, from the loader state saved in ``loops``) after
:meth:`~fastckpt.lightning.CheckpointIO.load_checkpoint` restored the RNG states, so without more every later draw
(dropout masks, augmentations) would be shifted by that one draw.

:class:`~fastckpt.lightning.CheckpointIO` therefore restores the states at load (right for a resume at an epoch
boundary, where the uninterrupted run too makes the next epoch's iterator after the checkpoint) and hands them to
:class:`RestoreAfterLoader`, a callback it attaches to the ``Trainer`` that is loading (found on the call stack:
Lightning's ``CheckpointIO`` API passes no trainer). Its ``on_train_start`` runs after the iterator was rebuilt and
before the first batch is fetched; when the run continues the epoch the checkpoint was taken in, it restores the
same states again, so the next draw is the uninterrupted run's next draw. Batches the loader's workers make are
seeded from the base seed ``StatefulDataLoader`` saves with its state, not from this draw.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytorch_lightning as pl

from fastckpt.lightning.rng import restore_rng_states

__all__ = ["RestoreAfterLoader", "attach_to_loading_trainer", "calling_trainer"]


class RestoreAfterLoader(pl.Callback):
    """Restores ``states`` (:data:`~fastckpt.lightning.RNG_KEY`'s value) once more at ``on_train_start`` when the
    resumed run continues the epoch the checkpoint was taken in (see the module docs); inert afterwards.

    Args:
        states: the RNG states the checkpoint holds.
        epoch: the checkpoint's ``epoch`` (``Trainer.current_epoch`` when it was taken).
    """

    def __init__(self, states: Any, epoch: Any) -> None:
        self.states = states
        self.epoch = epoch
        self.done = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.done:
            return
        self.done = True
        if trainer.fit_loop.restarted_mid_epoch and trainer.current_epoch == self.epoch:
            with warnings.catch_warnings():  # a world-size warning was given at load already
                warnings.simplefilter("ignore")
                restore_rng_states(self.states)


def calling_trainer() -> pl.Trainer | None:
    """The ``Trainer`` whose ``fit(ckpt_path=...)`` is loading a checkpoint through this call, or None.

    Lightning calls ``strategy.load_checkpoint`` from its checkpoint connector (``self.trainer``); the frames up to
    ``Trainer._run`` are searched for it.
    """
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, pl.Trainer):
            return owner
        trainer = owner.__dict__.get("trainer") if hasattr(owner, "__dict__") else None
        if isinstance(trainer, pl.Trainer):
            return trainer
        frame = frame.f_back
    return None


def attach_to_loading_trainer(states: Any, epoch: Any) -> bool:
    """Attach a :class:`RestoreAfterLoader` for ``states`` to the loading ``Trainer`` (replacing one a previous load
    attached); False when no trainer is loading (a direct ``load_checkpoint`` call)."""
    trainer = calling_trainer()
    if trainer is None:
        return False
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, RestoreAfterLoader)]
    trainer.callbacks.append(RestoreAfterLoader(states, epoch))
    return True

"""``LightningModule.load_from_checkpoint`` for checkpoint folders.

Lightning's ``load_from_checkpoint`` reads the path with ``torch.load`` (``pl_load``, through fsspec), never
through the Trainer's ``CheckpointIO`` (there is no Trainer at that point), so it cannot open a folder that
:class:`~fastckpt.lightning.CheckpointIO` wrote. :func:`load_from_checkpoint` reads the folder with the plugin and
then builds the module as Lightning does (its ``_load_state``: ``__init__`` from the saved ``hyper_parameters``
updated by ``kwargs``, ``on_load_checkpoint``, ``load_state_dict``, with Lightning's allowlist of instantiators).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import pytorch_lightning as pl
import torch
from pytorch_lightning.core.saving import _load_state
from pytorch_lightning.utilities.migration.utils import _pl_migrate_checkpoint

from fastckpt.lightning.checkpoint_io import CheckpointIO

__all__ = ["load_from_checkpoint"]

M = TypeVar("M", pl.LightningModule, pl.LightningDataModule)


def load_from_checkpoint(cls: type[M], checkpoint_path: str | os.PathLike[str], map_location: Any | None = None,
                         strict: bool | None = None, weights_only: bool | None = None, **kwargs: Any) -> M:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a checkpoint folder of :class:`CheckpointIO`.

    Args:
        cls: the ``LightningModule`` (or ``LightningDataModule``) subclass to build.
        checkpoint_path: the checkpoint folder (``epoch=0-step=10.ckpt``; a ``last.ckpt`` symlink is followed).
        map_location: where the tensors go: a device, or a ``{saved: device}`` dict; None: where they were saved.
            The module is moved to the device of the first tensor of ``state_dict``, as Lightning does.
        strict: ``load_state_dict``'s strict (None: the module's ``strict_loading``).
        weights_only: as :meth:`CheckpointIO.load_checkpoint` (True refuses the checkpoint's pickle part).
        **kwargs: ``__init__`` arguments overriding the saved hyperparameters.

    Returns:
        The module with the saved weights (the checkpoint's RNG states are not applied).

    Raises:
        FileNotFoundError: nothing at ``checkpoint_path``.
        UnsafePickleError: the checkpoint has a pickle part and ``weights_only`` is not False.
        RuntimeError: ``strict`` loading met missing or unexpected keys (``load_state_dict``'s error).

    Example:
        >>> model = fastckpt.lightning.load_from_checkpoint(MyModule, "checkpoints/last.ckpt", map_location="cpu")
    """
    checkpoint = CheckpointIO(restore_rng=False).load_checkpoint(checkpoint_path, map_location, weights_only)
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=Path(checkpoint_path))
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint.get("state_dict") or {}
    device = next((t.device for t in state_dict.values() if isinstance(t, torch.Tensor)), None)
    return model.to(device) if device is not None else model

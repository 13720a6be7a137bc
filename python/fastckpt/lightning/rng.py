"""The RNG states a Lightning checkpoint needs for an exact resume: every process's, under :data:`RNG_KEY`.

Lightning saves no RNG state, so a resumed run would draw other dropout masks (and other samples from any loader
that draws on the global RNG). Lightning calls a ``CheckpointIO``'s ``save_checkpoint`` on process 0 only, after
``dump_checkpoint`` ran on every process, so:

- :class:`~fastckpt.lightning.CheckpointIO` alone adds process 0's states (torch, CUDA, numpy, Python, as
  Lightning's own ``_collect_rng_states``) at its ``save_checkpoint``: exact on one process, and on several when
  every process was seeded alike (``seed_everything(s)`` on each), as they are then restored on every process.
- :class:`RankRNGStates` (a callback) gathers every process's states in ``on_save_checkpoint`` (on every process,
  within ``timeout``), so processes seeded differently resume exactly too.

Both capture the states when the checkpoint is made: after the step that ``ModelCheckpoint`` saved after (or the
epoch's ``on_train_epoch_end``) and before the draws of the next step or epoch (a loader's shuffle and base seed
at ``iter()`` included), so the resumed run's next step draws what the uninterrupted run's did.
``CheckpointIO.load_checkpoint`` (on every process) restores the states of its own process and removes the key.

The value: ``{"world_size": int, "ranks": [states of process 0, 1, ...]}`` (one entry without the callback). A
checkpoint resumed by another number of processes restores, on process ``r``, the states saved by process ``r``
(process 0's where ``r`` saved none) and warns: random draws then no longer follow the uninterrupted run.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.utilities.seed import _collect_rng_states, _set_rng_states

from fastckpt._io.group.distributed import DEFAULT_TIMEOUT, Session, check_timeout, is_distributed, process_rank

__all__ = ["RNG_KEY", "RankRNGStates", "collect_rng_states", "restore_rng_states"]

#: the checkpoint key under which the RNG states are saved (taken out again by ``load_checkpoint``)
RNG_KEY = "fastckpt_rng_states"


def _world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _this_process() -> dict[str, Any]:
    return _collect_rng_states(include_cuda=torch.cuda.is_available())


def collect_rng_states() -> dict[str, Any]:
    """This process's RNG states as :data:`RNG_KEY`'s value: ``{"world_size": N, "ranks": [states]}``."""
    return {"world_size": _world_size(), "ranks": [_this_process()]}


def restore_rng_states(saved: Any) -> None:
    """Restore this process's RNG states from :data:`RNG_KEY`'s value ``saved``.

    Args:
        saved: what :func:`collect_rng_states` or :class:`RankRNGStates` saved; one process's states dict
            (``{"torch": ..., "numpy": ..., "python": ...}``, as checkpoints of earlier fastckpt versions hold) is
            restored on every process.

    Raises:
        ValueError: ``saved`` is neither.

    Warns:
        UserWarning: the checkpoint was saved by another number of processes than this run has.
    """
    if isinstance(saved, dict) and "torch" in saved:
        saved = {"world_size": None, "ranks": [saved]}
    if not (isinstance(saved, dict) and isinstance(saved.get("ranks"), list) and saved["ranks"]):
        raise ValueError(f"the checkpoint's {RNG_KEY!r} is not RNG states saved by fastckpt.lightning "
                         f"(got {type(saved).__name__})")
    ranks, rank, world = saved["ranks"], process_rank(), _world_size()
    source = rank if rank < len(ranks) else 0
    if saved["world_size"] is not None and saved["world_size"] != world:
        warnings.warn(f"the checkpoint's RNG states were saved by {saved['world_size']} processes and this run has "
                      f"{world}: process {rank} restores the states of saved process {source}, so random draws do "
                      "not follow the uninterrupted run", UserWarning, stacklevel=3)
    _set_rng_states(ranks[source])


class RankRNGStates(pl.Callback):
    """Save every process's RNG states with each checkpoint (with :class:`~fastckpt.lightning.CheckpointIO`).

    Needed for an exact resume with several processes seeded differently (without it process 0's states are
    restored on every process). ``Trainer.save_checkpoint`` runs on every process, and so does this gather.

    Args:
        timeout: seconds process 0 waits for the others' states.

    Raises:
        CollectiveTimeoutError: (at a save) a process did not send its states within ``timeout``.

    Example:
        >>> trainer = pl.Trainer(strategy="ddp", devices=4, plugins=[fastckpt.lightning.CheckpointIO()],
        ...                      callbacks=[fastckpt.lightning.RankRNGStates(), ModelCheckpoint(...)])
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = check_timeout(timeout)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        gathered = Session(f"{type(self).__name__} (every process's RNG states)", self.timeout).gather(
            _this_process(), step="rng states")
        if gathered is not None:  # process 0: the one whose checkpoint dict is written
            checkpoint[RNG_KEY] = {"world_size": len(gathered), "ranks": gathered}

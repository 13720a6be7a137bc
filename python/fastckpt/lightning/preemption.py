"""``fastckpt.lightning.PreemptionCheckpoint``: a SIGTERM or SIGUSR1 during ``fit`` saves the step reached and stops.

What Lightning does by itself (2.x), and how this callback works with it:

* **SIGTERM.** Lightning installs its own handler at the start of ``fit`` (keeping any earlier one): it sets
  ``trainer.received_sigterm``, forwards the signal to the processes its launcher started, and at the end of the
  batch (or, with several processes, at the start of the next one, through a broadcast from process 0) raises
  ``SIGTERMException``, a ``SystemExit``: the fit stops, **nothing is saved**. The callback installs no SIGTERM
  handler; it reads Lightning's flag at ``on_train_batch_end`` (after ``optimizer.step()`` and the LR scheduler
  step, where ``ModelCheckpoint(every_n_train_steps=...)`` saves too), saves the step reached there, and stops the
  fit before Lightning's own exit, with :class:`fastckpt.Preempted` (a ``SystemExit``, code 0).
* **SIGUSR1** (SLURM's ``#SBATCH --signal=USR1@90``): recorded by the callback's handler, acted on at the same
  boundary. When Lightning's SLURM auto-requeue is on (``SLURMEnvironment(auto_requeue=True)``, the default under
  SLURM) Lightning owns the requeue signal: its handler saves ``hpc_ckpt_{n}.ckpt`` and requeues the job (from
  inside the signal handler, in the middle of a step); the callback then leaves that signal to Lightning and
  handles SIGTERM only. Pass ``plugins=[SLURMEnvironment(auto_requeue=False)]`` to have the callback save SIGUSR1
  at a step boundary instead (then requeue from the batch script).

The signals are recorded by a :class:`fastckpt.CheckpointManager` (``memory=False``: it saves nothing itself) and
the step to save is agreed through it (:meth:`~fastckpt.CheckpointManager.preemption_due`): with one process the
step the signal arrived in, with several the next step boundary, every process the same, without a collective per
step. With several processes the callback holds Lightning's own SIGTERM stop back until that step (it clears
``received_sigterm`` once it has recorded the signal). The checkpoint goes through ``trainer.save_checkpoint`` and
so through the Trainer's ``CheckpointIO`` (with :class:`fastckpt.lightning.CheckpointIO`: one atomic, fsynced
folder; an async save is waited for before the exit). Resume with ``trainer.fit(..., ckpt_path=...)``: with the
default name ``last.ckpt`` in a ``ModelCheckpoint``'s folder, ``ckpt_path="last"`` finds it.

May import: every private layer and the public package (layer 5).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Sequence

import pytorch_lightning as pl

__all__ = ["PreemptionCheckpoint"]


class PreemptionCheckpoint(pl.Callback):
    """Save the step reached when the job is preempted (SIGTERM, SIGUSR1), then stop the fit (exit code 0).

    Args:
        dirpath: the folder of the checkpoint; None: the first ``ModelCheckpoint``'s ``dirpath`` (so
            ``ckpt_path="last"`` resumes it), else ``{default_root_dir}/checkpoints``.
        filename: the checkpoint's name in ``dirpath`` (default ``"last.ckpt"``).
        signals: the signals besides SIGTERM (which Lightning catches and the callback reads) that ask for the save;
            default ``(SIGUSR1,)``; a signal Lightning's SLURM auto-requeue holds is left to it.
        exit_code: the :class:`fastckpt.Preempted` exit code (default 0).
        timeout: seconds a process waits for the others (several processes).

    Raises (at construction):
        OptionError / OptionTypeError: a filename that is not a plain file name, a signal that cannot be caught,
            an exit code outside 0-255, a non-positive timeout (each named with its value).

    Raises (at the preempted step):
        Preempted: the step reached is saved (a ``SystemExit``; Lightning runs its ``on_exception`` hooks and
            teardown, then the process exits with ``exit_code``).

    Example:
        >>> trainer = pl.Trainer(plugins=[fastckpt.lightning.CheckpointIO()],
        ...                      callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=500),
        ...                                 fastckpt.lightning.PreemptionCheckpoint()])
        >>> trainer.fit(model, loader, ckpt_path="last")  # a restart resumes the preempted step
    """

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, filename: str = "last.ckpt", *,
                 signals: Sequence[int] = (signal.SIGUSR1,), exit_code: int = 0, timeout: float | None = None) -> None:
        super().__init__()
        from fastckpt._io.group.distributed import check_timeout
        from fastckpt.errors import OptionError, OptionTypeError
        from fastckpt.manager.options import check_exit_code, check_signals, typed_option

        if not isinstance(filename, str):
            raise OptionTypeError(f"filename must be a file name (str), got {type(filename).__name__} {filename!r}")
        if not filename or os.sep in filename:
            raise OptionError(f"filename must be a file name, got {filename!r}")
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.filename = filename
        self.signals = check_signals(signals)  # refused here, not at the fit's first batch
        self.exit_code = check_exit_code(exit_code)
        self.timeout = None if timeout is None else typed_option(check_timeout, timeout)
        self.manager: Any = None
        self._last_step: int | None = None

    @property
    def ckpt_path(self) -> Path | None:
        """Where the preemption checkpoint goes (None before ``fit`` when ``dirpath`` is None)."""
        return None if self.dirpath is None else self.dirpath / self.filename

    def _own_signals(self, trainer: pl.Trainer) -> tuple[int, ...]:
        from lightning_fabric.plugins.environments import SLURMEnvironment

        env = trainer._accelerator_connector.cluster_environment
        held = {int(env.requeue_signal)} if isinstance(env, SLURMEnvironment) and env.auto_requeue else set()
        return tuple(s for s in self.signals if s not in held and s != signal.SIGTERM)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import fastckpt

        if self.dirpath is None:
            ckpt = trainer.checkpoint_callback
            folder = getattr(ckpt, "dirpath", None)
            self.dirpath = Path(folder) if folder else Path(trainer.default_root_dir) / "checkpoints"
        kw = {} if self.timeout is None else {"timeout": self.timeout}
        self.manager = fastckpt.CheckpointManager(self.dirpath, pl_module, memory=False, keep=None,
                                                  preemption_signals=self._own_signals(trainer),
                                                  preemption_exit_code=self.exit_code, **kw)
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        mgr, step = self.manager, trainer.global_step
        if mgr is None or step == self._last_step:  # no optimizer step in this batch (gradient accumulation)
            return
        self._last_step = step
        if trainer.received_sigterm:
            if not mgr.preemption_requested:
                mgr.request_preemption(signal.SIGTERM)
            if trainer.world_size > 1:  # hold Lightning's stop back until the step every process agreed on
                trainer._signal_connector.received_sigterm = False
        if not mgr.preemption_due(step):
            return
        path = self.ckpt_path
        assert path is not None
        trainer.save_checkpoint(path)
        trainer.strategy.checkpoint_io.teardown()  # an async save is committed before the exit
        mgr.exit_preempted(step, path)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.manager is not None:
            self.manager.close()  # the previous signal handlers are back
            self.manager = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

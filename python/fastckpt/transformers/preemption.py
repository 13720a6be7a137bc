"""Preemption saves for ``fastckpt.transformers.Trainer``: a SIGTERM (or SIGUSR1) during ``train()`` saves
``{output_dir}/checkpoint-{global_step}`` of the step reached, durably, and the process exits with code 0.

``transformers.Trainer`` installs no signal handler of its own: without one, a SIGTERM kills the run and everything
since the last ``save_steps`` checkpoint is lost. :class:`~fastckpt.transformers.CheckpointMixin` holds a
:class:`fastckpt.CheckpointManager` during ``train()`` for its signal handling only (``memory=False``: the
checkpoint is Trainer's own folder, written by the mixin's ``_save_checkpoint``): the handler only records the
signal; at the next optimizer-step boundary (``_maybe_log_save_evaluate``, after ``optimizer.step()``, the LR
scheduler step and the step's logging) :meth:`~fastckpt.CheckpointManager.preemption_due` says whether this is the
step to save (with several processes, every process gets the same step through the store, without a collective per
step), Trainer's own save path writes ``checkpoint-{global_step}`` (then its ``on_save`` callbacks and the
``save_total_limit`` rotation run), the async write if any is waited for, and
:meth:`~fastckpt.CheckpointManager.exit_preempted` raises :class:`fastckpt.Preempted` (a ``SystemExit``, code 0):
``train()`` does not return and nothing later is written. ``train(resume_from_checkpoint=True)`` resumes it exactly.

May import: every private layer and the public package (layer 5).
"""

from __future__ import annotations

import signal
from typing import Any, Sequence

__all__ = ["DEFAULT_SIGNALS", "check_signals", "start"]

#: what a scheduler sends before the kill: SIGTERM (Kubernetes, spot instances, torchrun), SIGUSR1 (SLURM --signal)
DEFAULT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)


def check_signals(signals: Sequence[int] | None) -> tuple[int, ...]:
    """``signals`` as a tuple of ints (None or empty: no preemption handling).

    Raises:
        OptionError: (a ValueError) an entry that is not a signal number, or SIGKILL / SIGSTOP.
    """
    from fastckpt.errors import OptionError

    out = tuple(signals or ())
    valid = {int(s) for s in signal.valid_signals()} - {int(signal.SIGKILL), int(signal.SIGSTOP)}
    for s in out:
        if isinstance(s, bool) or not isinstance(s, int) or int(s) not in valid:
            raise OptionError(f"fastckpt_preemption_signals: {s!r} is not a signal that can be caught")
    return tuple(int(s) for s in out)


def start(trainer: Any, signals: tuple[int, ...]) -> Any:
    """A :class:`fastckpt.CheckpointManager` recording ``signals`` for ``trainer``'s ``train()`` (None when
    ``signals`` is empty); it saves nothing itself."""
    if not signals:
        return None
    import fastckpt

    return fastckpt.CheckpointManager(trainer.args.output_dir, trainer.model, memory=False, keep=None,
                                      preemption_signals=signals, timeout=trainer.fastckpt_timeout)

"""``CheckpointMixin``: the checkpoint methods of ``transformers.Trainer``, done by fastckpt.

Trainer's own loop decides when to save (``save_strategy``), what ``global_step`` is and how a resumed run skips
the batches it already trained on; this mixin replaces only the methods that write and read a checkpoint:

=================================  ===================================================================
Trainer method                     here
=================================  ===================================================================
``_save_checkpoint``               one :func:`fastckpt.accelerate.save_with_files` commit of
                                   ``checkpoint-{global_step}`` (model, optimizer, scheduler, GradScaler,
                                   every process's RNG, ``trainer_state.json``, ``training_args.json``,
                                   the processing class's files), then the ``save_total_limit`` rotation
``_load_from_checkpoint``          the weights (:func:`fastckpt.load_state`, ``model_only=True``)
``_load_optimizer_and_scheduler``  optimizer, scheduler and GradScaler (:func:`fastckpt.accelerate.load_state`;
``_load_scaler``                   the RNG states are put back as they were: Trainer restores them later)
``_load_rng_state``                this process's ``random_states_{rank}.safetensors``, when Trainer asks
``_load_best_model``               the weights of ``state.best_model_checkpoint``
``_save`` (``save_model``)         as Trainer's, with ``training_args.json`` instead of ``training_args.bin``
``train``                          ``resume_from_checkpoint=True``: the latest *finished* checkpoint;
                                   a preemption signal saves the step reached and exits (code 0)
``_maybe_log_save_evaluate``       the step boundary where a preemption save happens
                                   (:mod:`fastckpt.transformers.preemption`)
=================================  ===================================================================

A folder without ``fastckpt.json`` is read as the stock Trainer wrote it (:mod:`fastckpt.transformers.stock`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastckpt
import fastckpt.accelerate
from fastckpt._io.group.distributed import DEFAULT_TIMEOUT, check_timeout
from fastckpt._io.storage.local.commit import write_text
from fastckpt._io.storage.local.folder import open_safetensors
from fastckpt._io.storage.local.layout import random_states_name
from fastckpt._io.storage.local.numbering import saved_mode
from fastckpt._state.rng import RngRestoreWarning, read_rng_state
from fastckpt.errors import ResumeWarning
from fastckpt.transformers import folders, preemption, stock

__all__ = ["CheckpointMixin"]

_ASYNC_MODES = (False, True, "snapshot")


class _TrainerObjects:
    """A Trainer's checkpointed objects as ``fastckpt.accelerate`` sees an Accelerator: its model, optimizer and
    LR scheduler (Trainer prepares no scheduler through the Accelerator), the Accelerator's GradScaler; no
    dataloaders (Trainer restores the data order itself) and a project configuration of its own."""

    def __init__(self, trainer: Any) -> None:
        from accelerate.utils import ProjectConfiguration

        self._accelerator = trainer.accelerator
        self._models = [trainer.model]
        self._optimizers = [] if trainer.optimizer is None else [trainer.optimizer]
        self._schedulers = [] if trainer.lr_scheduler is None else [trainer.lr_scheduler]
        self._dataloaders: list = []
        self._custom_objects: list = []
        self._save_model_state_pre_hook: dict = {}
        self._load_model_state_pre_hook: dict = {}
        self.project_dir = trainer.args.output_dir
        self.project_configuration = ProjectConfiguration(project_dir=trainer.args.output_dir)
        self.step = int(trainer.state.global_step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_states(states: tuple) -> None:
    py, npy, cpu, cuda = states
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class CheckpointMixin:
    """Mix into a ``transformers.Trainer`` subclass (first in the bases) so its checkpoints go through fastckpt:
    ``class MyTrainer(fastckpt.transformers.CheckpointMixin, trl.SFTTrainer): ...``.

    Args (keyword, besides the Trainer's own):
        fastckpt_async_save: ``False`` (default): each checkpoint is committed before training goes on.
            ``True``: the save returns once the small state is copied; weights and optimizer state are written
            in the background and the next optimizer step waits only for the tensors not yet written (see
            :func:`fastckpt.save_state`). ``"snapshot"``: copy the whole state at the save, write in the background.
            An async checkpoint is committed (and rotated) before the next save starts, before the best model is
            loaded at the end and before ``train()`` returns; a failed write raises there.
        fastckpt_timeout: seconds a process waits for the others at any step of a multi-process save or load.
        fastckpt_preemption_signals: signals that, during ``train()``, save ``checkpoint-{global_step}`` of the
            step reached (durably, at the next optimizer-step boundary) and end the process with
            :class:`fastckpt.Preempted` (exit code 0); default ``(SIGTERM, SIGUSR1)``; None or ``()``: none
            (see :mod:`fastckpt.transformers.preemption`).

    Raises:
        TypeError: (at class definition) the mixin comes after the Trainer class in the bases (its methods would
            never run).
        NotImplementedError: DeepSpeed, FSDP, tensor-parallel, SageMaker MP or XLA training (their engines keep
            their own files).
        ValueError: a bad ``fastckpt_async_save``, ``fastckpt_timeout`` or ``fastckpt_preemption_signals``.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        import transformers

        mro = cls.__mro__
        if transformers.Trainer in mro and mro.index(transformers.Trainer) < mro.index(CheckpointMixin):
            raise TypeError(f"{cls.__name__}: CheckpointMixin must come before the Trainer class in the bases "
                            "(class MyTrainer(CheckpointMixin, SFTTrainer)), or Trainer's own checkpoint methods win")

    def __init__(self, *args: Any, fastckpt_async_save: bool | str = False,
                 fastckpt_timeout: float = DEFAULT_TIMEOUT,
                 fastckpt_preemption_signals: Any = preemption.DEFAULT_SIGNALS, **kwargs: Any) -> None:
        if fastckpt_async_save not in _ASYNC_MODES:
            raise ValueError(f"fastckpt_async_save must be False, True or 'snapshot', got {fastckpt_async_save!r}")
        self.fastckpt_async_save = fastckpt_async_save
        self.fastckpt_timeout = check_timeout(fastckpt_timeout)
        self._fastckpt_pending: Any = None
        self.fastckpt_preemption_signals = preemption.check_signals(fastckpt_preemption_signals)
        self._fastckpt_preemption: Any = None  # the manager recording the signals during train()
        self._fastckpt_saved_step: int | None = None
        super().__init__(*args, **kwargs)
        self._fastckpt_check_supported()

    def _fastckpt_check_supported(self) -> None:
        from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

        engine = ("DeepSpeed" if getattr(self, "is_deepspeed_enabled", False)
                  else "FSDP" if getattr(self, "is_fsdp_enabled", False)
                  else "tensor-parallel (tp_plan)" if getattr(self, "is_distributed_loading_by_transformers", False)
                  else "SageMaker model parallelism" if is_sagemaker_mp_enabled()
                  else "XLA" if is_torch_xla_available() else None)
        if engine is not None:
            raise NotImplementedError(f"fastckpt.transformers does not handle {engine} training (its engine keeps "
                                      "its own checkpoint files); use transformers.Trainer")

    def _fastckpt_wait(self) -> None:
        """Wait until the async checkpoint in flight (if any) is committed; raise its error here."""
        pending, self._fastckpt_pending = self._fastckpt_pending, None
        if pending is not None:
            pending.wait()

    # -- saving ------------------------------------------------------------------------------------------------
    def _fastckpt_files(self) -> dict[str, str | bytes]:
        """The small files of a checkpoint besides the state: Trainer's state, the arguments, the processing class."""
        files: dict[str, str | bytes] = {
            folders.TRAINER_STATE: json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n",
            "training_args.json": self.args.to_json_string() + "\n",
        }
        processor = self.processing_class
        if processor is None and getattr(self.data_collator, "tokenizer", None) is not None:
            processor = self.data_collator.tokenizer
        if processor is not None and self.args.should_save:
            with tempfile.TemporaryDirectory() as tmp:  # save_pretrained writes files; they join the commit
                processor.save_pretrained(tmp)
                for entry in sorted(Path(tmp).iterdir()):
                    if entry.is_file() and entry.name not in ("config.json", "generation_config.json"):
                        files.setdefault(entry.name, entry.read_bytes())
        return files

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import SaveStrategy

        self._fastckpt_wait()  # the previous checkpoint is committed: the rotation and best-model checks see it
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{folders.PREFIX}-{self.state.global_step}")
        if (self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
                and self.state.best_global_step):
            best = os.path.join(run_dir, f"{folders.PREFIX}-{self.state.best_global_step}")
            if self.state.best_global_step == self.state.global_step or os.path.isdir(best):
                self.state.best_model_checkpoint = best
        if self.args.should_save:  # as Trainer: the exportable callbacks' and the control's state go in the state
            for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
        limit, best_dir = self.args.save_total_limit, self.state.best_model_checkpoint

        def rotate(folder: Path) -> None:  # on the main process, once the checkpoint is committed
            folders.rotate(run_dir, limit, best_dir)

        self._fastckpt_saved_step = self.state.global_step
        result = fastckpt.accelerate.save_with_files(
            _TrainerObjects(self), output_dir, files=self._fastckpt_files(), after_commit=rotate, every_process=True,
            model_only=bool(self.args.save_only_model), timeout=self.fastckpt_timeout,
            async_save=self.fastckpt_async_save)
        if self.fastckpt_async_save:
            self._fastckpt_pending = result
        if self.args.push_to_hub:
            self._fastckpt_wait()
            self._push_from_checkpoint(output_dir)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """Trainer's step-boundary hook; after a preemption signal (agreed on this step by every process) it also
        saves ``checkpoint-{global_step}``, waits until it is committed and raises :class:`fastckpt.Preempted`."""
        mgr, step = self._fastckpt_preemption, self.state.global_step
        due = mgr is not None and mgr.preemption_due(step)
        if due:
            self.control.should_save = True  # Trainer's own save path: logging, evaluation, on_save, rotation
        super()._maybe_log_save_evaluate(*args, **kwargs)  # type: ignore[misc]
        if due:
            if self._fastckpt_saved_step != step:  # SaveStrategy.BEST turned the save off
                self._save_checkpoint(self.model, None)
            self._fastckpt_wait()
            mgr.exit_preempted(step, os.path.join(self.args.output_dir, f"{folders.PREFIX}-{step}"))

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """``Trainer._save`` (``save_model``: the weights through ``save_pretrained``, the processing class), with
        the training arguments as ``training_args.json`` instead of the pickled ``training_args.bin``."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=True)
        else:  # a plain torch.nn.Module: its state dict as model.safetensors, as Trainer writes it
            fastckpt.save_state(model, model_only=True, output_dir=output_dir)
        processor = self.processing_class
        if processor is None and getattr(self.data_collator, "tokenizer", None) is not None:
            processor = self.data_collator.tokenizer
        if processor is not None:
            processor.save_pretrained(output_dir)
        write_text(Path(output_dir) / "training_args.json", self.args.to_json_string() + "\n", durable=True)

    # -- loading -----------------------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not folders.is_fastckpt(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        result = fastckpt.load_state(self.model if model is None else model, input_dir=resume_from_checkpoint,
                                     model_only=True, strict=False)
        self._issue_warnings_after_load(result)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = Path(checkpoint)
        if not folders.is_fastckpt(folder):
            stock.load_optimizer_and_scheduler(folder, self.optimizer, self.lr_scheduler)
            return
        if saved_mode(folder) == "model_only":  # save_only_model: as Trainer, optimizer and scheduler start fresh
            optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrappers
            scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
            fresh = [f"the optimizer ({type(optimizer).__name__}: no moments, no step counts)"]
            if scheduler is not None:
                fresh.append(f"the learning-rate scheduler ({type(scheduler).__name__}: back to its first step's "
                             "learning rate)")
            fresh.append("the RNG states (dropout, data order)")
            warnings.warn(f"{folder}: saved with save_only_model=True (weights and trainer_state.json only): resuming "
                          f"from it restores the weights and the step count, and starts {', '.join(fresh[:-1])} and {fresh[-1]} afresh, "
                          "so training from here differs from an uninterrupted run; resume from a checkpoint saved "
                          "without save_only_model for an exact resume", ResumeWarning, stacklevel=2)
            return
        kept = _rng_states()  # Trainer restores the RNG states later (_load_rng_state), after skipping batches
        try:
            with warnings.catch_warnings():  # a missing RNG file is reported by _load_rng_state
                warnings.simplefilter("ignore", RngRestoreWarning)
                fastckpt.accelerate.load_state(_TrainerObjects(self), folder, timeout=self.fastckpt_timeout)
        finally:
            _set_rng_states(kept)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or folders.is_fastckpt(checkpoint):
            return  # fastckpt's scaler.safetensors is restored with the optimizer
        stock.load_scaler(Path(checkpoint), getattr(self.accelerator, "scaler", None))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = Path(checkpoint)
        rank, world = int(self.args.process_index), int(self.args.world_size)
        if not folders.is_fastckpt(folder):
            stock.load_rng_state(folder, rank, world)
            return
        if saved_mode(folder) == "model_only":
            return  # save_only_model saves no RNG states (Trainer's rule)
        path = folder / random_states_name(rank)
        if not path.is_file():
            warnings.warn(f"{folder}: holds no {path.name} (saved by fewer processes); process {rank} keeps its "
                          "RNG states", RngRestoreWarning, stacklevel=2)
            return
        read_rng_state(open_safetensors(path)).check().restore()

    def _load_best_model(self) -> None:
        self._fastckpt_wait()
        best = self.state.best_model_checkpoint
        if best is None or not folders.is_fastckpt(best):
            return super()._load_best_model()  # type: ignore[misc]
        result = fastckpt.load_state(self.model, input_dir=best, model_only=True, strict=False)
        self._issue_warnings_after_load(result)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        self._fastckpt_wait()  # the last checkpoint is committed before Trainer looks at the folders
        return super()._finalize_training(*args, **kwargs)  # type: ignore[misc]

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` resumes from the latest finished ``checkpoint-N`` in
        ``output_dir`` (a fastckpt checkpoint or a complete stock one; an unfinished save is never picked).

        A preemption signal (``fastckpt_preemption_signals``) during the run saves ``checkpoint-{global_step}`` of
        the step reached and raises :class:`fastckpt.Preempted` (exit code 0): nothing after that step is written.

        Raises:
            ValueError: ``resume_from_checkpoint=True`` and ``output_dir`` holds no finished checkpoint.
            Preempted: a preemption signal arrived; its step is committed (a ``SystemExit``).
        """
        if resume_from_checkpoint is True:
            latest = folders.latest_checkpoint(self.args.output_dir)
            if latest is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            resume_from_checkpoint = str(latest)
        self._fastckpt_preemption = preemption.start(self, self.fastckpt_preemption_signals)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        finally:
            mgr, self._fastckpt_preemption = self._fastckpt_preemption, None
            try:
                self._fastckpt_wait()
            finally:
                if mgr is not None:
                    mgr.close()  # the previous signal handlers are back

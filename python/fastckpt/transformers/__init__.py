"""``transformers.Trainer`` with fastckpt checkpoints: a drop-in ``Trainer`` and a mixin for Trainer subclasses.

    from fastckpt.transformers import Trainer              # instead of transformers.Trainer
    class MySFT(fastckpt.transformers.CheckpointMixin, trl.SFTTrainer): ...   # any Trainer subclass

Trainer's own loop is unchanged (``save_strategy``, ``save_steps``, ``save_total_limit``, ``save_only_model``,
``load_best_model_at_end``, ``resume_from_checkpoint=True`` or a path, callbacks); each checkpoint is one fastckpt
commit of ``{output_dir}/checkpoint-{global_step}``:

===============================================  ============================================================
``model.safetensors`` (+ ``config.json``,          the weights, as ``save_pretrained`` writes them (sharded
``generation_config.json``)                        over 10 GB)
``optimizer.safetensors``, ``scheduler.json``      optimizer and LR scheduler state, no pickle
``scaler.safetensors``                             the GradScaler (fp16 mixed precision)
``random_states_{rank}.safetensors``               every process's Python, numpy, torch and CUDA RNG states
``trainer_state.json``                             Trainer's own file (``TrainerState``), byte for byte
``training_args.json``                             ``TrainingArguments.to_json_string()`` (not the pickled
                                                   ``training_args.bin``)
tokenizer / processor files                        the processing class's ``save_pretrained`` files
``fastckpt.json``                                  the manifest, last: ``checkpoint-N`` appears complete or not at all
===============================================  ============================================================

``save_only_model=True`` writes the model files, the two JSON files and the manifest. Trainer writes no pickle of
its own in a checkpoint. A resumed run continues exactly as the uninterrupted one (same losses, bit-identical
weights): Trainer skips the batches already trained using ``trainer_state.json``'s ``global_step``, and the RNG
states are restored at the point Trainer restores them. Checkpoints of the stock Trainer are resumed too: their
``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` and ``rng_state*.pth`` are read with
``torch.load(weights_only=True)`` or refused naming the file. ``fastckpt_async_save=True`` writes in the
background; see :class:`CheckpointMixin`. Several processes (``torchrun``, DDP): every process takes part in each
save (Trainer calls it on all), and the main process commits every process's RNG file at once.

Layer 5 (adapter): turns Trainer's objects into :func:`fastckpt.load_state` and :mod:`fastckpt.accelerate` calls.
"""

from __future__ import annotations

from typing import Any

from fastckpt.transformers.mixin import CheckpointMixin

__all__ = ["CheckpointMixin", "Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":  # built on first use, so importing fastckpt.transformers does not import transformers
        global Trainer
        import transformers

        class Trainer(CheckpointMixin, transformers.Trainer):  # type: ignore[no-redef]
            """``transformers.Trainer`` whose checkpoints go through fastckpt (see :mod:`fastckpt.transformers`
            and :class:`CheckpointMixin` for ``fastckpt_async_save``)."""

        Trainer.__module__ = __name__
        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

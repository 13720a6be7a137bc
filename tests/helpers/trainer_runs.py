"""Tiny ``transformers.Trainer`` runs for the fastckpt.transformers tests (CPU, no downloads): a 2-layer GPT-2 built
from a config with dropout, 24 random sequences, 6 optimizer steps per epoch (batch 4), linear LR decay.

``run(kind, out, ...)``: one ``train()`` of ``fastckpt.transformers.Trainer`` (``kind="fastckpt"``) or of the stock
``transformers.Trainer`` (``"stock"``); ``stop_at`` ends the run right after the checkpoint of that step (as a
killed job would have left it); returns the trainer. Also used by tests/helpers/mp_trainer_worker.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

import fastckpt.transformers  # noqa: E402

VOCAB, SEQ, EXAMPLES = 64, 12, 24


class Dataset(torch.utils.data.Dataset):
    def __init__(self, n: int = EXAMPLES, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=1)
    return GPT2LMHeadModel(config)


class StopAt(TrainerCallback):
    """Ends training after step ``step`` (its checkpoint is written first: Trainer saves, then stops)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def arguments(out, **overrides) -> TrainingArguments:
    kw = dict(output_dir=str(out), max_steps=10, per_device_train_batch_size=4, learning_rate=1e-2,
              lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, save_strategy="steps", save_steps=4,
              seed=42, use_cpu=True, report_to="none", disable_tqdm=True, dataloader_num_workers=0,
              weight_decay=0.01)
    kw.update(overrides)
    return TrainingArguments(**kw)


def run(kind: str, out, *, stop_at: int | None = None, resume=None, eval_dataset=None, seed: int = 0,
        trainer_kwargs: dict | None = None, callbacks: tuple = (), **overrides):
    cls = fastckpt.transformers.Trainer if kind == "fastckpt" else transformers.Trainer
    trainer = cls(model=model(seed), args=arguments(out, **overrides), train_dataset=Dataset(),
                  eval_dataset=eval_dataset, callbacks=[*callbacks, *([StopAt(stop_at)] if stop_at else [])],
                  **(trainer_kwargs or {}))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def losses(trainer, after: int = 0) -> list[tuple[int, float, float, float]]:
    """(step, loss, grad_norm, learning_rate) of every logged training step after ``after``."""
    return [(e["step"], e["loss"], e["grad_norm"], e["learning_rate"]) for e in trainer.state.log_history
            if "loss" in e and e["step"] > after]


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

"""A load of another model's checkpoint reports the most fundamental mismatch first: the model's keys, before any
count of optimizers or schedulers (issue 19: "1 schedulers passed but the checkpoint holds 0" hid that the keys
were completely different)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastckpt


def _other_model() -> nn.Module:
    return nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Conv1d(4, 2, 1))


def _sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1)


@pytest.mark.parametrize("saved", ["full", "model_only"])
def test_keys_of_another_model_are_reported_before_the_counts(tmp_path, saved):
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    fastckpt.save_state(model, opt, output_dir=tmp_path / "c", model_only=saved == "model_only")
    other = _other_model()
    other_opt = torch.optim.AdamW(other.parameters())
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(fastckpt.KeyMismatchError, match=r"0\.weight"):
        fastckpt.load_state(other, other_opt, _sched(other_opt), input_dir=tmp_path / "c")
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_the_scheduler_count_is_reported_once_model_and_optimizer_fit(tmp_path):
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    fastckpt.save_state(model, opt, output_dir=tmp_path / "c")
    with pytest.raises(fastckpt.MissingStateError, match="1 schedulers passed but the checkpoint holds 0"):
        fastckpt.load_state(model, opt, _sched(opt), input_dir=tmp_path / "c")

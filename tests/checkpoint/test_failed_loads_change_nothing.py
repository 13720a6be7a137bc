"""A failed load leaves every object as it was (issue 12, item 4): live tensors with unusual layouts are checked
before anything is written (a transposed parameter loads correctly; an expanded buffer is refused naming it), and a
scheduler or registered object whose ``load_state_dict`` raises leaves nothing applied."""

from __future__ import annotations

import pytest
import torch
from helpers.common import assert_model_state, make_training_state, model_clone
from torch import nn

import fastckpt


class Odd(nn.Module):
    def __init__(self, expanded: bool = False):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(8, 4).t())  # shape (4, 8), strides (1, 4)
        self.register_buffer("e", torch.randn(1, 4).expand(3, 4) if expanded else torch.randn(3, 4))
        self.last = nn.Linear(4, 4)


def test_a_transposed_parameter_loads_in_place_correctly(tmp_path):
    torch.manual_seed(0)
    saved = Odd()
    ckpt = fastckpt.save_state(saved, output_dir=tmp_path / "c", model_only=True)
    torch.manual_seed(1)
    fresh = Odd()
    w = fresh.w
    fastckpt.load_state(fresh, input_dir=ckpt, model_only=True)
    assert fresh.w is w and fresh.w.stride() == (1, 4)
    assert_model_state(fresh, model_clone(saved))


def test_an_expanded_buffer_is_refused_before_anything_changes(tmp_path):
    torch.manual_seed(0)
    ckpt = fastckpt.save_state(Odd(expanded=True), output_dir=tmp_path / "c", model_only=True)
    torch.manual_seed(1)
    fresh = Odd(expanded=True)
    before = model_clone(fresh)
    with pytest.raises(fastckpt.ShapeMismatchError, match=r"Odd\.e \(shape \[3, 4\], strides \[0, 1\]\)"):
        fastckpt.load_state(fresh, input_dir=ckpt, model_only=True)
    assert_model_state(fresh, before)


def test_a_scheduler_whose_load_state_dict_raises_leaves_nothing_applied(tmp_path):
    model, opt, sched = make_training_state(0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    for _ in range(3):
        opt.step()
        sched.step()
        sched2.step()
    ckpt = fastckpt.save_state(model, opt, [sched, sched2], output_dir=tmp_path / "c")
    fresh, fresh_opt, fresh_sched = make_training_state(1)
    first = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=3)
    failing = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=3)

    def boom(state):
        raise RuntimeError("cannot take this state")

    failing.load_state_dict = boom
    before_model, before_first = model_clone(fresh), dict(first.state_dict())
    before_opt = fresh_opt.state_dict()
    with pytest.raises(RuntimeError, match="cannot take this state") as info:
        fastckpt.load_state(fresh, fresh_opt, [first, failing], input_dir=ckpt)
    assert "put back" in "".join(getattr(info.value, "__notes__", []))
    assert_model_state(fresh, before_model)
    assert first.state_dict() == before_first
    assert fresh_opt.state_dict()["state"] == before_opt["state"] == {}

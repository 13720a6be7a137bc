"""Optimizer parameters that belong to no passed model (a learnable temperature, a module never passed to
``prepare``): their state is keyed by position in ``param_groups`` (``#k``), their values saved beside it, the
manifest lists them, and a resume restores them bit-exact, with ``fastckpt.save_state`` and through accelerate
(stock accelerate saves such state; issue 11 item 1)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.common import assert_model_state, model_clone
from torch import nn

import fastckpt
import fastckpt.accelerate


def _setup(seed: int, *, steps: int = 2):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    side = nn.Linear(2, 2)  # a module never passed to save_state / prepare
    temperature = nn.Parameter(torch.tensor([0.5]))
    opt = torch.optim.AdamW([{"params": [*model.parameters(), temperature]},
                             {"params": side.parameters(), "lr": 0.05}], lr=0.01)
    for _ in range(steps):
        x = torch.randn(4, 3)
        (side(model(x)) / temperature).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, side, temperature, opt


def _state_equal(opt_a, opt_b):
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sorted(sa["state"]) == sorted(sb["state"])
    for k in sa["state"]:
        for name, value in sa["state"][k].items():
            assert torch.equal(value, sb["state"][k][name]), (k, name)


def test_standalone_parameters_round_trip_by_position(tmp_path):
    model, side, temperature, opt = _setup(1)
    folder = fastckpt.save_state(model, opt, output_dir=tmp_path / "c")
    manifest = json.loads((folder / "fastckpt.json").read_text())
    assert manifest["positional_params"] == {"optimizer": ["#2", "#3", "#4"]}
    fresh, fresh_side, fresh_t, fresh_opt = _setup(2, steps=1)
    fastckpt.load_state(fresh, fresh_opt, input_dir=folder)
    _state_equal(fresh_opt, opt)
    assert torch.equal(fresh_t, temperature)
    assert_model_state(fresh_side, model_clone(side))
    assert_model_state(fresh, model_clone(model))
    # the resumed run continues exactly as the uninterrupted one
    x = torch.randn(4, 3)
    for m, s, t, o in ((model, side, temperature, opt), (fresh, fresh_side, fresh_t, fresh_opt)):
        (s(m(x)) / t).square().mean().backward()
        o.step()
    assert torch.equal(fresh_t, temperature) and torch.equal(fresh.weight, model.weight)


def test_positional_parameter_of_another_shape_is_refused_before_anything_changes(tmp_path):
    model, _side, _t, opt = _setup(3)
    folder = fastckpt.save_state(model, opt, output_dir=tmp_path / "c")
    torch.manual_seed(4)
    fresh = nn.Linear(3, 2)
    wrong = nn.Parameter(torch.zeros(2))  # position 2 now has shape [2], saved [1]
    fresh_opt = torch.optim.AdamW([{"params": [*fresh.parameters(), wrong]},
                                   {"params": nn.Linear(2, 2).parameters(), "lr": 0.05}], lr=0.01)
    before = model_clone(fresh)
    with pytest.raises(fastckpt.ShapeMismatchError, match="position 2"):
        fastckpt.load_state(fresh, fresh_opt, input_dir=folder)
    assert_model_state(fresh, before)
    assert torch.equal(wrong, torch.zeros(2)) and fresh_opt.state_dict()["state"] == {}


def test_accelerate_unprepared_module_and_standalone_parameter(tmp_path, new_accelerator):
    acc = new_accelerator()
    model, side, temperature, opt = _setup(5)
    p_model, p_opt = acc.prepare(model, opt)
    folder = fastckpt.accelerate.save_state(acc, tmp_path / "c")
    acc2 = new_accelerator()
    fresh, fresh_side, fresh_t, fresh_opt = _setup(6, steps=1)
    p_fresh, p_fresh_opt = acc2.prepare(fresh, fresh_opt)
    fastckpt.accelerate.load_state(acc2, folder)
    _state_equal(p_fresh_opt.optimizer, p_opt.optimizer)
    assert torch.equal(fresh_t, temperature)
    assert_model_state(fresh_side, model_clone(side))
    # and a stock accelerate folder with the same optimizer loads (positional throughout)
    stock = tmp_path / "stock"
    acc.save_state(str(stock))
    acc3 = new_accelerator()
    third, _s, third_t, third_opt = _setup(7, steps=1)
    p_third, p_third_opt = acc3.prepare(third, third_opt)
    fastckpt.accelerate.load_state(acc3, stock)
    _state_equal(p_third_opt.optimizer, p_opt.optimizer)

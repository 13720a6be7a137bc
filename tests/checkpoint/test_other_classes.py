"""Optimizer and scheduler state saved by another class (issue 12, item 5): ``strict=True`` refuses both naming the
classes and pointing at ``strict=False``; under ``strict=False`` the live object keeps its own state (AdamW's
``param_groups`` in SGD made its next ``step()`` fail with KeyError: 'momentum'), reported in ``LoadResult.skipped``,
and everything else loads."""

from __future__ import annotations

import pytest
import torch
from helpers.common import assert_model_state, make_training_state, model_clone

import fastckpt


def _saved(tmp_path):
    model, opt, sched = make_training_state(0)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        sched.step()
    return fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c"), model_clone(model)


def test_optimizer_of_another_class_strict_refuses_naming_both(tmp_path):
    ckpt, _ = _saved(tmp_path)
    model, _, _ = make_training_state(1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = model_clone(model)
    with pytest.raises(fastckpt.KeyMismatchError, match=r"saved by torch\.optim\.adamw\.AdamW.*SGD.*strict=False"):
        fastckpt.load_state(model, sgd, input_dir=ckpt)
    assert_model_state(model, before)


def test_optimizer_of_another_class_not_strict_keeps_its_state_and_steps(tmp_path):
    ckpt, expected = _saved(tmp_path)
    model, _, _ = make_training_state(1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sgd.param_groups]
    result = fastckpt.load_state(model, sgd, input_dir=ckpt, strict=False)
    assert_model_state(model, expected)
    assert [{k: v for k, v in g.items() if k != "params"} for g in sgd.param_groups] == groups
    assert sgd.state_dict()["state"] == {}
    assert len(result.skipped) == 1 and "AdamW" in result.skipped[0] and "SGD" in result.skipped[0]
    missing, unexpected = result  # still the pair torch's load_state_dict returns
    assert (missing, unexpected) == ([], [])
    model(torch.randn(5, 4)).sum().backward()
    sgd.step()  # was KeyError: 'momentum'


def test_scheduler_of_another_class(tmp_path):
    ckpt, _ = _saved(tmp_path)
    model, opt, _ = make_training_state(1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    before = cosine.state_dict()
    with pytest.raises(fastckpt.KeyMismatchError, match=r"StepLR.*CosineAnnealingLR"):
        fastckpt.load_state(model, opt, cosine, input_dir=ckpt)
    result = fastckpt.load_state(model, opt, cosine, input_dir=ckpt, strict=False)
    assert cosine.state_dict() == before
    assert [s.split(":")[0] for s in result.skipped] == ["scheduler.json"]
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    assert fastckpt.load_state(model, opt, step_lr, input_dir=ckpt).skipped == []
    assert step_lr.last_epoch == 2

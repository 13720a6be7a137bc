"""LR scheduler state without pickle: after a resume the LR sequence is identical to the uninterrupted run's.

C21 (MultiStepLR's Counter, ReduceLROnPlateau's inf, numpy scalars) and C22 (schedulers built with lambdas).
"""

from __future__ import annotations

import collections
import copy
import json
import math

import numpy as np
import pytest
import torch
from helpers.common import assert_nested_equal
from torch import nn

import fastckpt

LS = torch.optim.lr_scheduler


def _params(seed: int):
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(3))]


def _sgd(params, lr=0.1):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _step(opt, sched, metric=None):
    opt.zero_grad()
    opt.param_groups[0]["params"][0].square().sum().backward()
    opt.step()
    if metric is None:
        sched.step()
    else:
        sched.step(metric)


def _lr_sequence(opt, sched, n, metrics=None) -> list[float]:
    out = []
    for i in range(n):
        _step(opt, sched, None if metrics is None else metrics[i])
        out.append(opt.param_groups[0]["lr"])
    return out


def _assert_scheduler_round_trip(tmp_path, build, *, before=4, after=8, metrics=None):
    """Run ``before`` steps, save, run ``after`` more; a fresh (model, optimizer, scheduler) loaded from the
    checkpoint must reproduce those ``after`` LRs exactly and have an equal state_dict at the save point."""
    model = nn.Module()
    params = _params(1)
    model.p = params[0]
    opt, sched = build(params)
    m_before = None if metrics is None else metrics[:before]
    _lr_sequence(opt, sched, before, m_before)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "sched")
    saved_state = copy.deepcopy(sched.state_dict())
    m_after = None if metrics is None else metrics[before:]
    expected = _lr_sequence(opt, sched, after, m_after)

    fresh = nn.Module()
    fparams = _params(2)
    fresh.p = fparams[0]
    fopt, fsched = build(fparams)
    fastckpt.load_state(fresh, fopt, fsched, input_dir=ckpt)
    assert_nested_equal(fsched.state_dict(), saved_state, "scheduler")
    assert _lr_sequence(fopt, fsched, after, m_after) == expected
    for p in ckpt.iterdir():  # nothing pickled
        assert p.read_bytes()[:1] != b"\x80" and p.read_bytes()[:2] != b"PK", p.name
    return ckpt, fsched


def test_c21_multistep_lr_counter_milestones(tmp_path):
    def build(params):
        opt = _sgd(params)
        return opt, LS.MultiStepLR(opt, milestones=[2, 5, 6, 9], gamma=0.5)

    ckpt, fsched = _assert_scheduler_round_trip(tmp_path, build, before=3, after=8)
    assert isinstance(fsched.milestones, collections.Counter)
    assert fsched.milestones == collections.Counter({2: 1, 5: 1, 6: 1, 9: 1})
    assert all(isinstance(k, int) for k in fsched.milestones)
    json.loads((ckpt / "scheduler.json").read_text())


def test_c21_multistep_lr_with_repeated_milestone(tmp_path):
    def build(params):
        opt = _sgd(params)
        return opt, LS.MultiStepLR(opt, milestones=[3, 3, 5], gamma=0.5)  # Counter({3: 2, 5: 1})

    _, fsched = _assert_scheduler_round_trip(tmp_path, build, before=2, after=5)
    assert fsched.milestones == collections.Counter({3: 2, 5: 1})


def test_c21_reduce_lr_on_plateau_with_inf(tmp_path):
    metrics = [1.0, 0.9, 0.95, 0.97, 0.99, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]

    def build(params):
        opt = _sgd(params)
        return opt, LS.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=1)

    _, fsched = _assert_scheduler_round_trip(tmp_path, build, before=3, after=9, metrics=metrics)
    assert fsched.mode_worse == math.inf


def test_c21_reduce_lr_on_plateau_saved_before_any_step(tmp_path):
    """``best`` is still +inf at the save point."""
    def build(params):
        opt = _sgd(params)
        return opt, LS.ReduceLROnPlateau(opt, mode="max", factor=0.1, patience=0)

    metrics = [1.0, 0.5, 0.4, 2.0, 1.0]
    _, fsched = _assert_scheduler_round_trip(tmp_path, build, before=0, after=5, metrics=metrics)
    assert fsched.mode_worse == -math.inf


def test_c21_scheduler_holding_numpy_scalars(tmp_path):
    def build(params):
        opt = torch.optim.SGD(params, lr=np.float64(0.1), momentum=0.9)
        return opt, LS.ExponentialLR(opt, gamma=np.float64(0.7))

    _, fsched = _assert_scheduler_round_trip(tmp_path, build, before=3, after=5)
    assert fsched.gamma == np.float64(0.7) and type(fsched.gamma) is np.float64  # numpy scalar type kept


def test_c22_lambda_lr_with_a_lambda(tmp_path):
    def build(params):
        opt = _sgd(params)
        return opt, LS.LambdaLR(opt, lambda epoch: 0.9**epoch + 0.01 * (epoch % 3))

    _assert_scheduler_round_trip(tmp_path, build, before=5, after=7)


def test_c22_cyclic_lr_with_a_lambda_scale_fn(tmp_path):
    def build(params):
        opt = _sgd(params)
        return opt, LS.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=3,
                                scale_fn=lambda x: 0.8**x, scale_mode="iterations")

    _, fsched = _assert_scheduler_round_trip(tmp_path, build, before=4, after=10)
    assert fsched.last_epoch == 14


def test_c22_cyclic_lr_builtin_mode_restores_momentum_cycle(tmp_path):
    def build(params):
        opt = _sgd(params)
        return opt, LS.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2, mode="exp_range", gamma=0.9)

    model_opt = []

    def build_and_keep(params):
        opt, sched = build(params)
        model_opt.append(opt)
        return opt, sched

    _assert_scheduler_round_trip(tmp_path, build_and_keep, before=3, after=6)
    assert model_opt[0].param_groups[0]["momentum"] == model_opt[1].param_groups[0]["momentum"]


SCHEDULERS = {
    "StepLR": lambda o: LS.StepLR(o, step_size=2, gamma=0.3),
    "ExponentialLR": lambda o: LS.ExponentialLR(o, gamma=0.9),
    "CosineAnnealingLR": lambda o: LS.CosineAnnealingLR(o, T_max=5, eta_min=1e-4),
    "CosineAnnealingWarmRestarts": lambda o: LS.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "OneCycleLR": lambda o: LS.OneCycleLR(o, max_lr=0.5, total_steps=20),
    "LinearLR": lambda o: LS.LinearLR(o, start_factor=0.2, total_iters=5),
    "PolynomialLR": lambda o: LS.PolynomialLR(o, total_iters=6, power=2.0),
    "ConstantLR": lambda o: LS.ConstantLR(o, factor=0.5, total_iters=3),
    "MultiplicativeLR": lambda o: LS.MultiplicativeLR(o, lambda e: 0.95),
    "SequentialLR": lambda o: LS.SequentialLR(
        o, [LS.LinearLR(o, start_factor=0.5, total_iters=3), LS.ExponentialLR(o, gamma=0.8)], milestones=[3]),
    "ChainedScheduler": lambda o: LS.ChainedScheduler([LS.ConstantLR(o, 0.5, total_iters=4), LS.ExponentialLR(o, 0.9)]),
}


@pytest.mark.parametrize("kind", list(SCHEDULERS))
def test_torch_schedulers_resume_with_identical_lr_sequence(tmp_path, kind):
    def build(params):
        opt = _sgd(params)
        return opt, SCHEDULERS[kind](opt)

    _assert_scheduler_round_trip(tmp_path, build, before=4, after=10)


def test_several_schedulers_on_one_optimizer_files(tmp_path):
    model = nn.Linear(2, 2)
    opt = _sgd(model.parameters())
    s0, s1 = LS.StepLR(opt, 2, 0.5), LS.ExponentialLR(opt, 0.9)
    for _ in range(3):
        opt.step()
        s0.step()
        s1.step()
    ckpt = fastckpt.save_state(model, opt, [s0, s1], output_dir=tmp_path / "two")
    assert (ckpt / "scheduler.json").is_file() and (ckpt / "scheduler_1.json").is_file()
    fresh = nn.Linear(2, 2)
    fopt = _sgd(fresh.parameters())
    t0, t1 = LS.StepLR(fopt, 2, 0.5), LS.ExponentialLR(fopt, 0.9)
    fastckpt.load_state(fresh, fopt, [t0, t1], input_dir=ckpt)
    assert_nested_equal(t0.state_dict(), s0.state_dict())
    assert_nested_equal(t1.state_dict(), s1.state_dict())


def test_scheduler_state_that_needs_pickle_is_a_type_error_naming_it(tmp_path):
    class Opaque:
        pass

    class Custom:
        def state_dict(self):
            return {"epoch": 3, "blob": Opaque()}

        def load_state_dict(self, sd):
            pass

    model = nn.Linear(2, 2)
    opt = _sgd(model.parameters())
    with pytest.raises(TypeError) as info:
        fastckpt.save_state(model, opt, Custom(), output_dir=tmp_path / "bad")
    assert "blob" in str(info.value)
    assert not (tmp_path / "bad").exists()
    assert list(tmp_path.iterdir()) == []  # no staging folder left behind

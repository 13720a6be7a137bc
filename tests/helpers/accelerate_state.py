"""Helpers shared by the accelerate tests: a fresh ``Accelerator`` per use (accelerate keeps process-wide singleton
state), a prepared training state, and exact comparisons of optimizer / RNG state."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from helpers.common import assert_nested_equal, make_training_state


def _reset() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def accelerator_factory() -> Iterator[Callable[..., Accelerator]]:
    """Body of the ``new_accelerator`` fixture (tests/conftest.py, body here): ``new_accelerator(**kw)`` is a CPU
    ``Accelerator`` built on reset singleton state; the state is reset again afterwards."""

    def make(**kw) -> Accelerator:
        _reset()
        return Accelerator(**{"cpu": True, **kw})

    yield make
    _reset()


def prepared_state(accelerator: Accelerator, seed: int, *, steps: int = 0):
    """``make_training_state(seed)`` prepared by ``accelerator`` and trained ``steps`` steps on fixed data."""
    model, opt, sched = accelerator.prepare(*make_training_state(seed))
    g = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        x, y = torch.randn(5, 4, generator=g).to(accelerator.device), torch.randn(5, 3, generator=g).to(accelerator.device)
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
    return model, opt, sched


def snapshot(model, opt, sched) -> dict:
    """Deep copies of the three states, for exact comparison after a load."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "opt": _clone(opt.state_dict()),
        "sched": _clone(sched.state_dict()),
    }


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def assert_restored(model, opt, sched, expected: dict) -> None:
    """Model, optimizer and scheduler hold exactly the ``snapshot`` values (tensors bit for bit)."""
    assert_nested_equal({k: v for k, v in model.state_dict().items()}, expected["model"], "model")
    assert_nested_equal(opt.state_dict(), expected["opt"], "optimizer")
    assert_nested_equal(sched.state_dict(), expected["sched"], "scheduler")


def draws() -> tuple:
    """The next values of every RNG stream (consumes them)."""
    return (random.random(), float(np.random.rand()), torch.rand(2).tolist())

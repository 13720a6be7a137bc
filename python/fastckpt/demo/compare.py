"""The demo's bit-exact comparison of a reloaded training state with the saved one."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

__all__ = ["draw_random", "diff", "verify"]


def draw_random() -> list[Any]:
    """The next draws of Python ``random``, numpy's global generator and torch's CPU generator."""
    return [[random.random() for _ in range(4)], np.random.random(4).tolist(), torch.rand(4).tolist()]


def diff(expected: Any, actual: Any, where: str) -> list[str]:
    """Every difference between two nested states (dicts, lists, tuples, tensors, numbers), type-strict:
    a tuple that came back as a list, or an int as a float, is a difference."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{where}: expected a tensor, got {type(actual).__name__}"]
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            return [f"{where}: {expected.dtype}{list(expected.shape)} != {actual.dtype}{list(actual.shape)}"]
        return [] if torch.equal(expected, actual) else [f"{where}: tensor values differ"]
    if type(expected) is not type(actual):
        return [f"{where}: {type(expected).__name__} {expected!r:.60} != {type(actual).__name__} {actual!r:.60}"]
    if isinstance(expected, dict):
        if set(expected) != set(actual):
            return [f"{where}: keys {sorted(map(str, set(expected) ^ set(actual)))[:5]} not in both"]
        return [p for key in expected for p in diff(expected[key], actual[key], f"{where}.{key}")]
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(actual):
            return [f"{where}: length {len(expected)} != {len(actual)}"]
        return [p for i, (e, a) in enumerate(zip(expected, actual)) for p in diff(e, a, f"{where}[{i}]")]
    if isinstance(expected, float) and math.isnan(expected) and math.isnan(actual):
        return []
    return [] if expected == actual else [f"{where}: {expected!r:.60} != {actual!r:.60}"]


def _tie_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of the state_dict entries that share storage, grouped (``[["lm_head.weight", "transformer.wte..."]]``)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict().items():
        groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    return sorted(sorted(names) for names in groups.values() if len(names) > 1)


def verify(saved: tuple, loaded: tuple, *, full: bool, draws_after_save: list[Any]) -> list[str]:
    """Compare the reloaded (model, optimizer, scheduler) with the saved ones; returns every mismatch (empty:
    bit-exact). ``full=False`` (a model-only checkpoint) compares the model alone."""
    model, fresh_model = saved[0], loaded[0]
    problems = diff(model.state_dict(), fresh_model.state_dict(), "model")
    if _tie_groups(model) != _tie_groups(fresh_model):
        problems.append(f"model: tied weights {_tie_groups(model)} != {_tie_groups(fresh_model)} after load")
    if full:
        problems += diff(saved[1].state_dict(), loaded[1].state_dict(), "optimizer")
        problems += diff(saved[2].state_dict(), loaded[2].state_dict(), "scheduler")
        problems += diff(draws_after_save, draw_random(), "random draws")
    return problems

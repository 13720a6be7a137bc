"""Partly frozen models for the trainable-only / sharing tests: a frozen base with a trainable head, built from
a seed so that two builds share the same base weights."""

from __future__ import annotations

import torch
from torch import nn


class FrozenBaseNet(nn.Module):
    """``base`` (two Linear layers + a BatchNorm with running stats) is frozen; ``head`` trains."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.BatchNorm1d(d))
        self.head = nn.Linear(d, 3)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.base(x))


def make_frozen_base(seed: int, *, head_seed: int | None = None) -> FrozenBaseNet:
    """A FrozenBaseNet whose base comes from ``seed`` and head from ``head_seed`` (default: ``seed``)."""
    torch.manual_seed(seed)
    model = FrozenBaseNet()
    if head_seed is not None:
        torch.manual_seed(head_seed)
        model.head.reset_parameters()
    return model


def trained(model: FrozenBaseNet, steps: int = 2, *, seed: int = 7) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, ``steps`` steps on random data; returns the optimizer."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    model.eval()  # the frozen BatchNorm keeps its running stats
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 16, generator=g)).square().mean().backward()
        opt.step()
    return opt

"""A small deterministic training loop for the CheckpointManager tests (tests/manager/, the multi-process worker,
benches/recovery_bench.py): a model, AdamW, StepLR, a registered data order (a seeded permutation sampler with its
position) and a registered counter; every step draws from torch's, numpy's and Python's global RNGs, so a resume
that missed any of them would diverge.

    python tests/helpers/recovery_loop.py PROJECT MEMORY TOTAL EVERY [--wait]

runs the loop under a CheckpointManager (``memory=MEMORY``, ``every_n_steps=EVERY``) from ``restore()`` to
``TOTAL``, printing ``restored {step} {tier}`` and, after each ``mgr.step(n)``, ``step {n}``; with ``--wait`` it then
reads one line from stdin before the next step (the test's handshake: it signals or kills the process there). At the
end it saves the final state to ``PROJECT/final.safetensors`` and prints ``done``; a preemption prints
``preempted {step}`` and exits 0.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch
from torch import nn


class DataOrder:
    """A seeded permutation sampler: ``state_dict`` is its epoch and position (what a resumed loader needs)."""

    def __init__(self, n: int = 16, seed: int = 7) -> None:
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

    def next(self) -> int:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        item = int(order[self.pos])
        self.pos += 1
        if self.pos == self.n:
            self.epoch, self.pos = self.epoch + 1, 0
        return item

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos, self.seed = state["epoch"], state["pos"], state["seed"]


class Counter:
    def __init__(self) -> None:
        self.tokens = 0
        self.loss_sum = 0.0

    def state_dict(self) -> dict:
        return {"tokens": self.tokens, "loss_sum": self.loss_sum}

    def load_state_dict(self, state: dict) -> None:
        self.tokens, self.loss_sum = state["tokens"], state["loss_sum"]


def build(seed: int = 0, width: int = 16):
    """(model, optimizer, scheduler, data order, counter), identical for one seed in any process."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Dropout(0.1), nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched, DataOrder(), Counter()


def seed_globals(seed: int = 1) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_step(model, opt, sched, data, counter, width: int = 16, sync=None) -> None:
    """One step: the data order, torch / numpy / Python draws, dropout, AdamW, StepLR, the counter; ``sync``:
    called with the model between ``backward()`` and ``opt.step()`` (the multi-process gradient all-reduce)."""
    item = data.next()
    x = torch.randn(4, width) + item + float(np.random.rand()) + random.random()
    loss = model(x).pow(2).mean()
    loss.backward()
    if sync is not None:
        sync(model)
    opt.step()
    opt.zero_grad()
    sched.step()
    counter.tokens += 4
    counter.loss_sum += float(loss.detach())


def fingerprint(model, opt, sched, data, counter) -> dict[str, torch.Tensor]:
    """Everything a resume must reproduce, as tensors (plus the next draws of every global RNG)."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, (_k, st) in enumerate(opt.state_dict()["state"].items()):
        for name, t in st.items():
            out[f"opt.{i}.{name}"] = torch.as_tensor(t).clone()
    out["lr"] = torch.tensor(sched.get_last_lr())
    out["data"] = torch.tensor([data.epoch, data.pos])
    out["counter"] = torch.tensor([counter.tokens, counter.loss_sum], dtype=torch.float64)
    out["draws"] = torch.cat([torch.rand(3).double(), torch.tensor([np.random.rand(), random.random()])])
    return out


def reference(total: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The uninterrupted run of ``total`` steps."""
    state = build(seed)
    seed_globals()
    for _ in range(total):
        train_step(*state)
    return fingerprint(*state)


def main(argv: list[str]) -> int:
    from safetensors.torch import save_file

    import fastckpt

    project, memory, total, every = argv[0], argv[1], int(argv[2]), int(argv[3])
    wait = "--wait" in argv
    torch.set_num_threads(1)
    state = build()
    seed_globals()
    mgr = fastckpt.CheckpointManager(project, *state[:3], every_n_steps=every, memory=memory)
    mgr.register_for_checkpointing(state[3], state[4])
    start = mgr.restore()
    print(f"restored {start} {mgr.restored_from}", flush=True)
    try:
        for step in range(start, total):
            train_step(*state)
            mgr.step(step + 1)
            print(f"step {step + 1}", flush=True)
            if wait:
                sys.stdin.readline()
    except fastckpt.Preempted as exc:
        print(f"preempted {exc.step}", flush=True)
        raise
    mgr.close()
    save_file(fingerprint(*state), f"{project}/final.safetensors")
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

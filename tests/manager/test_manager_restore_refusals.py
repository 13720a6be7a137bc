"""CheckpointManager.restore() tells damage from a mismatch: a damaged tier is skipped, an intact checkpoint of other
objects (a scheduler added, another model) is refused with its typed error (nothing applied, nothing deleted), and a
memory snapshot saved by another project (a shared FASTCKPT_JOB_ID) is skipped, never applied."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.recovery_loop import build, train_step

import fastckpt
from fastckpt.errors import TierSkippedWarning


def train(project, state, *, steps: int = 4, **kw):
    mgr = fastckpt.CheckpointManager(project, *state[:3], every_n_steps=2, **kw)
    assert mgr.restore() == 0
    for step in range(steps):
        train_step(*state)
        mgr.step(step + 1)
    mgr.wait()  # not close(): that removes the memory tier, the snapshot stays as after a crash


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_scheduler_added_on_restart_is_refused_not_skipped(tmp_path):
    model, opt, sched, data, counter = build()
    mgr = fastckpt.CheckpointManager(tmp_path / "run", model, opt, every_n_steps=2, memory=False)
    for step in range(4):
        train_step(model, opt, sched, data, counter)
        mgr.step(step + 1)
    mgr.close()
    model, opt, sched, *_ = build()
    before = weights(model)
    mgr = fastckpt.CheckpointManager(tmp_path / "run", model, opt, sched, every_n_steps=2, memory=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TierSkippedWarning)  # not "damaged": refused
        with pytest.raises(fastckpt.MissingStateError, match="scheduler"):
            mgr.restore()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing applied
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_4"]


def test_another_model_in_the_memory_tier_is_refused(tmp_path):
    train(tmp_path / "run", build(), memory=tmp_path / "mem")
    state = build(width=8)
    before = weights(state[0])
    mgr = fastckpt.CheckpointManager(tmp_path / "run", *state[:3], every_n_steps=2, memory=tmp_path / "mem")
    with pytest.raises(fastckpt.ShapeMismatchError):
        mgr.restore()
    assert all(torch.equal(before[k], v) for k, v in state[0].state_dict().items())
    assert (tmp_path / "mem" / "checkpoints" / "checkpoint_4").is_dir()  # nothing deleted


def test_another_projects_memory_snapshot_is_skipped(tmp_path):
    # two projects share one memory folder (e.g. one FASTCKPT_JOB_ID): B must not restore A's newer snapshot
    train(tmp_path / "a", build(), steps=6, memory=tmp_path / "mem")  # A: step 6 in memory
    train(tmp_path / "b", build(), steps=4, memory=False)  # B: its own durable step 4, another model
    state = build()
    mgr = fastckpt.CheckpointManager(tmp_path / "b", *state[:3], every_n_steps=2, memory=tmp_path / "mem")
    with pytest.warns(TierSkippedWarning, match=f"belongs to the project {(tmp_path / 'a').resolve()}"):
        assert mgr.restore() == 4
    assert mgr.restored_from == "local"
    mgr.close()


def test_another_projects_snapshot_alone_restores_nothing(tmp_path):
    train(tmp_path / "a", build(), memory=tmp_path / "mem")
    state = build()
    before = weights(state[0])
    mgr = fastckpt.CheckpointManager(tmp_path / "b", *state[:3], every_n_steps=2, memory=tmp_path / "mem")
    with pytest.warns(TierSkippedWarning, match="belongs to the project"):
        assert mgr.restore() == 0  # not damage: a fresh start of project B
    assert all(torch.equal(before[k], v) for k, v in state[0].state_dict().items())
    mgr.close()

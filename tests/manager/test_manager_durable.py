"""The durable tier of a CheckpointManager when its background copy fails: the previous durable checkpoint stays the
latest and intact (no partial folder), the failure is a DurableSaveError naming the step and the cause, raised once,
the memory tier keeps the step the durable tier lacks (close() does not remove it), and a restore takes it."""

from __future__ import annotations

import errno

import pytest
import torch
from helpers.recovery_loop import build, fingerprint, seed_globals, train_step

import fastckpt
import fastckpt._io.storage.memory as memory_io


def manager(tmp_path, state):
    mgr = fastckpt.CheckpointManager(tmp_path / "proj", *state[:3], every_n_steps=2, memory=tmp_path / "mem")
    mgr.register_for_checkpointing(state[3], state[4])
    return mgr


def test_a_copy_failing_midway_leaves_the_previous_durable_step_the_latest(tmp_path, monkeypatch):
    state = build()
    seed_globals()
    mgr = manager(tmp_path, state)
    for step in (1, 2):
        train_step(*state)
        mgr.step(step)
    assert mgr.wait() == 2
    real = memory_io.copy_files

    def full_disk(src, dst, *, durable):  # one file copied, then the disk is full
        first = sorted(p for p in src.iterdir() if p.name != "fastckpt.json")[0]
        (dst / first.name).write_bytes(first.read_bytes())
        raise OSError(errno.ENOSPC, "No space left on device", str(dst / "optimizer.safetensors"))

    monkeypatch.setattr(memory_io, "copy_files", full_disk)
    for step in (3, 4):
        train_step(*state)
        mgr.step(step)
    want = fingerprint(*state)
    with pytest.raises(fastckpt.DurableSaveError) as info:
        mgr.wait()
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    message = str(info.value)
    assert "durable save of step 4 to" in message and "checkpoint_4 failed (OSError" in message
    assert "newest durable step is 2" in message and "memory tier still holds step 4" in message
    checkpoints = tmp_path / "proj" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_2"]  # no partial or staging folder
    assert fastckpt.latest_checkpoint(tmp_path / "proj").name == "checkpoint_2"
    fastckpt.verify_checkpoint(checkpoints / "checkpoint_2")
    assert mgr.wait() == 2  # raised once
    monkeypatch.setattr(memory_io, "copy_files", real)
    mgr.close()  # step 4 is not durable: the memory tier keeps it
    assert (tmp_path / "mem" / "checkpoints" / "checkpoint_4" / "fastckpt.json").is_file()

    state = build()
    mgr = manager(tmp_path, state)
    assert mgr.restore() == 4 and mgr.restored_from == "memory"
    got = fingerprint(*state)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    mgr.close()


def test_the_first_failure_is_raised_at_the_next_step_and_later_ones_are_logged(tmp_path, monkeypatch, caplog):
    state = build()
    mgr = manager(tmp_path, state)

    def refuse(src, target, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", str(target))

    import fastckpt.manager.durable as durable

    monkeypatch.setattr(durable, "copy_committed", refuse)
    train_step(*state)
    mgr.step(2)
    mgr.durable.idle()
    mgr.save_now(3)  # a second failure while the first is not raised yet
    mgr.durable.idle()
    with pytest.raises(fastckpt.DurableSaveError, match="durable save of step 2 .*PermissionError"):
        mgr.step(4)
    assert "durable save of step 3" in caplog.text
    monkeypatch.undo()
    mgr.close()


def test_a_failure_superseded_by_the_step_waited_for_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    """A preemption save waits for its own step: an older step's failed copy must not stop it from exiting."""
    import fastckpt.manager.durable as durable

    real = durable.copy_committed

    def fail_step_2(src, target, **kw):
        if target.name == "checkpoint_2":
            raise OSError(errno.EIO, "Input/output error", str(target))
        return real(src, target, **kw)

    monkeypatch.setattr(durable, "copy_committed", fail_step_2)
    state = build()
    mgr = manager(tmp_path, state)
    train_step(*state)
    mgr.step(2)
    mgr.durable.idle()
    mgr.save_now(4)  # makes no background check
    assert mgr.durable.wait(4) == 4
    assert "durable save of step 2" in caplog.text and "superseded: step 4 is durable" in caplog.text
    assert mgr.wait() == 4  # nothing left to raise
    mgr.close()


def test_a_failed_rotation_says_the_step_is_committed(tmp_path, monkeypatch):
    import fastckpt.manager.durable as durable

    def refuse(project, keep):
        raise PermissionError(errno.EACCES, "Permission denied", str(project / "checkpoints" / "checkpoint_0"))

    monkeypatch.setattr(durable, "rotate_checkpoints", refuse)
    state = build()
    mgr = manager(tmp_path, state)
    train_step(*state)
    mgr.step(2)
    with pytest.raises(fastckpt.DurableSaveError, match=r"rotation to keep=3 after step 2 failed \(PermissionError.*"
                       r"checkpoint_2 is committed"):
        mgr.wait()
    assert fastckpt.latest_checkpoint(tmp_path / "proj").name == "checkpoint_2"
    mgr.close()

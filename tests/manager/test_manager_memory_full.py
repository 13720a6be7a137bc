"""A full memory tier (``/dev/shm`` out of room: ENOSPC while the snapshot is written) does not lose the step:
``mgr.step()`` warns (MemoryTierFullWarning naming the memory folder, the bytes needed and the remedies) and saves
the step durably instead; the partial snapshot is removed and never restored. A small tmpfs needs root to mount, so
the failure is injected: the Nth file written into the memory tier gets half its bytes, then ENOSPC."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from helpers.recovery_loop import build, fingerprint, seed_globals, train_step

import fastckpt
from fastckpt._io.storage.local import commit
from fastckpt._io.storage.local.integrity import verify_checkpoint
from fastckpt.errors import MemoryTierFullWarning


def fill_memory_at(monkeypatch, mem, nth: int | None):
    """Make the ``nth`` file written under ``mem`` (None: the manifest) fail with ENOSPC after half its bytes."""
    real = commit.write_text
    seen = []

    def write_text(path, data, durable):
        if str(path).startswith(str(mem)):
            seen.append(path)
            if (nth is None and path.name == "fastckpt.json") or len(seen) == nth:
                raw = data if isinstance(data, bytes) else data.encode()
                with open(path, "wb") as f:
                    f.write(raw[: len(raw) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data, durable)

    monkeypatch.setattr(commit, "write_text", write_text)
    return seen


def leftovers(mem):
    return sorted(p.name for p in (mem / "checkpoints").iterdir() if not p.name.startswith("checkpoint_"))


@pytest.mark.parametrize("nth", [1, None], ids=["first-json-file", "manifest"])
def test_enospc_in_the_memory_tier_saves_the_step_durably(tmp_path, monkeypatch, nth):
    mem, proj = tmp_path / "mem", tmp_path / "proj"
    state = build()
    seed_globals()
    mgr = fastckpt.CheckpointManager(proj, *state[:3], every_n_steps=2, memory=mem)
    mgr.register_for_checkpointing(state[3], state[4])
    for step in range(2):
        train_step(*state)
        mgr.step(step + 1)
    mgr.wait()
    seen = fill_memory_at(monkeypatch, mem, nth)
    for step in range(2, 4):
        train_step(*state)
        if step + 1 == 4:
            with pytest.warns(MemoryTierFullWarning) as caught:
                assert mgr.step(4) is True  # no OSError: the step is saved
        else:
            mgr.step(step + 1)
    assert seen  # the failure was injected
    message = str(caught[0].message)
    assert f"the memory tier {mem} has no room for step 4" in message
    assert "No space left on device" in message and "memory=False" in message
    nbytes = int(message.split("the state needs ")[1].split(" bytes")[0])
    assert nbytes > sum(p.numel() * p.element_size() for p in state[0].parameters())
    at4 = fingerprint(*state)
    assert (proj / "checkpoints" / "checkpoint_4" / "fastckpt.json").is_file()  # durable when step() returned
    assert not (mem / "checkpoints" / "checkpoint_4").exists() and leftovers(mem) == []  # nothing half-written
    verify_checkpoint(proj / "checkpoints" / "checkpoint_4")  # every crc32c
    monkeypatch.undo()  # the memory tier has room again
    mgr.wait()
    mgr.signals.uninstall()  # the process dies here: the memory tier keeps step 2 only

    state = build(seed=3)
    seed_globals(5)
    mgr = fastckpt.CheckpointManager(proj, *state[:3], every_n_steps=2, memory=mem)
    mgr.register_for_checkpointing(state[3], state[4])
    assert mgr.restore() == 4 and mgr.restored_from == "local"
    got = fingerprint(*state)
    assert got.keys() == at4.keys() and all(torch.equal(got[k], at4[k]) for k in at4)  # RNG draws included
    train_step(*state)
    mgr.step(5)
    train_step(*state)
    assert mgr.step(6) is True  # the memory tier works again
    assert (mem / "checkpoints" / "checkpoint_6").is_dir()
    mgr.close()

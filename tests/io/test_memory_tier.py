"""The memory tier (fastckpt._io.storage.memory) speaks the storage verbs: a staged save is invisible until its
commit, a commit puts it in place in one rename and drops the older ones (but a held one), abort leaves nothing, a
dead process's staging is removed by the next save, open() checks the bytes; and peer_ranks picks other machines."""

from __future__ import annotations

import os

import pytest
import torch

import fastckpt
from fastckpt._io.storage.base import Storage
from fastckpt._io.storage.memory import MemoryTier, copy_committed
from fastckpt._io.storage.peer import peer_ranks
from fastckpt._plan.save import build_save_plan


def plan(step: int):
    torch.manual_seed(step)
    return build_save_plan([torch.nn.Linear(3, 2)], [], [], model_only=False, step=step)


def visible(tier: MemoryTier) -> list[str]:
    return sorted(p.name for p in tier.folder.iterdir() if not p.name.startswith("."))


def test_staged_commit_list_open_remove(tmp_path):
    tier = MemoryTier(tmp_path / "mem")
    assert isinstance(tier, Storage) and tier.list() == []
    save = tier.begin(step=3)
    save.write(plan(3))
    assert tier.list() == [] and visible(tier) == []  # invisible until the commit
    committed = save.commit()
    assert committed.step == 3 and [c.step for c in tier.list()] == [3]
    with tier.open() as view:
        assert view.manifest["step"] == 3 and view.tier == "memory"
    tier.hold(3)
    s5 = tier.begin(step=5)
    s5.write(plan(5))
    s5.commit()
    assert [c.step for c in tier.list()] == [3, 5]  # 3 is held
    tier.release(3)
    tier.prune()
    assert [c.step for c in tier.list()] == [5]
    tier.remove(tier.list()[0])
    assert tier.list() == [] and visible(tier) == []


def test_abort_and_dead_staging_leave_nothing(tmp_path):
    tier = MemoryTier(tmp_path / "mem")
    save = tier.begin(step=1)
    save.write(plan(1))
    save.abort()
    save.abort()  # idempotent
    assert os.listdir(tier.folder) == []
    with pytest.raises(ValueError, match="step="):
        tier.begin("named")


def test_open_checks_the_bytes_and_copy_commits_a_durable_copy(tmp_path):
    tier = MemoryTier(tmp_path / "mem")
    save = tier.begin(step=2)
    save.write(plan(2))
    save.commit()
    target = copy_committed(tier.folder / "checkpoint_2", tmp_path / "proj" / "checkpoints" / "checkpoint_2")
    assert fastckpt.verify_checkpoint(target).ok
    assert (target / "model.safetensors").read_bytes() == (tier.folder / "checkpoint_2" / "model.safetensors").read_bytes()
    path = tier.folder / "checkpoint_2" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(fastckpt.IntegrityError, match="model.safetensors"):
        with tier.open() as view:
            from fastckpt._io.storage.local.folder import open_safetensors

            open_safetensors(view.folder / "model.safetensors")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_durable_copy_from_shared_memory_to_another_file_system(tmp_path):
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        tier = MemoryTier(shm)
        save = tier.begin(step=4)
        save.write(plan(4))
        save.commit()
        target = copy_committed(tier.folder / "checkpoint_4", tmp_path / "checkpoints" / "checkpoint_4")
        assert fastckpt.verify_checkpoint(target).ok
        assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in (tier.folder / "checkpoint_4").iterdir())


@pytest.mark.parametrize(("rank", "world", "k", "local", "want"), [
    (0, 2, 1, 2, [1]),            # one machine: the next rank
    (3, 4, 2, 4, [0, 1]),
    (0, 8, 1, 4, [4]),            # two machines of 4: the same local rank on the other machine
    (5, 8, 2, 4, [1, 0]),         # more replicas than machines: the other machine's other ranks next
    (0, 1, 1, 1, []),
])
def test_peer_ranks(rank, world, k, local, want):
    assert peer_ranks(rank, world, k, local) == want


def test_default_root_is_per_job_and_rank(tmp_path, monkeypatch):
    from fastckpt._io.storage.memory import default_memory_root

    monkeypatch.delenv("FASTCKPT_JOB_ID", raising=False)
    a = default_memory_root(tmp_path / "run", 3)
    assert a == default_memory_root(tmp_path / "run", 3)  # a restart finds it again
    assert a.name == "rank3" and a.parent.name.startswith("fastckpt-run-")
    assert a != default_memory_root(tmp_path / "other" / "run", 3)
    monkeypatch.setenv("FASTCKPT_JOB_ID", "job/42")
    assert default_memory_root(tmp_path / "run", 0).parent.name == "fastckpt-job_42"


def test_clear_removes_only_what_the_tier_wrote(tmp_path):
    """memory= may name a folder the user keeps other files in: clear() (the manager's close()) removes the tier's
    checkpoints, leftovers and held replicas, then the folders left empty, never the user's files."""
    from fastckpt._io.storage.peer import replica_tier

    root = tmp_path / "scratch"
    (root / "checkpoints").mkdir(parents=True)
    (root / "notes.txt").write_text("mine")
    (root / "checkpoints" / "mine.bin").write_bytes(b"x")
    tier = MemoryTier(root)
    for step in (1, 2):
        save = tier.begin(step=step)
        save.write(plan(step))
        save.commit()
    peer = replica_tier(root, 3)
    save = peer.begin(step=2)
    save.write(plan(2))
    save.commit()
    tier.begin(step=5)  # a staging folder left open
    tier.clear()
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "checkpoints", "checkpoints/mine.bin", "notes.txt"]
    own = MemoryTier(tmp_path / "own")
    save = own.begin(step=1)
    save.write(plan(1))
    save.commit()
    own.clear()
    assert not own.root.exists()  # a tier folder of its own goes whole


def test_pruned_snapshot_stops_counting_at_the_commit_and_is_freed_in_the_background(tmp_path):
    tier = MemoryTier(tmp_path / "mem")
    for step in (1, 2):
        save = tier.begin(step=step)
        save.write(plan(step))
        save.commit()
        assert [c.step for c in tier.list()] == [step] and visible(tier) == [f"checkpoint_{step}"]
    tier.drain()  # the removal of checkpoint_1 (renamed to a trash name at the commit) is done
    assert sorted(os.listdir(tier.folder)) == ["checkpoint_2"]
    tier.clear()
    assert not tier.root.exists()

"""A project folder deleted and made again at the same path (``rm -rf run``, then a fresh run with the same
project_dir and job id) is another project: the old run's memory-tier snapshot, still in /dev/shm, is skipped with a
TierSkippedWarning naming both incarnation ids (it was restored, silently), on one process and on the sharded
(FSDP2) restore path (:func:`fastckpt.manager.restore.survey`, which every rank of a multi-process restore runs; the
FSDP2 training run is in tests/helpers/mp_fsdp_manager.py)."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from helpers.recovery_loop import build, train_step

import fastckpt
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.storage.memory import MemoryTier, default_memory_root
from fastckpt.errors import TierSkippedWarning
from fastckpt.manager.incarnation import ID_FILE, project_id
from fastckpt.manager.restore import survey
from fastckpt.manager.sharded import LAYOUT


def train(project, state, *, steps: int, **kw):
    mgr = fastckpt.CheckpointManager(project, *state[:3], every_n_steps=2, **kw)
    assert mgr.restore() == 0
    for step in range(steps):
        train_step(*state)
        mgr.step(step + 1)
    mgr.wait()  # not close(): the memory snapshot stays, as after a crash
    mgr.signals.uninstall()
    return mgr


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_recreated_project_does_not_restore_the_old_runs_memory_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTCKPT_JOB_ID", f"test-incarnation-{tmp_path.name}")  # the same job id, memory=True
    run = tmp_path / "run"
    old = train(run, build(), steps=6, memory=True)
    old_id = (run / ID_FILE).read_text().strip()
    assert (old.memory.folder / "checkpoint_6").is_dir()
    shutil.rmtree(run)  # the user starts over at the same path
    state = build(seed=1)
    before = weights(state[0])
    mgr = fastckpt.CheckpointManager(run, *state[:3], every_n_steps=2, memory=True)
    assert mgr.memory.root == default_memory_root(run, 0) == old.memory.root
    new_id = (run / ID_FILE).read_text().strip()
    assert new_id != old_id and mgr.project_id == new_id
    with pytest.warns(TierSkippedWarning, match=f"earlier incarnation of the project {run.resolve()} "
                                                f"\\(project id {old_id}; this one is {new_id}"):
        assert mgr.restore() == 0
    assert mgr.restored_from is None
    assert all(torch.equal(before[k], v) for k, v in state[0].state_dict().items())  # nothing applied
    for step in range(2):
        train_step(*state)
        mgr.step(step + 1)
    mgr.close()
    assert not mgr.memory.root.exists()  # the fresh run's close() removed the old snapshot with its own


def test_the_same_incarnation_restores_its_memory_snapshot(tmp_path):
    run = tmp_path / "run"
    train(run, build(), steps=4, memory=tmp_path / "mem")
    shutil.rmtree(run / "checkpoints")  # the durable tier gone, the project folder (and its id) kept
    state = build(seed=1)
    mgr = fastckpt.CheckpointManager(run, *state[:3], every_n_steps=2, memory=tmp_path / "mem")
    with warnings.catch_warnings():
        warnings.simplefilter("error", TierSkippedWarning)
        assert mgr.restore() == 4 and mgr.restored_from == "memory"
    mgr.close()


def test_the_id_is_written_once_and_read_back(tmp_path):
    first, made = project_id(tmp_path / "a" / "run")
    assert made == [tmp_path / "a" / "run", tmp_path / "a", tmp_path / "a" / "run" / ID_FILE]
    again, made = project_id(tmp_path / "a" / "run")
    assert again == first and made == []
    (tmp_path / "a" / "run" / ID_FILE).write_text("not an id\n")
    with pytest.raises(fastckpt.CheckpointError, match=f"{ID_FILE}: holds 'not an id'"):
        project_id(tmp_path / "a" / "run")


def test_a_sharded_snapshot_of_an_earlier_incarnation_is_skipped(tmp_path):
    """The sharded restore path: survey() (every rank of restore_multi) skips a local-shards snapshot whose project
    id differs from the live project's."""
    proj = tmp_path / "proj"
    tier = MemoryTier(tmp_path / "mem", project=str(proj.resolve()))
    tier.project_id = "a" * 32
    plan = SavePlan(mode="full", step=4, counts={"layout": LAYOUT, LAYOUT: {"rank": 0, "world_size": 2}})
    plan.parts.append(FilePart("model.local_rank0.safetensors", {"w": torch.arange(6.0)}, [("k", "v")]))
    save = tier.begin(step=4)
    save.write(plan)
    save.commit()
    assert survey(tier, proj, None, None, rank=0, threads=1, world=2)["memory"] == 4  # its own incarnation
    tier.project_id = "b" * 32  # the folder deleted and made again
    with pytest.warns(TierSkippedWarning, match=f"project id {'a' * 32}; this one is {'b' * 32}"):
        report = survey(tier, proj, None, None, rank=0, threads=1, world=2)
    assert report["memory"] is None


def test_a_project_dir_that_takes_no_files_is_refused_at_construction():
    """The manager's async steps never start on a project folder that cannot be made: its constructor raises the
    typed error (also the errno's builtin class), naming the folder given, and no step runs."""
    from fastckpt.errors import DestinationNotWritableError

    model = torch.nn.Linear(2, 2)
    for given, builtin in (("/proc/x/run", FileNotFoundError), ("/sys/x", PermissionError)):
        with pytest.raises(DestinationNotWritableError) as info:
            fastckpt.CheckpointManager(given, model, every_n_steps=1)
        assert isinstance(info.value, builtin) and info.value.filename == given, repr(info.value)
        assert "project_dir must be writable" in str(info.value)

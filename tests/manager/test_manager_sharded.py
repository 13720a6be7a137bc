"""CheckpointManager with sharded (FSDP2 / DTensor) states, the parts one process can check: a memory-tier snapshot of
local shards saved by another world size is skipped with a TierSkippedWarning (the restore goes to the durable tier,
never a wrong result), and a step that some rank restores from the durable tier is restored from it by every rank.
The training runs (2 and 4 processes, gloo, FSDP2 + AdamW) are in tests/integrations/test_recovery_multiprocess.py
(tests/helpers/mp_fsdp_manager.py)."""

from __future__ import annotations

import pytest
import torch

import fastckpt
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.storage.memory import MemoryTier
from fastckpt.errors import TierSkippedWarning
from fastckpt.manager.restore import decide, survey
from fastckpt.manager.sharded import LAYOUT, snapshot_world


def snapshot(root, *, step: int, world: int) -> MemoryTier:
    """A committed local-shards snapshot of rank 0 of ``world`` processes."""
    tier = MemoryTier(root)
    plan = SavePlan(mode="full", step=step, counts={"layout": LAYOUT, LAYOUT: {"rank": 0, "world_size": world}})
    plan.parts.append(FilePart("model.local_rank0.safetensors", {"w": torch.arange(6.0)}, [("k", "v")]))
    save = tier.begin(step=step)
    save.write(plan)
    save.commit()
    return tier


def test_snapshot_of_another_world_size_is_skipped_with_a_warning(tmp_path):
    tier = snapshot(tmp_path / "mem", step=4, world=2)
    assert snapshot_world(tier.folder / "checkpoint_4") == 2
    with pytest.warns(TierSkippedWarning, match=r"memory tier.*step 4.*saved by 2 processes, this run has 4"):
        report = survey(tier, tmp_path / "proj", None, None, rank=0, threads=1, world=4)
    assert report["memory"] is None
    assert survey(tier, tmp_path / "proj", None, None, rank=0, threads=1, world=2)["memory"] == 4


def test_sharded_step_needing_the_durable_tier_is_restored_from_it_by_every_rank(tmp_path):
    proj = tmp_path / "proj"
    fastckpt.save_state(torch.nn.Linear(2, 2), output_dir=proj / "checkpoints" / "checkpoint_4")
    reports = [{"memory": 4, "held": {}, "local": [4], "remote": None},
               {"memory": None, "held": {}, "local": [4], "remote": None}]
    assert decide(reports, proj, threads=1)["sources"] == [["memory"], ["local"]]  # replicated: mixed is fine
    assert decide(reports, proj, threads=1, together=True) == {"step": 4, "sources": [["local"], ["local"]]}
    both = [dict(r, memory=4) for r in reports]
    assert decide(both, proj, threads=1, together=True)["sources"] == [["memory"], ["memory"]]

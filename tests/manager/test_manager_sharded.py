"""CheckpointManager with sharded (FSDP2 / DTensor) states, the parts one process can check: a memory-tier snapshot of
local shards saved by another world size is skipped with a TierSkippedWarning (the restore goes to the durable tier,
never a wrong result), and a step that some rank restores from the durable tier is restored from it by every rank.
A one-process FSDP2 run (a 1-process gloo group: no other process to agree with) restores its own memory tier and
its durable tier. The training runs (2 and 4 processes, gloo, FSDP2 + AdamW) are in
tests/integrations/test_recovery_multiprocess.py (tests/helpers/mp_fsdp_manager.py)."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from helpers.common import run_python

import fastckpt
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.storage.memory import MemoryTier
from fastckpt.errors import TierSkippedWarning
from fastckpt.manager.restore import decide, survey
from fastckpt.manager.sharded import LAYOUT, snapshot_world


def snapshot(root, *, step: int, world: int, rank: int = 0, meta=(("k", "v"),)) -> MemoryTier:
    """A committed local-shards snapshot of ``rank`` of ``world`` processes (``meta``: its model file's metadata)."""
    tier = MemoryTier(root)
    plan = SavePlan(mode="full", step=step, counts={"layout": LAYOUT, LAYOUT: {"rank": rank, "world_size": world}})
    plan.parts.append(FilePart(f"model.local_rank{rank}.safetensors", {"w": torch.arange(6.0)}, list(meta)))
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


def test_snapshot_of_another_rank_is_skipped_with_a_warning(tmp_path):
    """One memory= path on every node and ranks placed anew after a restart: the shards of rank 0 found where
    rank 1's are kept are skipped (the durable tier restores the step), never a restore that fails on every rank."""
    tier = snapshot(tmp_path / "mem", step=4, world=2, rank=0)
    with pytest.warns(TierSkippedWarning, match=r"memory tier.*step 4.*local shards of rank 0, found where rank 1"):
        report = survey(tier, tmp_path / "proj", None, None, rank=1, threads=1, world=2)
    assert report["memory"] is None
    assert survey(tier, tmp_path / "proj", None, None, rank=0, threads=1, world=2)["memory"] == 4


@pytest.mark.parametrize("record", ["{not json", "[1]", '{"weight": 3}'])
def test_snapshot_with_a_malformed_shard_record_is_skipped_with_a_warning(tmp_path, record):
    """The shard records of a snapshot's model file are checked against the live model before the restore: a record
    that is no JSON object of objects is a HeaderError (the tier skipped), never json's or Python's own error."""
    tier = snapshot(tmp_path / "mem", step=4, world=2, meta=[("fastckpt.local_shards", record)])
    with pytest.warns(TierSkippedWarning, match=r"memory tier.*step 4.*HeaderError.*fastckpt.local_shards record"):
        report = survey(tier, tmp_path / "proj", None, None, rank=0, threads=1, world=2,
                        models=[torch.nn.Linear(2, 3)])
    assert report["memory"] is None


def test_sharded_step_needing_the_durable_tier_is_restored_from_it_by_every_rank(tmp_path):
    proj = tmp_path / "proj"
    fastckpt.save_state(torch.nn.Linear(2, 2), output_dir=proj / "checkpoints" / "checkpoint_4")
    reports = [{"memory": 4, "held": {}, "local": [4], "remote": None},
               {"memory": None, "held": {}, "local": [4], "remote": None}]
    assert decide(reports, proj, threads=1)["sources"] == [["memory"], ["local"]]  # replicated: mixed is fine
    assert decide(reports, proj, threads=1, together=True) == {"step": 4, "sources": [["local"], ["local"]]}
    both = [dict(r, memory=4) for r in reports]
    assert decide(both, proj, threads=1, together=True)["sources"] == [["memory"], ["memory"]]


ONE_PROCESS = """
import json, shutil, warnings
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import fastckpt
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
def make(seed, mesh=None):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(m, mesh=mesh)
    o = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    o.step()
    return m, o
def state(m, o):
    out = {{k: v.full_tensor() for k, v in m.state_dict().items()}}
    for p, s in o.state.items():
        out.update({{f"{{id(p)}}.{{k}}": v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in s.items()}})
    return list(out.values())
def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
m, o = make(0)
saved = state(m, o)
fastckpt.CheckpointManager({proj!r}, m, o, memory={mem!r}).save_now(3)  # a crash: its memory tier stays
res = {{}}
hsdp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
for source, mesh in (("other_mesh", hsdp), ("memory", None), ("local", None)):
    m2, o2 = make(1, mesh)
    mgr = fastckpt.CheckpointManager({proj!r}, m2, o2, memory={mem!r})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res[source] = [mgr.restore(), mgr.restored_from, same(state(m2, o2), saved),
                       [f"{{w.category.__name__}}: {{w.message}}" for w in caught]]
    if source == "memory":
        shutil.rmtree({mem!r} + "/checkpoints")  # next: the durable tier
print(json.dumps(res))
dist.destroy_process_group()
"""


def test_one_process_sharded_run_restores_its_memory_and_durable_tiers(tmp_path):
    """FSDP2 in a 1-process group: the manager's restore reads its local-shards snapshot (memory tier) and its
    sharded durable checkpoint, as the multi-process restore does (it read them as one-process folders and
    raised MissingStateError for model.safetensors). A model sharded another way since (an HSDP mesh: other
    placements, same world size) skips the memory tier with a TierSkippedWarning naming both shardings and
    restores the step from the durable tier, which DCP reshards (the restore raised ShapeMismatchError)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_python(ONE_PROCESS.format(port=port, proj=str(tmp_path / "proj"), mem=str(tmp_path / "mem")))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["memory"] == [3, "memory", True, []] and res["local"] == [3, "local", True, []]
    assert res["other_mesh"][:3] == [3, "local", True]
    (warning,) = res["other_mesh"][3]
    assert warning.startswith("TierSkippedWarning: the memory tier's checkpoint of step 3")
    assert "model.local_rank0.safetensors: 0.weight was saved with placements (Shard(dim=0),) on a mesh [1], " \
           "the live one has (Replicate(), Shard(dim=0)) on [1, 1]" in warning

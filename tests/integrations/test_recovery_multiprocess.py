"""CheckpointManager with 2 and 4 real processes (``torchrun``, gloo, CPU, DDP): one launch per world size runs
every scenario of tests/helpers/mp_recovery_worker.py (a preemption seen by one rank saved by all at the same
step, a lost node restored from a peer's replica without reading the durable tier, a damaged memory tier replaced
by the peer's replica, every memory tier lost: the durable tier, twenty SIGTERMs to random ranks at random moments,
a failed durable copy raised on every rank), each resumed bit-exactly against the uninterrupted multi-process run
of the same launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "mp_recovery_worker.py"
K = 4  # the step during which the last rank gets SIGTERM (the worker's K)
SEED = "25"  # the worker's draws of the random preemptions (FASTCKPT_TEST_SEED): printed in a failure


@pytest.fixture(scope="module", params=[2, 4])
def run(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"recovery{world}")
    tests = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", FASTCKPT_TEST_SEED=SEED,
               PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=600)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)
               if (out / f"rank{r}.json").is_file()]
    assert proc.returncode == 0 and len(results) == world, proc.stdout[-3000:] + proc.stderr[-6000:]
    crashes = [f"rank {r}:\n{res['crash']}" for r, res in enumerate(results) if res["crash"]]
    assert not crashes, "\n".join(crashes)
    return world, out, results


def test_one_rank_signalled_every_rank_saves_the_same_step(run):
    world, out, results = run
    for res in results:
        assert res["preempt_step"] == K + 1 and res["preempt_code"] == 0
        assert res["preempt_durable_files"] == sorted(
            ["fastckpt.json", "model.safetensors", "optimizer.safetensors", "scheduler.json"]
            + [f"random_states_{r}.safetensors" for r in range(world)]
            + [f"custom_checkpoint_{i}_rank{r}.safetensors" for i in (0, 1) for r in range(world)])
        assert res["preempt_restart"] == [K + 1, "memory"] and res["preempt_equal"] is True


def test_lost_node_restores_from_a_peer_replica(run):
    world, out, results = run
    assert [res["lost_restart"] for res in results] == [[6, "peer" if r == 1 else "memory"] for r in range(world)]
    assert all(res["lost_warnings"] == [] for res in results)  # the damaged durable step 3 was never read
    assert all(res["lost_equal"] is True for res in results)


def test_damaged_memory_tier_is_replaced_by_the_peer_replica(run):
    world, out, results = run
    assert [res["damaged_restart"] for res in results] == [[6, "peer" if r == 0 else "memory"] for r in range(world)]
    warned = results[0]["damaged_warnings"]
    assert len(warned) == 1 and "memory tier" in warned[0] and "mem0" in warned[0] and "IntegrityError" in warned[0]
    assert all(res["damaged_warnings"] == [] for res in results[1:])
    assert all(res["damaged_equal"] is True for res in results)


def test_every_memory_tier_lost_restores_the_durable_tier(run):
    world, out, results = run
    assert [res["durable_restart"] for res in results] == [[6, "local"]] * world
    assert all(res["durable_equal"] is True for res in results)


def test_continuous_saves_are_agreed(run):
    world, out, results = run
    saved = [res["continuous_saved"] for res in results]
    # proposed by the main process at the step after a save was durable, for the next step: every other step
    assert saved == [[2, 4, 6, 8]] * world


def test_random_sigterms_every_rank_saves_the_step_and_the_job_ends_bit_exact(run):
    """Twenty SIGTERMs, each to one random rank at a random step, at a step boundary, inside the gradient all-reduce,
    inside a save or inside the restore: every rank saves the same step durably (the first boundary after the
    signalled rank's, agreed through the store) and raises Preempted; the job, restarted after each, ends equal to
    the uninterrupted run of the same launch."""
    world, out, results = run
    rounds = results[0]["random_rounds"]
    assert all(res["random_rounds"] == rounds for res in results), f"seed {SEED}"
    assert len(rounds) == 21 and rounds[-1][0] is None, rounds  # twenty preemptions, then the run to the end
    assert sorted(r[0] for r in rounds[1:5]) == ["all_reduce", "boundary", "restore", "save"], rounds
    previous = 0
    for moment, who, at, start, saved, restored_from, durable in rounds[:-1]:
        assert 0 <= who < world and start == previous
        # the signalled rank proposes the step after the boundary where it first saw the signal
        seen_at = {"boundary": at, "all_reduce": at, "save": at + 1, "restore": start + 1}[moment]
        assert saved == seen_at + 1, (moment, who, at, start, saved, f"seed {SEED}")
        assert durable is True and restored_from == (None if start == 0 else "memory")
        previous = saved
    assert rounds[-1][3] == previous and rounds[-1][5] == "memory"
    assert all(res["random_equal"] is True for res in results), f"seed {SEED}"


def test_a_failed_durable_copy_is_raised_on_every_rank(run):
    """Rank 0's copies of steps 6 and 9 fail: every rank raises DurableSaveError at the same step (8: rank 0 learned
    it at step 7's boundary and proposed the next) and at close(); the durable tier keeps step 3 the latest."""
    world, out, results = run
    for r, res in enumerate(results):
        own = r == 0  # rank 0 raises its own error (the OSError as __cause__); the others one naming it
        assert res["durable_failed_raised"] == [[8, "DurableSaveError", True, own], ["close", "DurableSaveError", True, own]]
        assert res["durable_failed_latest"] == "checkpoint_3"


def test_fsdp_local_shards_restore_from_memory_bit_exact(run):
    world, out, results = run
    for r, res in enumerate(results):
        assert res["fsdp_memory_restart"] == [4, "memory"] and res["fsdp_memory_warnings"] == []
        assert res["fsdp_memory_local_equal"] is True  # every local shard and optimizer state, as saved
        assert res["fsdp_memory_equal"] is True  # trained on: the one-process reference, bit for bit
        assert res["fsdp_memory_files"] == sorted(["fastckpt.json", "optimizer.json", "scheduler.json",
                                                   f"model.local_rank{r}.safetensors",
                                                   f"optimizer.local_rank{r}.safetensors",
                                                   f"random_states_{r}.safetensors"])
        assert res["fsdp_memory_durable_sharded"] is True  # the durable tier: a normal sharded checkpoint


def test_fsdp_damaged_memory_shard_falls_back_to_the_durable_tier(run):
    world, out, results = run
    assert [res["fsdp_damaged_restart"] for res in results] == [[4, "local"]] * world
    warned = results[0]["fsdp_damaged_warnings"]
    assert len(warned) == 1 and warned[0].startswith("TierSkippedWarning") and "memory tier" in warned[0]
    assert "mem0" in warned[0] and "IntegrityError" in warned[0]
    assert all(res["fsdp_damaged_warnings"] == [] for res in results[1:])
    assert all(res["fsdp_damaged_local_equal"] is True and res["fsdp_damaged_equal"] is True for res in results)


def test_fsdp_lost_node_restores_its_local_shards_from_a_peer_replica(run):
    world, out, results = run
    assert [res["fsdp_lost_restart"] for res in results] == [[4, "peer" if r == 1 else "memory"]
                                                              for r in range(world)]
    assert all(res["fsdp_lost_warnings"] == [] for res in results)
    assert all(res["fsdp_lost_local_equal"] is True and res["fsdp_lost_equal"] is True for res in results)


def test_fsdp_recreated_project_skips_the_old_runs_local_shards(run):
    """The project folder deleted and made again at the same path: the old run's local-shards snapshots in each
    rank's memory tier belong to another incarnation; every rank skips its own with a warning naming both ids and
    the run starts over, bit-exact against the reference (it restored step 4 of the deleted run)."""
    world, out, results = run
    assert [res["fsdp_reborn_restart"] for res in results] == [[0, None]] * world
    for res in results:
        warned = res["fsdp_reborn_warnings"]
        assert len(warned) == 1 and warned[0].startswith("TierSkippedWarning"), warned
        assert "earlier incarnation of the project" in warned[0] and "this one is" in warned[0]
        assert res["fsdp_reborn_equal"] is True


def test_a_full_memory_tier_on_any_rank_loses_no_step(run):
    """ENOSPC writing the memory snapshot: the last rank's at step 3, rank 0's at step 6 (which rank 0 then writes
    durably in step()); no rank raises or hangs, nothing half-written stays, the restart restores step 6 and ends
    bit-exact against the uninterrupted run."""
    world, out, results = run
    for r, res in enumerate(results):
        warned = res["memory_full_warned"]
        if r in (0, world - 1):
            step = 6 if r == 0 else 3
            assert len(warned) == 1 and f"mem{r} has no room for step {step}" in warned[0], warned
            assert ("written to the durable tier" in warned[0]) == (r == 0), warned[0]
        else:
            assert warned == []
        assert all(name.startswith("checkpoint_") for name in res["memory_full_leftovers"]), res
        assert res["memory_full_restart"] == [6, "local" if r == 0 else "memory"]
        assert res["memory_full_equal"] is True

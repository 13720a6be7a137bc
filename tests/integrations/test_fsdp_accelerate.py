"""``fastckpt.accelerate`` under FSDP2 and the engines it leaves to accelerate.

Two processes (torchrun, gloo, CPU; tests/helpers/mp_fsdp_accelerate_worker.py, one launch) run accelerate's FSDP2
code path: SHARDED_STATE_DICT and FULL_STATE_DICT saves load back bit-exact with ``accelerator.step``; the diffusers
pattern (a DDP save on the main process only) writes the main process's files and loads on both processes; an FSDP2
save on the main process only is refused at once. In this process: DeepSpeed, Megatron-LM,
XLA and FSDP1 raise NotImplementedError saying what to use instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

import fastckpt.accelerate

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "mp_fsdp_accelerate_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_acc")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=300)
    files = [out / f"acc_rank{r}.json" for r in (0, 1)]
    assert proc.returncode == 0 and all(f.is_file() for f in files), proc.stdout[-3000:] + proc.stderr[-6000:]
    res = [json.loads(f.read_text()) for f in files]
    failed = {f"rank {r}: {k}": v for r, d in enumerate(res) for k, v in d.items()
              if k.startswith("scenario_") and v is not None}
    assert not failed, failed
    return out, res


def test_diffusers_pattern_main_process_saves_alone_and_loads_on_two(results):
    out, (r0, r1) = results
    assert r0["diffusers_save"] == {"error": None, "message": ""}  # timeout=60: no CollectiveTimeoutError
    assert "diffusers_save" not in r1
    assert sorted(p.name for p in (out / "diffusers").iterdir()) == [
        "fastckpt.json", "model.safetensors", "optimizer.safetensors", "random_states_0.safetensors",
        "scheduler.json"]
    assert json.loads((out / "diffusers" / "fastckpt.json").read_text())["processes"] == 1
    assert r0["diffusers_group_usable"] is True and r1["diffusers_group_usable"] is True
    for r in (r0, r1):  # the replicated model, optimizer and scheduler exactly as saved, on both processes
        assert r["diffusers_loaded"] is True
    assert r0["diffusers_warnings"] == []
    assert len(r1["diffusers_warnings"]) == 1
    assert r1["diffusers_warnings"][0].startswith("RngRestoreWarning: ")
    assert "holds no random_states_1.safetensors" in r1["diffusers_warnings"][0]
    assert "process 1 keeps its RNG states" in r1["diffusers_warnings"][0]
    assert r0["diffusers_draws_after_load"] == r0["diffusers_draws_at_save"]  # the main process's RNG restored
    assert r1["diffusers_draws_after_load"] == r1["diffusers_kept_draws"]  # rank 1's streams untouched
    assert r0["diffusers_draws_at_save"] != r0["diffusers_kept_draws"]


def test_save_on_every_process_is_still_one_commit_of_both(results):
    out, (r0, r1) = results
    assert r0["diffusers_all_path"] == r1["diffusers_all_path"] == str(out / "diffusers_all")
    names = {p.name for p in (out / "diffusers_all").iterdir()}
    assert {"random_states_0.safetensors", "random_states_1.safetensors"} <= names
    assert json.loads((out / "diffusers_all" / "fastckpt.json").read_text())["processes"] == 2


def test_a_rank_calling_a_save_the_main_process_made_alone_is_never_paired_with_another_save(results):
    out, (r0, r1) = results
    assert r0["late_main"] == {"error": None, "message": ""}
    assert r1["late_other"]["error"] == "CheckpointError"  # process 0 is already in its next save (after_late)
    assert (f"save_state to {out / 'late'}: process 1 called it while process 0 is in save_state to "
            f"{out / 'after_late'}") in r1["late_other"]["message"]
    assert not (out / "late" / "random_states_1.safetensors").exists()
    # the next save on both processes pairs up again (the rounds stay in step)
    assert r0["after_late_saved"] == r1["after_late_saved"] == str(out / "after_late")
    assert {"random_states_0.safetensors", "random_states_1.safetensors"} <= {
        p.name for p in (out / "after_late").iterdir()}


def test_sharded_model_saved_on_the_main_process_only_is_refused_at_once(results):
    _, (r0, r1) = results
    assert r0["sharded_main_only"]["error"] == "CheckpointError"  # timeout=300 was not waited out
    message = r0["sharded_main_only"]["message"]
    assert "called on the main process only, but the model is sharded (FSDP2 SHARDED_STATE_DICT)" in message
    assert "every process must call fastckpt.accelerate.save_state" in message
    assert "sharded_main_only" not in r1
    assert r0["sharded_main_only_nothing_written"] is True and r1["sharded_main_only_nothing_written"] is True
    assert r0["sharded_then_saved"] is True and r1["sharded_then_saved"] is True


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_fsdp2_round_trip(results, kind):
    out, res = results
    for rank, r in enumerate(res):
        assert r[f"{kind}_distributed_type"] == "DistributedType.FSDP" and r[f"{kind}_is_dtensor"] == "DTensor"
        assert r[f"{kind}_loaded"] is True, (rank, r[f"{kind}_loaded"])
        assert r[f"{kind}_sched"] is True and r[f"{kind}_step"] == 2 and r[f"{kind}_result"] == [[], []]
    manifest = json.loads((out / kind / "fastckpt.json").read_text())
    names = {p.name for p in (out / kind).iterdir()}
    assert {"random_states_0.safetensors", "random_states_1.safetensors", "scheduler.json"} <= names
    if kind == "sharded":
        assert manifest["sharded"]["storage"] == "fastckpt.dcp" and {"model", "optimizer", "optimizer.json"} <= names
    else:  # gathered to the main process: the usual single-file layout
        assert "sharded" not in manifest and {"model.safetensors", "optimizer.safetensors"} <= names
        assert res[0]["full_model_file"] is True


def test_fsdp2_automatic_naming_numbers_and_rotates_model_only_snapshots_apart(results):
    _, res = results
    for r in res:  # every process counts the same; the two model-only snapshots left iteration alone
        assert r["auto_iteration_after_snapshots"] == 1
        assert r["auto_names"] == ["checkpoints/checkpoint_0", "model_only/checkpoint_0", "model_only/checkpoint_1",
                                   "checkpoints/checkpoint_1"]
        assert r["auto_left"] == ["checkpoints/checkpoint_1", "model_only/checkpoint_1"]


@pytest.mark.parametrize("kind, hint", [(DistributedType.DEEPSPEED, "DeepSpeed"),
                                        (DistributedType.MEGATRON_LM, "Megatron-LM"),
                                        (DistributedType.XLA, "XLA")])
def test_other_engines_say_what_to_use(tmp_path, kind, hint):
    acc = SimpleNamespace(distributed_type=kind)
    for call in (fastckpt.accelerate.save_state, fastckpt.accelerate.load_state):
        with pytest.raises(NotImplementedError, match=f"{hint}.*use accelerator.save_state / load_state"):
            call(acc, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_fsdp1_says_what_to_use(tmp_path):
    acc = SimpleNamespace(distributed_type=DistributedType.FSDP,
                          state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=1)))
    with pytest.raises(NotImplementedError, match="FSDP2 only.*fsdp_version=2.*accelerator.save_state"):
        fastckpt.accelerate.save_state(acc, tmp_path / "ckpt")

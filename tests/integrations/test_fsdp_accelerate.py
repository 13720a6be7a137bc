"""``fastckpt.accelerate`` under FSDP2 and the engines it leaves to accelerate.

Two processes (torchrun, gloo, CPU; tests/helpers/mp_fsdp_accelerate_worker.py, one launch) run accelerate's FSDP2
code path: SHARDED_STATE_DICT and FULL_STATE_DICT saves load back bit-exact with ``accelerator.step``; a save called
on the main process only raises CollectiveTimeoutError instead of hanging. In this process: DeepSpeed, Megatron-LM,
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
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=300)
    files = [out / f"acc_rank{r}.json" for r in (0, 1)]
    assert proc.returncode == 0 and all(f.is_file() for f in files), proc.stdout[-3000:] + proc.stderr[-6000:]
    res = [json.loads(f.read_text()) for f in files]
    failed = {f"rank {r}: {k}": v for r, d in enumerate(res) for k, v in d.items()
              if k.startswith("scenario_") and v is not None}
    assert not failed, failed
    return out, res


def test_save_on_main_process_only_raises_instead_of_hanging(results):
    _, (r0, r1) = results
    assert r0["main_only"]["error"] == "CollectiveTimeoutError"
    assert "waited 2 s at step 'arrive' for process(es) [1]" in r0["main_only"]["message"]
    assert r1["main_only"]["error"] == "CollectiveTimeoutError"
    assert "given up before this process arrived" in r1["main_only"]["message"]
    assert all(r["main_only_nothing_written"] is True and r["main_only_then_saved"] is True for r in (r0, r1))


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

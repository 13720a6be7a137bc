"""Two real processes (``torchrun --nproc-per-node 2``, gloo, CPU) save and load through fastckpt.accelerate and
stock accelerate: the main process writes the shared files and every rank's RNG file in one commit, every rank
restores its own RNG streams, a failure on one rank stops every rank before anything changes, and a failed save on
the main process raises on every rank. The scenarios run in tests/helpers/mp_accelerate_worker.py (one launch, ~20 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from helpers.s3_server import BUCKET, client, keys

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "mp_accelerate_worker.py"
S3_URL = f"s3://{BUCKET}/mp-accelerate-{uuid.uuid4().hex[:6]}"  # scenario H's project on the session's moto server


@pytest.fixture(scope="module")
def run(tmp_path_factory, s3_endpoint):
    out = tmp_path_factory.mktemp("mp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PYTHONWARNINGS="error", FASTCKPT_TEST_S3_URL=S3_URL)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)
               if (out / f"rank{r}.json").is_file()]
    assert proc.returncode == 0 and len(results) == 2, proc.stdout[-3000:] + proc.stderr[-6000:]
    crashes = [f"rank {r}:\n{res['crash']}" for r, res in enumerate(results) if "crash" in res]
    assert not crashes, "\n".join(crashes)
    return out, results


def test_two_processes_with_gloo(run):
    out, results = run
    assert [r["distributed_type"] for r in results] == ["DistributedType.MULTI_CPU"] * 2


def test_save_and_load_every_rank(run):
    out, results = run
    for rank, res in enumerate(results):
        assert res["A_paths"] == [str(out / "proj" / "checkpoints" / f"checkpoint_{n}") for n in range(3)], rank
        assert res["A_state_equal"] is True and res["A_draws_equal"] is True, rank
        assert res["A_step"] == 3 and res["A_iteration"] == 3, rank
    names = sorted(p.name for p in (out / "proj" / "checkpoints").iterdir())
    assert names == ["checkpoint_1", "checkpoint_2"]  # total_limit=2
    latest = out / "proj" / "checkpoints" / "checkpoint_2"
    assert sorted(p.name for p in latest.iterdir()) == [
        "fastckpt.json", "model.safetensors", "optimizer.safetensors", "random_states_0.safetensors",
        "random_states_1.safetensors", "scheduler.json",
    ]
    rng0 = st.load_file(latest / "random_states_0.safetensors")
    rng1 = st.load_file(latest / "random_states_1.safetensors")
    assert not torch.equal(rng0["torch"], rng1["torch"])  # each rank's own streams (seeded 100 + rank)
    torch.manual_seed(101)
    assert torch.equal(rng1["torch"], torch.get_rng_state())
    assert json.loads((latest / "fastckpt.json").read_text())["processes"] == 2
    assert not any(p.name.startswith(".") for p in (out / "proj" / "checkpoints").iterdir())  # no staging left
    assert list(st.load_file(latest / "model.safetensors")) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_compat_save_restored_by_stock_accelerate_in_two_processes(run):
    out, results = run
    assert all(r["B_state_equal"] is True and r["B_draws_equal"] is True for r in results)
    assert sorted(p.name for p in (out / "compat").iterdir()) == [
        "fastckpt.json", "model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl",
        "scheduler.bin",
    ]
    # the same model file accelerate writes under DDP (accelerator._models holds the bare module on CPU)
    assert (out / "compat" / "model.safetensors").read_bytes() == (out / "compat_stock" / "model.safetensors").read_bytes()


def test_stock_two_process_output_loaded_by_fastckpt(run):
    out, results = run
    assert all(r["C_state_equal"] is True and r["C_draws_equal"] is True and r["C_step"] == 4 for r in results)
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in (out / "stock").iterdir()}


def test_one_rank_failing_stops_every_rank_before_any_change(run):
    out, (r0, r1) = run
    assert r1["D_error"] == "HeaderError" and "random_states_1.pkl" in r1["D_message"]
    assert r0["D_error"] == "CheckpointError" and "failed on process 1: HeaderError" in r0["D_message"]
    assert r0["D_unchanged"] is True and r1["D_unchanged"] is True


def test_failed_save_raises_on_every_rank(run):
    out, (r0, r1) = run
    assert r0["E_error"] == "NotADirectoryError" and r1["E_error"] == "CheckpointError"
    assert r0["E_group_usable"] is True and r1["E_group_usable"] is True


def test_async_save_completes_on_every_rank_after_the_one_commit(run):
    out, results = run
    assert [r["F_handle"] for r in results] == ["AsyncSave", "AsyncSave"]
    assert [r["F_path"] for r in results] == [str(out / "async")] * 2
    assert all(r["F_state_equal"] is True for r in results)
    assert results[0]["F_error"] in ("FileExistsError", "NotADirectoryError") and results[1]["F_error"] == "CheckpointError"
    assert sorted(p.name for p in (out / "async").iterdir()) == [
        "fastckpt.json", "model.safetensors", "optimizer.safetensors", "random_states_0.safetensors",
        "random_states_1.safetensors"]


def test_a_resumed_shuffled_dataloader_continues_the_uninterrupted_order(run):
    out, results = run
    for rank, res in enumerate(results):
        assert res["G_epoch1"] != res["G_epoch0"], rank  # a replay of epoch 0 would be caught
        assert res["G_resumed_epoch1"] == res["G_epoch1"], rank
        assert res["G_weights_equal"] is True and res["G_resumed_draws"] == res["G_draws"], rank
        assert any("dl_generator.json" in w and "accelerate#3158" in w for w in res["G_compat_warnings"]), rank
    assert results[0]["G_epoch1"] != results[1]["G_epoch1"]  # each rank its own shard of the order


def test_two_process_checkpoint_resumed_by_one_process_warns_of_what_it_cannot_restore(run, new_accelerator):
    import warnings

    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import fastckpt.accelerate

    out, results = run
    acc = new_accelerator()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    dl = DataLoader(TensorDataset(torch.arange(32.0).unsqueeze(1).repeat(1, 4)), batch_size=4, shuffle=True)
    model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fastckpt.accelerate.load_state(acc, out / "shuffle")
    messages = [str(w.message) for w in caught if issubclass(w.category, fastckpt.RngRestoreWarning)]
    assert len(messages) == 1 and "random_states_1.safetensors" in messages[0], messages
    assert "saved by 2 processes, resumed by 1" in messages[0]
    import random

    import numpy as np

    assert [random.random(), float(np.random.rand()), torch.rand(2).tolist()] == results[0]["G_draws"]


def test_plain_load_state_of_a_two_process_checkpoint_warns_of_rank_1(run):
    import warnings

    from torch import nn

    import fastckpt

    out, _ = run
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fastckpt.load_state(model, opt, input_dir=out / "shuffle")
    messages = [str(w.message) for w in caught if issubclass(w.category, fastckpt.RngRestoreWarning)]
    assert len(messages) == 1 and "random_states_1.safetensors" in messages[0], messages


def test_s3_project_save_holds_every_rank_rng_in_one_commit_and_every_rank_resumes(run):
    out, results = run
    for rank, res in enumerate(results):
        assert res["H_urls"] == [f"{S3_URL}/checkpoints/checkpoint_{n}" for n in range(3)], rank
        assert res["H_state_equal"] is True and res["H_draws_equal"] is True, rank
        assert res["H_step"] == 3 and res["H_iteration"] == 3, rank
    prefix = S3_URL.split(f"s3://{BUCKET}/", 1)[1] + "/checkpoints/"
    found = keys(prefix)
    assert sorted({k[len(prefix):].split("/", 1)[0] for k in found}) == ["checkpoint_1", "checkpoint_2"]
    latest = [k for k in found if k.startswith(prefix + "checkpoint_2/")]
    saves = {k.split("/")[-2] for k in latest if "/save-" in k}
    assert len(saves) == 1  # one commit
    names = sorted(k.rsplit("/", 1)[1] for k in latest if "/save-" in k)
    assert names == ["model.safetensors", "optimizer.safetensors", "random_states_0.safetensors",
                     "random_states_1.safetensors", "scheduler.json"]
    save = f"{prefix}checkpoint_2/{saves.pop()}"
    rng = [st.load(client().get_object(Bucket=BUCKET, Key=f"{save}/random_states_{r}.safetensors")["Body"].read())
           for r in (0, 1)]
    torch.manual_seed(101)
    assert torch.equal(rng[1]["torch"], torch.get_rng_state()) and not torch.equal(rng[0]["torch"], rng[1]["torch"])

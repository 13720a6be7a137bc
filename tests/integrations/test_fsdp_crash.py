"""A rank SIGKILLed in the middle of a sharded (FSDP2) re-save: the previous checkpoint stays loadable and exact, the
surviving rank raises a CheckpointError subclass within the timeout and exits, and no staging folder is left.
Two plain processes on gloo (tests/helpers/mp_fsdp_crash.py), started here rather than by torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.fsdp_models import build, full_state, optimizer_for, reference, same

import fastckpt
from fastckpt._io.storage.local.staging import leftovers

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "mp_fsdp_crash.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_crash")
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        results.append((p.returncode, err))
    return out, results


def test_killed_rank_and_surviving_rank_exit(crashed):
    out, ((rc0, err0), (rc1, err1)) = crashed
    assert rc1 == -9, err1[-3000:]
    assert rc0 == 3, err0[-3000:]
    report = json.loads((out / "crash_rank0.json").read_text())
    assert report["checkpoint_error"] is True, report
    assert report["error"] in ("CollectiveTimeoutError", "CheckpointError"), report
    assert str(out / "ckpt") in report["message"]


def test_previous_checkpoint_stays_exact(crashed):
    out, _ = crashed
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build("tiny", 5)
        opt, sched = optimizer_for(model)
        with pytest.warns(fastckpt.RngRestoreWarning, match=r"random_states_1\.safetensors"):
            fastckpt.load_state(model, opt, sched, input_dir=out / "ckpt", verify=True)
        ref_model, ref_opt, ref_sched = reference("tiny", 1)
        assert same(full_state(model, opt), full_state(ref_model, ref_opt))
        assert sched.state_dict() == ref_sched.state_dict()
        assert json.loads((out / "ckpt" / "fastckpt.json").read_text())["step"] == 1
    finally:
        torch.set_num_threads(threads)


def test_no_staging_folder_left(crashed):
    out, _ = crashed
    assert leftovers(out) == {}
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []

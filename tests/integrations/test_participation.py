"""Who takes part in a ``fastckpt.accelerate.save_state`` (:mod:`fastckpt._io.group.participation`) with three real
processes (torchrun, gloo, CPU; one launch of tests/helpers/mp_participation_worker.py): a rank that comes after
rank 0 decided the round still joins the one commit; rank 0 alone saves alone; all three commit together. The
two-process cases (the diffusers pattern, the FSDP2 refusal) are in test_fsdp_accelerate.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "mp_participation_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("participation")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=300)
    files = [out / f"rank{r}.json" for r in range(3)]
    assert proc.returncode == 0 and all(f.is_file() for f in files), proc.stdout[-3000:] + proc.stderr[-6000:]
    res = [json.loads(f.read_text()) for f in files]
    assert all(r["crash"] is None for r in res), [r["crash"] for r in res]
    return out, res


def rng_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("random_states_"))


def test_a_rank_after_the_decision_still_joins_the_commit(results):
    out, res = results
    assert res[2]["late_join_decision"] == "all"  # rank 1 had joined: the round is everyone's
    assert [r["late_join"] for r in res] == [str(out / "late_join")] * 3
    assert rng_files(out / "late_join") == [f"random_states_{r}.safetensors" for r in range(3)]
    assert json.loads((out / "late_join" / "fastckpt.json").read_text())["processes"] == 3


def test_main_process_alone_among_three(results):
    out, res = results
    assert res[0]["main_only"] == str(out / "main_only") and "main_only" not in res[1]
    assert rng_files(out / "main_only") == ["random_states_0.safetensors"]


def test_all_three_together(results):
    out, res = results
    assert [r["all"] for r in res] == [str(out / "all")] * 3
    assert rng_files(out / "all") == [f"random_states_{r}.safetensors" for r in range(3)]

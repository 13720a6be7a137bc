"""``fastckpt.transformers.Trainer`` in two real processes (``torchrun --nproc-per-node 2``, gloo, CPU, DDP): a run
stopped after step 4 and resumed, a stock Trainer checkpoint resumed, and an async run each log the same losses and
end with bit-identical weights as the uninterrupted two-process run. All scenarios run in one launch of
tests/helpers/mp_trainer_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "mp_trainer_worker.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mp_trainer")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=600)
    files = [out / f"rank{r}.json" for r in (0, 1)]
    assert proc.returncode == 0 and all(f.is_file() for f in files), proc.stdout[-3000:] + proc.stderr[-6000:]
    results = [json.loads(f.read_text()) for f in files]
    failed = {f"rank {r}: {k}": v for r, d in enumerate(results) for k, v in d.items()
              if k.startswith("scenario_") and v is not None}
    assert not failed, failed
    return out, results


def final(out: Path, name: str, rank: int) -> dict[str, torch.Tensor]:
    return st.load_file(out / f"{name}_rank{rank}.safetensors")


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_processes(run):
    _, results = run
    assert all(r["full_world"] == 2 and r["resumed_world"] == 2 for r in results)


@pytest.mark.parametrize("name", ["resumed", "stock"])
def test_resume_after_step_4_is_exact_on_both_processes(run, name):
    out, results = run
    for rank, r in enumerate(results):
        assert [s for s, *_ in r[f"{name}_losses"]] == [5, 6, 7, 8, 9, 10]
        assert r[f"{name}_losses"] == [e for e in r["full_losses"] if e[0] > 4], rank
        assert equal(final(out, name, rank), final(out, "full", rank)), rank
    assert equal(final(out, "full", 0), final(out, "full", 1))  # DDP: one replicated model


def test_every_process_rng_state_is_in_the_one_commit(run):
    out, _ = run
    folder = out / "full" / "checkpoint-4"
    names = {p.name for p in folder.iterdir()}
    assert {"random_states_0.safetensors", "random_states_1.safetensors", "trainer_state.json"} <= names
    assert not {n for n in names if n.endswith((".pt", ".pth", ".bin"))}
    assert json.loads((folder / "fastckpt.json").read_text())["processes"] == 2
    rng0 = st.load_file(folder / "random_states_0.safetensors")
    rng1 = st.load_file(folder / "random_states_1.safetensors")
    assert not torch.equal(rng0["torch"], rng1["torch"])  # each rank's own dropout stream (seeded 1000 + rank)
    assert sorted(p.name for p in (out / "full").iterdir()) == ["checkpoint-10", "checkpoint-4", "checkpoint-8"]


def test_stock_two_process_checkpoint_files(run):
    _, results = run
    assert {"optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"} <= set(results[0]["stock_files"])


def test_async_run_is_the_same_run(run):
    out, results = run
    for rank, r in enumerate(results):
        assert r["async_losses"] == r["full_losses"]
        assert equal(final(out, "async", rank), final(out, "full", rank))
    for n in (4, 8, 10):
        a, b = out / "async" / f"checkpoint-{n}", out / "full" / f"checkpoint-{n}"
        assert (a / "fastckpt.json").is_file()
        assert equal(st.load_file(a / "model.safetensors"), st.load_file(b / "model.safetensors"))
        assert equal(st.load_file(a / "optimizer.safetensors"), st.load_file(b / "optimizer.safetensors"))


def test_a_signal_on_one_process_saves_the_same_step_on_both(run):
    """Rank 1 alone got SIGUSR1 during step 5: both agreed on step 6 (through the store), saved checkpoint-6 with
    both RNG files, exited with Preempted(0); the resume from it is exact on both ranks."""
    import signal

    out, results = run
    for rank, r in enumerate(results):
        assert r["preempted_step"] == [6, 0, int(signal.SIGUSR1) if rank == 1 else int(signal.SIGTERM)], rank
        assert r["preempted_files"] == ["checkpoint-4", "checkpoint-6"]
        assert r["preempted_losses"] == [e for e in r["full_losses"] if e[0] > 6], rank
        assert equal(final(out, "preempted", rank), final(out, "full", rank)), rank
    names = {p.name for p in (out / "preempted" / "checkpoint-6").iterdir()}
    assert {"random_states_0.safetensors", "random_states_1.safetensors", "fastckpt.json"} <= names

"""``fastckpt.accelerate.checkpoint_manager``: the CheckpointManager over an Accelerator's prepared model,
optimizer and scheduler and its ``register_for_checkpointing`` objects (tests/helpers/accelerate_manager_loop.py,
recovery_loop's loop through ``accelerator.prepare``, in child processes that wait on stdin after each step, so a
signal lands at a known step without sleeps). A SIGTERM after step 4 saves step 5 durably and exits 0; a SIGKILL at
step 8 leaves the due save of step 6 in the memory tier; each restart restores from the memory tier and the run
ends bit for bit as an uninterrupted one (weights, optimizer state, LR, data order, counter, the next RNG draws).
In process: what the manager gets from the Accelerator, and the refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.handshake import until  # noqa: E402
from safetensors.torch import load_file

import fastckpt
import fastckpt.accelerate

accelerate = pytest.importorskip("accelerate")

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="error",
           PYTHONPATH=os.pathsep.join([str(HELPERS), str(HELPERS.parent), os.environ.get("PYTHONPATH", "")]))
TOTAL, EVERY = 12, 3


def start(project: Path, memory: Path, wait: bool = True) -> subprocess.Popen:
    args = [sys.executable, str(HELPERS / "accelerate_manager_loop.py"), str(project), str(memory), str(TOTAL),
            str(EVERY)] + (["--wait"] if wait else [])
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)


def finish(proc: subprocess.Popen) -> list[str]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return out.split("\n")


def test_sigterm_and_sigkill_resume_bit_exactly(tmp_path):
    full = start(tmp_path / "full", tmp_path / "full_mem", wait=False)  # the uninterrupted run, alongside
    project, memory = tmp_path / "proj", tmp_path / "mem"
    proc = start(project, memory)
    until(proc, "restored 0 None")
    until(proc, "step 4")
    proc.send_signal(signal.SIGTERM)  # while the child waits after step 4: recorded, acted on at step 5
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert "preempted 5" in finish(proc)
    fastckpt.verify_checkpoint(project / "checkpoints" / "checkpoint_5")
    proc = start(project, memory)
    until(proc, "restored 5 memory")
    until(proc, "step 8")
    proc.kill()  # SIGKILL after step 8: the due save of step 6 is committed in the memory tier
    proc.communicate(timeout=60)
    lines = finish(start(project, memory, wait=False))
    assert lines[0] == "restored 6 memory" and "done" in lines
    assert "done" in finish(full)
    got, want = load_file(project / "final.safetensors"), load_file(tmp_path / "full" / "final.safetensors")
    assert got.keys() == want.keys() and any(k.startswith("opt.") for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_the_manager_gets_the_accelerators_objects(tmp_path):
    from accelerate.utils import ProjectConfiguration

    acc = accelerate.Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path)))
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    with fastckpt.accelerate.checkpoint_manager(acc, memory=False, every_n_steps=1) as mgr:
        assert mgr.project == tmp_path.absolute() and mgr.models == [model]
        assert mgr.optimizers == [opt] and mgr.schedulers == [sched] and [r.obj for r in mgr.objects] == [counter]
        counter.n = 7
        mgr.step(1)
    folder = tmp_path / "checkpoints" / "checkpoint_1"
    assert (folder / "custom_checkpoint_0.safetensors").is_file()
    counter.n = 0
    with fastckpt.accelerate.checkpoint_manager(acc, memory=False) as again:
        assert again.restore() == 1 and counter.n == 7


def test_refusals(tmp_path):
    acc = accelerate.Accelerator(cpu=True)
    with pytest.raises(ValueError, match="project_dir"):
        fastckpt.accelerate.checkpoint_manager(acc)
    with pytest.raises(TypeError, match="no prepared model"):
        fastckpt.accelerate.checkpoint_manager(acc, tmp_path)

"""CheckpointManager runs in a child process killed from outside at random steps (chosen by a seeded RNG; the
child waits on stdin after each step, so the kill lands at a known step without sleeps): SIGKILL leaves the newest
due save in the memory tier and the restart restores it from RAM; SIGTERM saves the step reached durably and exits
0; both resumes equal the uninterrupted run bit for bit (tests/helpers/recovery_loop.py)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import torch
from helpers.handshake import until  # noqa: E402
from helpers.recovery_loop import reference
from safetensors.torch import load_file

import fastckpt

LOOP = Path(__file__).resolve().parents[1] / "helpers" / "recovery_loop.py"
TOTAL, EVERY = 12, 3
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="error")


def start(project: Path, memory: Path, wait: bool = True) -> subprocess.Popen:
    args = [sys.executable, str(LOOP), str(project), str(memory), str(TOTAL), str(EVERY)] + (["--wait"] if wait else [])
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)


def finish(proc: subprocess.Popen) -> list[str]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return out.split("\n")


def check_final(project: Path) -> None:
    got, want = load_file(project / "final.safetensors"), reference(TOTAL)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_sigkill_at_random_steps_restarts_from_the_memory_tier(tmp_path):
    rng = random.Random(25)
    project, memory = tmp_path / "proj", tmp_path / "mem"
    kills = sorted(rng.sample(range(EVERY, TOTAL), 2))  # two SIGKILLs in one run of the job, after a due save
    reached = 0
    for k in kills:
        proc = start(project, memory)
        assert until(proc, f"restored {reached} {'memory' if reached else None}")[-1].startswith("restored")
        until(proc, f"step {k}")
        proc.kill()  # SIGKILL while the child waits after step k: every due save up to k is committed in memory
        proc.communicate(timeout=60)
        reached = k - k % EVERY
        mem = fastckpt.latest_checkpoint(memory)
        assert mem is not None and mem.name == f"checkpoint_{reached}"
    proc = start(project, memory, wait=False)
    lines = finish(proc)
    assert lines[0] == f"restored {reached} memory" and "done" in lines
    check_final(project)


def test_external_sigterm_at_a_random_step_saves_it_and_exits_zero(tmp_path):
    k = random.Random(7).randrange(1, TOTAL)
    project, memory = tmp_path / "proj", tmp_path / "mem"
    proc = start(project, memory)
    until(proc, f"step {k}")
    proc.send_signal(signal.SIGTERM)  # recorded by the handler; acted on at the next step boundary
    proc.stdin.write("go\n")
    proc.stdin.flush()
    lines = finish(proc)
    assert f"preempted {k + 1}" in lines
    fastckpt.verify_checkpoint(project / "checkpoints" / f"checkpoint_{k + 1}")
    lines = finish(start(project, memory, wait=False))
    assert lines[0] == f"restored {k + 1} memory"
    check_final(project)

"""Preemption saves of ``fastckpt.transformers.Trainer`` (tests/helpers/trainer_preempt.py, the tiny GPT-2 of
tests/helpers/trainer_runs.py, ``save_steps=4``, 10 steps): a SIGTERM sent to a child process at step 6 (the child
waits on stdin after each ``on_step_end``, so the signal lands at a known step without sleeps) leaves
``checkpoint-4`` and ``checkpoint-6`` and nothing later, the child exits 0, and ``resume_from_checkpoint=True`` in
a second child continues bit for bit as an uninterrupted run (losses after step 6, final weights, optimizer
state). In process: ``request_preemption`` from a callback, SIGUSR1, the handlers put back after ``train()``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.handshake import until  # noqa: E402
from helpers.trainer_runs import run
from safetensors.torch import load_file
from transformers import TrainerCallback

import fastckpt
from fastckpt.manager.preemption import release_kept
from fastckpt.transformers import folders

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HELPERS.parent) + os.pathsep +
           os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")


def child(out: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HELPERS / "trainer_preempt.py"), str(out), *flags],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def finish(proc: subprocess.Popen, code: int = 0) -> list[str]:
    out, err = proc.communicate("go\n" * 20, timeout=120)
    assert proc.returncode == code, err[-3000:]
    return out.split("\n")


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(folders.PREFIX))


def test_sigterm_saves_the_step_reached_and_the_resume_is_exact(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    reference = child(full)  # uninterrupted, in a child too: the same process setup as the resumed run
    proc = child(part, "--wait")
    until(proc, "step 6")
    proc.send_signal(signal.SIGTERM)  # recorded; step 6 is saved at its step boundary
    lines = finish(proc)
    assert "preempted 6 0" in lines and "step 7" not in lines
    assert checkpoints(part) == ["checkpoint-4", "checkpoint-6"]  # save_steps=4, then the preemption save only
    folder = part / "checkpoint-6"
    fastckpt.verify_checkpoint(folder)
    assert '"global_step": 6' in (folder / "trainer_state.json").read_text()
    assert "done" in finish(child(part, "--resume"))
    assert "done" in finish(reference)
    assert checkpoints(part) == ["checkpoint-10", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    got, want = load_file(part / "result.safetensors"), load_file(full / "result.safetensors")
    assert got.keys() == want.keys() and len(got) > 10
    assert got["losses"][:, 0].tolist() == list(range(1, 11))  # 1-6 from checkpoint-6's trainer_state.json
    assert torch.equal(got["losses"], want["losses"])  # loss, grad norm, learning rate of every step (7-10 resumed)
    for k in want:
        if k != "losses":
            assert torch.equal(got[k], want[k]), k


class Preempt(TrainerCallback):
    """Calls ``how(trainer)`` at ``on_step_end`` of step ``step`` (the signal arrives during that step)."""

    def __init__(self, step: int, how) -> None:
        self.step, self.how, self.trainer = step, how, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.how(self.trainer)


def preempted_run(tmp_path, how, step: int = 3, **kwargs):
    cb = Preempt(step, how)
    original = run.__globals__["fastckpt"].transformers.Trainer.__init__

    def init(self, *a, **kw):  # hand the callback its trainer
        original(self, *a, **kw)
        cb.trainer = self

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastckpt.transformers.Trainer, "__init__", init)
        with pytest.raises(fastckpt.Preempted) as info:
            run("fastckpt", tmp_path, callbacks=(cb,), **kwargs)
    return info.value


@pytest.mark.parametrize("how", ["request", "sigusr1"])
def test_a_preemption_in_process_saves_that_step(tmp_path, how):
    before = signal.getsignal(signal.SIGUSR1)
    if how == "request":
        exc = preempted_run(tmp_path, lambda t: t._fastckpt_preemption.request_preemption())
    else:
        exc = preempted_run(tmp_path, lambda t: os.kill(os.getpid(), signal.SIGUSR1))
    assert exc.step == 3 and exc.code == 0 and exc.path == tmp_path / "checkpoint-3"
    assert exc.signum == (signal.SIGTERM if how == "request" else signal.SIGUSR1)
    assert checkpoints(tmp_path) == ["checkpoint-3"]
    # kept until the process exits (a second signal must not kill a preempted process), then put back
    assert signal.getsignal(signal.SIGUSR1) != before
    release_kept()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_async_save_is_committed_before_the_exit(tmp_path):
    exc = preempted_run(tmp_path, lambda t: t._fastckpt_preemption.request_preemption(), step=5,
                        trainer_kwargs={"fastckpt_async_save": True})
    assert exc.step == 5 and checkpoints(tmp_path) == ["checkpoint-4", "checkpoint-5"]
    fastckpt.verify_checkpoint(tmp_path / "checkpoint-5")


def test_no_preemption_signals(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    seen = []
    cb = Preempt(2, lambda t: seen.append(signal.getsignal(signal.SIGTERM)))
    run("fastckpt", tmp_path, callbacks=(cb,), trainer_kwargs={"fastckpt_preemption_signals": None})
    assert seen == [before]
    with pytest.raises(ValueError, match="not a signal"):
        run("fastckpt", tmp_path, trainer_kwargs={"fastckpt_preemption_signals": (signal.SIGKILL,)})

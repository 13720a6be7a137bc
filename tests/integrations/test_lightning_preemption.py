"""``fastckpt.lightning.PreemptionCheckpoint`` with the real ``pytorch_lightning.Trainer.fit`` on CPU
(tests/helpers/lightning_preempt.py: lightning_fit's TinyModule with dropout, a StatefulDataLoader, 8 batches per
epoch, 20 steps). A SIGTERM (Lightning's own handler records it; the callback reads it) or a SIGUSR1 (the
callback's handler) sent to a child process at step 11, in epoch 1 (the child waits on stdin after each
``on_train_batch_end``, so the signal lands at a known step without sleeps): ``ckpts/last.ckpt`` holds step 11,
committed (a fastckpt folder), the child exits 0 without training step 12, and a second child resuming with
``ckpt_path=`` continues bit for bit as an uninterrupted one (every later loss, final weights, optimizer and
scheduler state)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("torchdata")

import torch  # noqa: E402
from helpers.handshake import until  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import fastckpt  # noqa: E402

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "lightning_preempt.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def child(root: Path, tag: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HELPER), str(root), tag, *flags], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def finish(proc: subprocess.Popen) -> list[str]:
    out, err = proc.communicate("go\n" * 30, timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return out.split("\n")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    assert "done" in finish(child(root, "full"))
    return load_file(root / "result_full.safetensors")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_saves_the_step_reached_and_the_resume_is_exact(tmp_path, uninterrupted, signum):
    proc = child(tmp_path, "first", "--wait")
    until(proc, "step 11")
    proc.send_signal(signum)
    lines = finish(proc)
    assert "preempted 11 0" in lines and "step 12" not in lines
    last = tmp_path / "ckpts" / "last.ckpt"
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["last.ckpt"]
    fastckpt.verify_checkpoint(last)  # a committed fastckpt folder
    assert fastckpt.load(last, trust_pickle=False)["global_step"] == 11
    assert "done" in finish(child(tmp_path, "resumed", "--resume"))
    got, want = load_file(tmp_path / "result_resumed.safetensors"), uninterrupted
    assert got.keys() == want.keys() and int(got["global_step"]) == 20
    assert got["losses"][0, 0] == 11  # the resumed run trains global steps 11..19 (batch 12..20)
    assert torch.equal(got["losses"], want["losses"][11:])
    for k in want:
        if k != "losses":
            assert torch.equal(got[k], want[k]), k

"""The README's Lightning recipe, run as written: an uninterrupted run against a run killed with SIGKILL right after
a mid-epoch checkpoint and run again (it resumes from ``checkpoints/last.ckpt``); both ``final.ckpt`` must be equal
bit for bit (weights, optimizer state, ``global_step``, epoch, and the RNG states the plugin saved with them).

The block is taken from README.md (the code block starting ``# recipe: an exact mid-epoch resume with
Lightning``) and run with ``runpy`` in a fresh interpreter; the kill comes from a wrapper around
``ModelCheckpoint.on_train_batch_end`` (after the checkpoint of step ``KILL`` is committed), not from the recipe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("torchdata")

import torch  # noqa: E402

import fastckpt  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "# recipe: an exact mid-epoch resume with Lightning"

_RUN = """
import os, runpy, signal, sys, warnings
warnings.filterwarnings("ignore")
from pytorch_lightning.callbacks import ModelCheckpoint

kill = int(os.environ.get("KILL_AFTER_STEP", "0"))
real = ModelCheckpoint.on_train_batch_end


def then_kill(self, trainer, *args, **kwargs):
    real(self, trainer, *args, **kwargs)
    if trainer.global_step == kill:  # the checkpoint of this step (and last.ckpt) are committed
        os.kill(os.getpid(), signal.SIGKILL)


ModelCheckpoint.on_train_batch_end = then_kill
runpy.run_path("train.py", run_name="__main__")
"""


def recipe() -> str:
    text = README.read_text()
    start = text.index(MARK)
    return text[start:text.index("```", start)]


def run(folder: Path, kill: int = 0) -> subprocess.CompletedProcess:
    folder.mkdir(exist_ok=True)
    (folder / "train.py").write_text(recipe())
    env = {**os.environ, "KILL_AFTER_STEP": str(kill), "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_RUN)], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)


def final(folder: Path) -> dict:
    state = fastckpt.load(folder / "final.ckpt")
    return {k: state[k] for k in ("state_dict", "optimizer_states", "global_step", "epoch", "fastckpt_rng_states")}


def differences(a, b, path=""):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{path}: keys {list(a)} vs {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):  # numpy's RNG state
        same = type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
        return [] if same else [path]
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} vs {b!r}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recipe_full")
    proc = run(folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final(folder)


def test_the_recipe_is_a_readme_block_with_no_generator():
    block = recipe()
    assert "fastckpt.lightning.CheckpointIO()" in block and "torch.nn.Dropout" in block
    assert "generator" not in block.split("# torchdata's")[0]  # the loader as users write it


@pytest.mark.parametrize("kill", [5, 10])  # 8 batches per epoch: killed in epoch 0 and in epoch 1
def test_readme_recipe_killed_mid_epoch_resumes_bit_identically(tmp_path, uninterrupted, kill):
    killed = run(tmp_path, kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "final.ckpt").exists()
    assert (tmp_path / "checkpoints" / "last.ckpt").is_dir()
    assert fastckpt.load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == kill
    resumed = run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    got = final(tmp_path)
    assert got["global_step"] == 20
    assert differences(uninterrupted, got) == []

"""The README's accelerate resume recipe, run as written: an uninterrupted run against a run killed with SIGKILL right
after a mid-epoch checkpoint and run again (it resumes from ``ckpt``); the losses of every step (printed with
``repr``, so exact) and the final weights must be equal bit for bit.

The block is taken from README.md (the code block starting ``# recipe: an exact mid-epoch resume with accelerate``)
and run with ``runpy`` in a fresh interpreter; the kill comes from a wrapper around
``fastckpt.accelerate.save_state`` (after the checkpoint of step ``KILL`` is committed), not from the recipe.

Without the recipe's three settings (``use_seedable_sampler=True``, a ``generator`` on the DataLoader,
``set_epoch``) neither stock accelerate nor fastckpt resumes such a loop exactly: making the resumed epoch's iterator
draws the sampler's seed and the loader's base seed from the global RNG after it was restored.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "# recipe: an exact mid-epoch resume with accelerate"
STEPS = 16  # 2 epochs of 8 batches

_RUN = """
import os, runpy, signal, warnings
warnings.filterwarnings("ignore")
import fastckpt.accelerate

kill = int(os.environ.get("KILL_AFTER_STEP", "0"))
real = fastckpt.accelerate.save_state


def then_kill(accelerator, output_dir, **kwargs):
    path = real(accelerator, output_dir, **kwargs)
    saved = [o for o in accelerator._custom_objects if hasattr(o, "step")]
    if output_dir == "ckpt" and saved and saved[0].step == kill:  # the checkpoint of this step is committed
        os.kill(os.getpid(), signal.SIGKILL)
    return path


fastckpt.accelerate.save_state = then_kill
runpy.run_path("train.py", run_name="__main__")
"""


def recipe() -> str:
    text = README.read_text()
    start = text.index(MARK)
    return text[start:text.index("```", start)]


def run(folder: Path, kill: int = 0) -> subprocess.CompletedProcess:
    folder.mkdir(exist_ok=True)
    (folder / "train.py").write_text(recipe())
    env = {**os.environ, "KILL_AFTER_STEP": str(kill), "PYTHONWARNINGS": "ignore", "ACCELERATE_USE_CPU": "true"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_RUN)], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)


def losses(stdout: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step (\d+) loss (\S+)$", stdout, re.M)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("accelerate_recipe_full")
    proc = run(folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(proc.stdout), load_file(folder / "final" / "model.safetensors")


def test_the_recipe_is_a_readme_block_with_dropout_and_a_shuffled_loader():
    block = recipe()
    assert "torch.nn.Dropout" in block and "shuffle=True" in block
    assert "fastckpt.accelerate.load_state(accelerator" in block and "skip_first_batches" in block


@pytest.mark.parametrize("kill", [6, 12])  # 8 batches per epoch: killed in epoch 0 and in epoch 1
def test_readme_recipe_killed_mid_epoch_resumes_bit_identically(tmp_path, uninterrupted, kill):
    full_losses, full_weights = uninterrupted
    assert sorted(full_losses) == list(range(1, STEPS + 1))
    killed = run(tmp_path, kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "final").exists()
    before = losses(killed.stdout)
    assert sorted(before) == list(range(1, kill + 1))
    resumed = run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(resumed.stdout)
    assert sorted(after) == list(range(kill + 1, STEPS + 1))  # it resumed after the checkpoint, skipping nothing
    assert {**before, **after} == full_losses
    weights = load_file(tmp_path / "final" / "model.safetensors")
    assert list(weights) == list(full_weights)
    assert all(torch.equal(weights[k], full_weights[k]) for k in weights)

"""``fastckpt.lightning.CheckpointIO`` with the real ``pytorch_lightning.Trainer.fit`` on CPU.

A run stopped after step N and resumed with ``ckpt_path=`` continues bit for bit as the uninterrupted run (logged
losses, final weights, optimizer and scheduler state, ``global_step``, epoch), mid-epoch with torchdata's resumable
loader. At an epoch's end with a plain DataLoader Lightning's loops themselves do not replay the uninterrupted
run's data order exactly (the first resumed step matches, the next batches do not; the same with Lightning's own
``TorchCheckpointIO``), so there the resume is compared with the same resume through ``TorchCheckpointIO``.
Two processes (``strategy="ddp"``, gloo) run as one script launch (``lightning_fit.py``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pl = pytest.importorskip("pytorch_lightning")
pytest.importorskip("torchdata")

import torch  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.plugins.io import AsyncCheckpointIO  # noqa: E402

import fastckpt.lightning  # noqa: E402
from fastckpt.errors import UnsafePickleError  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import lightning_fit as lf  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def test_mid_epoch_resume_is_bit_identical(tmp_path):
    assert lf.resume_matches(tmp_path, 5, 20) == []  # 8 batches per epoch: stops in epoch 0, ends in epoch 2


def test_async_save_resume_is_bit_identical(tmp_path):
    assert lf.resume_matches(tmp_path, 5, 20, plugin_kwargs={"async_save": True}) == []


def test_epoch_end_resume_equals_lightnings_own_plugin(tmp_path):
    assert lf.matches_torch_io(tmp_path, 8, 20, at_epoch_end=True) == []


def test_resume_through_lightnings_async_wrapper(tmp_path):
    def wrapped():
        return AsyncCheckpointIO(fastckpt.lightning.CheckpointIO())

    full = lf.fit(20, tmp_path / "full")
    assert lf.compare(full, lf.stopped_and_resumed(tmp_path / "wrapped", 5, 20, wrapped), 5) == []


class Recording(fastckpt.lightning.CheckpointIO):
    """Keeps a deep copy of every dict Lightning hands the plugin."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.given = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.given[str(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_model_checkpoint_top_k_last_link_and_exact_dicts(tmp_path):
    plugin = Recording(async_save=True)
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="train_loss", save_top_k=2, save_last="link",
                               every_n_train_steps=2)
    lf.fit(12, tmp_path, plugin=plugin, callbacks=[callback])
    names = sorted(os.listdir(tmp_path / "ckpts"))
    kept = [n for n in names if n != "last.ckpt"]
    assert len(kept) == 2 and all((tmp_path / "ckpts" / n).is_dir() for n in kept)  # the others were removed
    assert sorted(Path(p).name for p in callback.best_k_models) == kept
    last = tmp_path / "ckpts" / "last.ckpt"
    assert last.is_symlink() and last.resolve().is_dir() and last.resolve().name in kept
    reader = fastckpt.lightning.CheckpointIO(restore_rng=False)
    for name in kept:
        given = plugin.given[str(tmp_path / "ckpts" / name)]
        assert lf.differences(given, reader.load_checkpoint(tmp_path / "ckpts" / name)) == []
    assert list(given["optimizer_states"][0]["state"]) == [0, 1, 2, 3]  # integer keys came back as integers
    assert isinstance(given["callbacks"], dict) and given["callbacks"]
    reader.remove_checkpoint(last)  # a link: only the link goes
    assert not last.exists() and all((tmp_path / "ckpts" / n).is_dir() for n in kept)
    reader.remove_checkpoint(tmp_path / "ckpts" / kept[0])
    assert not (tmp_path / "ckpts" / kept[0]).exists()


def test_save_weights_only_and_save_last_copy(tmp_path):
    plugin = Recording()
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_weights_only=True, save_last=True,
                               every_n_train_steps=3)
    trainer, model = lf.fit(6, tmp_path, plugin=plugin, callbacks=[callback])
    last = tmp_path / "ckpts" / "last.ckpt"
    assert last.is_dir() and not last.is_symlink()
    loaded = fastckpt.lightning.CheckpointIO(restore_rng=False).load_checkpoint(last)
    assert "optimizer_states" not in loaded
    assert lf.differences(plugin.given[str(last)], loaded) == []
    for k, v in model.state_dict().items():
        assert torch.equal(loaded["state_dict"][k], v)


class Activation:
    def __eq__(self, other):
        return isinstance(other, Activation)


def test_pickle_part_needs_trust_and_weights_only_refuses_it(tmp_path):
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"act": Activation()}, "epoch": 0}
    with pytest.raises(TypeError, match=r"checkpoint\.hyper_parameters\.act"):
        fastckpt.lightning.CheckpointIO().save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    trusting = fastckpt.lightning.CheckpointIO(trust_pickle=True, restore_rng=False)
    trusting.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert trusting.load_checkpoint(tmp_path / "a.ckpt")["hyper_parameters"]["act"] == Activation()
    with pytest.raises(UnsafePickleError, match="weights_only=False"):
        trusting.load_checkpoint(tmp_path / "a.ckpt", weights_only=True)
    with pytest.raises(UnsafePickleError):
        fastckpt.lightning.CheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    assert fastckpt.lightning.CheckpointIO(restore_rng=False).load_checkpoint(
        tmp_path / "a.ckpt", weights_only=False)["epoch"] == 0
    with pytest.raises(TypeError, match="storage_options"):
        trusting.save_checkpoint(checkpoint, tmp_path / "b.ckpt", storage_options={"x": 1})
    with pytest.raises(FileNotFoundError):
        trusting.load_checkpoint(tmp_path / "missing.ckpt")


def test_two_processes_ddp(tmp_path):
    """Every 2-process scenario in one Lightning launch (subprocess launcher), compared on process 0."""
    script = Path(__file__).parent / "lightning_fit.py"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with warnings.catch_warnings():
        proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                              timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["mid_epoch"] == [] and results["epoch_boundary"] == [] and results["async"] == []

"""``fastckpt.lightning.CheckpointIO`` with the real ``pytorch_lightning.Trainer.fit`` on CPU.

A run stopped after step N and resumed with ``ckpt_path=`` continues bit for bit as the uninterrupted run (logged
losses, final weights, optimizer and scheduler state, ``global_step``, epoch), in one and two processes
(``strategy="ddp"``, gloo, one script launch: ``lightning_fit.py``), with this recipe (``lightning_fit.loader``):

* mid-epoch: torchdata's ``StatefulDataLoader`` with a stateful sampler set by the user
  (``StatefulDistributedSampler``, any number of processes), whose position Lightning saves in ``loops``;
* at an epoch's end: ``ModelCheckpoint(every_n_epochs=1, save_on_train_epoch_end=True)`` in a run bounded by
  ``max_epochs`` (any loader), or a checkpoint after the epoch's last batch (``every_n_train_steps``) with a plain
  DataLoader.

Where stock Lightning itself does not resume exactly, the same happens with its own ``TorchCheckpointIO`` (+ the
same RNG states), and the tests compare with that resume instead (found by logging each step's batch, RNG hashes
and sampler epoch in both runs):

* ``on_train_epoch_end`` checkpoint + ``max_steps``: ``_FitLoop.restarting`` stays True for iteration-based
  training, so the epoch loop restarts on its last batch and, with no validation run (``_is_validation_done`` is
  False while restarting), trains one extra batch in the finished epoch; every later batch is shifted.
* checkpoint after an epoch's last batch + ``StatefulDataLoader``: the fit loop moves on to the next epoch but
  still applies the loader state of the finished one (all samples yielded), so that epoch yields no batch and its
  data is skipped.
* ``StatefulDataLoader`` + a plain ``DistributedSampler``: torchdata's batch sampler calls ``iter(sampler)`` (which
  fixes a ``DistributedSampler``'s order by its epoch) when the loader's iterator is made, and in the first epoch
  after a resume Lightning makes it before ``set_epoch``, so a resume in epoch >= 1 replays epoch 0's order
  (``StatefulDistributedSampler.__iter__`` is a generator: its order is drawn at the first batch, after
  ``set_epoch``).
* ``StatefulDataLoader(shuffle=True)`` with several processes: torchdata's ``RandomSampler`` is no torch
  ``RandomSampler``, so Lightning wraps it in a ``DistributedSamplerWrapper``, whose order follows the inner
  sampler's ``generator``, which no checkpoint state holds.
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


@pytest.mark.parametrize("stop", [5, 13])  # 8 batches per epoch: stops in epoch 0 or 1, ends in epoch 2
def test_mid_epoch_resume_is_bit_identical(tmp_path, stop):
    assert lf.resume_matches(tmp_path, stop, 20) == []


def test_async_save_resume_is_bit_identical(tmp_path):
    assert lf.resume_matches(tmp_path, 5, 20, plugin_kwargs={"async_save": True}) == []


@pytest.mark.parametrize("stateful", [True, False])
def test_epoch_end_resume_is_bit_identical(tmp_path, stateful):
    assert lf.resume_matches(tmp_path, 8, 24, at_epoch_end=True, by_epochs=True, stateful=stateful) == []


def test_last_batch_resume_is_bit_identical(tmp_path):
    assert lf.resume_matches(tmp_path, 8, 20, stateful=False) == []


INEXACT = {  # stock Lightning's inexact resumes (module docs): resume_matches' arguments
    "epoch_end_max_steps": {"stop": 8, "at_epoch_end": True, "stateful": False},
    "last_batch_stateful": {"stop": 8},
    "plain_sampler_in_stateful_loader": {"stop": 13, "sampler": "plain"},
}


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="stock Lightning does not replay these (module docs)")
@pytest.mark.parametrize("case", INEXACT)
def test_lightnings_inexact_resumes_differ_from_the_uninterrupted_run(tmp_path, case):
    """Pins the cases the README calls inexact: a Lightning (or torchdata) release that makes one exact XPASSes
    (strict), and the README's list must change."""
    assert lf.resume_matches(tmp_path, total=20, **INEXACT[case]) == []


@pytest.mark.parametrize("case", INEXACT)
def test_lightnings_inexact_resumes_equal_its_own_plugin(tmp_path, case):
    """Where stock Lightning does not resume exactly (see the module docs), fastckpt's plugin changes nothing of
    what its loops do: the resume equals the same resume through ``TorchCheckpointIO`` (+ the same RNG states)."""
    assert lf.matches_torch_io(tmp_path, total=20, **INEXACT[case]) == []


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
    """Every 2-process scenario in one Lightning launch (subprocess launcher), each against the uninterrupted
    2-process run: mid-epoch (in epoch 1), async, after an epoch's last batch, at an epoch's end, and processes
    seeded differently (with ``RankRNGStates``; without it process 1's resumed losses differ), a SIGUSR1 that only
    process 1 gets (``PreemptionCheckpoint``: both save the agreed next step and stop; the resume is exact); and stock
    Lightning's inexact ``StatefulDataLoader(shuffle=True)`` resume, which must differ from the first batch."""
    script = Path(__file__).parent / "lightning_fit.py"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with warnings.catch_warnings():
        proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                              timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"results_{rank}.json").read_text()) for rank in (0, 1)]
    for rank, got in enumerate(results):
        assert set(got) == {"mid_epoch", "async", "last_batch", "epoch_end", "rank_seeds",
                            "rank_seeds_without_callback", "shuffle_true", "preempted"}
        plain = got.pop("rank_seeds_without_callback")
        # stock Lightning's inexact case (module docs): the order differs from the first resumed batch on
        shuffled = got.pop("shuffle_true")
        assert any(p.startswith("losses[0]") for p in shuffled), (rank, shuffled)
        assert got == {name: [] for name in got}, rank
        # without RankRNGStates process 1 resumes with process 0's RNG states: its first resumed step's dropout
        # masks, so its loss, differ (process 0's first loss matches), and the gradients of both from then on
        first_step_differs = any(p.startswith("losses[0]") for p in plain)
        assert plain and first_step_differs == (rank == 1), (rank, plain)


def test_rng_states_of_another_world_size_warn_and_old_format_loads(tmp_path):
    torch.manual_seed(3)
    saved = fastckpt.lightning.rng.collect_rng_states()
    expected = torch.rand(3)
    assert saved["world_size"] == 1 and len(saved["ranks"]) == 1
    fastckpt.save({"epoch": 0, fastckpt.lightning.RNG_KEY: {"world_size": 2, "ranks": saved["ranks"] * 2}},
                  tmp_path / "two.ckpt")
    fastckpt.save({"epoch": 0, fastckpt.lightning.RNG_KEY: saved["ranks"][0]}, tmp_path / "old.ckpt")
    fastckpt.save({"epoch": 0, fastckpt.lightning.RNG_KEY: [1, 2]}, tmp_path / "bad.ckpt")
    with pytest.warns(UserWarning, match="saved by 2 processes and this run has 1"):
        assert fastckpt.lightning.CheckpointIO().load_checkpoint(tmp_path / "two.ckpt") == {"epoch": 0}
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(4)
    assert fastckpt.lightning.CheckpointIO().load_checkpoint(tmp_path / "old.ckpt") == {"epoch": 0}
    assert torch.equal(torch.rand(3), expected)
    with pytest.raises(ValueError, match="fastckpt_rng_states"):
        fastckpt.lightning.CheckpointIO().load_checkpoint(tmp_path / "bad.ckpt")
    torch.manual_seed(5)
    untouched = torch.get_rng_state()
    assert fastckpt.lightning.CheckpointIO(restore_rng=False).load_checkpoint(tmp_path / "two.ckpt") == {"epoch": 0}
    assert torch.equal(torch.get_rng_state(), untouched)


def test_load_from_checkpoint_reads_the_folders(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_last="link")
    _, model = lf.fit(6, tmp_path, callbacks=[callback])
    last = tmp_path / "ckpts" / "last.ckpt"
    with pytest.raises(IsADirectoryError):  # Lightning's own reads files with torch.load
        lf.TinyModule.load_from_checkpoint(last)
    torch.manual_seed(9)
    lf.TinyModule()  # its __init__ draws the initial weights
    rng = torch.get_rng_state()
    torch.manual_seed(9)
    loaded = fastckpt.lightning.load_from_checkpoint(lf.TinyModule, last, map_location="cpu", lr=0.5)
    assert type(loaded) is lf.TinyModule and loaded.hparams.hidden == 16 and loaded.hparams.lr == 0.5
    assert list(loaded.state_dict()) == list(model.state_dict())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)  # the checkpoint's RNG states were not applied
    with pytest.raises(RuntimeError, match="size mismatch"):  # the saved weights do not fit hidden=8
        fastckpt.lightning.load_from_checkpoint(lf.TinyModule, last, hidden=8)

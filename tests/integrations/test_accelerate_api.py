"""``fastckpt.accelerate.save_state`` / ``load_state``: everything an Accelerator tracks (models, optimizers,
schedulers, registered objects, GradScaler, seedable sampler, step, RNG), the save/load pre-hooks, model_only,
ProjectConfiguration naming with ``total_limit`` and the ``iteration`` restored on resume (C27), in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate.data_loader import get_sampler
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from helpers.accelerate_state import assert_restored, draws, prepared_state, snapshot
from helpers.common import assert_model_state, assert_nested_equal, make_training_state, model_clone, requires_cuda
from torch.utils.data import DataLoader, TensorDataset

import fastckpt
import fastckpt.accelerate
from fastckpt.torch import load_model, save_model


class Ema:
    """A registered object holding a tensor, an int and a tuple."""

    def __init__(self, seed: int):
        self.shadow = torch.randn(3, generator=torch.Generator().manual_seed(seed))
        self.count = seed
        self.meta = ("decay", 0.999)

    def state_dict(self):
        return {"shadow": self.shadow, "count": self.count, "meta": self.meta}

    def load_state_dict(self, state):
        self.shadow, self.count, self.meta = state["shadow"], state["count"], state["meta"]


class Opaque:
    """Not a plain value: accelerate pickles it, and reading it back needs full unpickling."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.value == self.value


class HoldsOpaque:
    def __init__(self, value):
        self.item = Opaque(value)

    def state_dict(self):
        return {"item": self.item}

    def load_state_dict(self, state):
        self.item = state["item"]


def _everything(new_accelerator, seed, *, project=None, total_limit=None, train=True):
    kw = {"dataloader_config": DataLoaderConfiguration(use_seedable_sampler=True)}
    if project is not None:
        kw["project_config"] = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True,
                                                    total_limit=total_limit)
    torch.manual_seed(seed)
    acc = new_accelerator(**kw)
    model, opt, sched = prepared_state(acc, seed, steps=2 if train else 0)
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(12.0)), batch_size=3, shuffle=True))
    ema = Ema(seed)
    acc.register_for_checkpointing(ema)
    acc.scaler = torch.amp.GradScaler("cpu")
    if train:
        for _ in dl:  # one epoch: the sampler and the dataloader's epoch counters move on
            pass
        acc.scaler.scale(torch.ones(1))
        acc.scaler.update(new_scale=1024.0)
        acc.step = 5
    return acc, model, opt, sched, dl, ema


def _epoch_order(dl):
    return [b[0].tolist() for b in dl]


def test_round_trip_of_everything_the_accelerator_tracks(tmp_path, new_accelerator):
    acc, model, opt, sched, dl, ema = _everything(new_accelerator, 1)
    expected = snapshot(model, opt, sched)
    saved_sampler = (get_sampler(dl).epoch, get_sampler(dl).initial_seed)
    path = fastckpt.accelerate.save_state(acc, tmp_path / "ckpt")
    assert path == (tmp_path / "ckpt").absolute()
    assert sorted(p.name for p in path.iterdir()) == [
        "custom_checkpoint_0.safetensors", "fastckpt.json", "model.safetensors", "optimizer.safetensors",
        "random_states_0.safetensors", "sampler.json", "scaler.safetensors", "scheduler.json",
    ]
    after_save = draws()
    next_epoch = _epoch_order(dl)  # what the uninterrupted run sees next

    acc2, model2, opt2, sched2, dl2, ema2 = _everything(new_accelerator, 2, train=False)
    draws()
    assert fastckpt.accelerate.load_state(acc2, tmp_path / "ckpt") == ([], [])
    assert_restored(model2, opt2, sched2, expected)
    assert_nested_equal(ema2.state_dict(), {"shadow": ema.shadow, "count": 1, "meta": ("decay", 0.999)}, "ema")
    assert acc2.scaler.state_dict() == acc.scaler.state_dict() and acc2.scaler.state_dict()["scale"] == 1024.0
    assert (get_sampler(dl2).epoch, get_sampler(dl2).initial_seed) == saved_sampler
    assert acc2.step == 5
    assert draws() == after_save
    assert _epoch_order(dl2) == next_epoch


def test_compat_save_restored_by_stock_accelerate(tmp_path, new_accelerator):
    acc, model, opt, sched, dl, ema = _everything(new_accelerator, 3)
    expected = snapshot(model, opt, sched)
    path = fastckpt.accelerate.save_state(acc, tmp_path / "ckpt", compat="accelerate")
    acc.save_state(tmp_path / "stock")
    stock_files = {p.name for p in (tmp_path / "stock").iterdir()}
    assert stock_files == {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                           "custom_checkpoint_0.pkl", "scaler.pt"}
    assert {p.name for p in path.iterdir()} == stock_files | {"fastckpt.json"}
    acc2, model2, opt2, sched2, dl2, ema2 = _everything(new_accelerator, 4, train=False)
    acc2.load_state(str(path))
    assert_restored(model2, opt2, sched2, expected)
    assert_nested_equal(ema2.state_dict(), ema.state_dict(), "ema")
    assert acc2.scaler.state_dict() == acc.scaler.state_dict()
    assert acc2.step == 5


def test_stock_output_with_opaque_object_needs_trust_pickle(tmp_path, new_accelerator):
    acc = new_accelerator()
    model, opt, sched = prepared_state(acc, 6, steps=1)
    acc.register_for_checkpointing(HoldsOpaque(42))
    acc.save_state(tmp_path / "stock")
    expected = snapshot(model, opt, sched)

    acc2 = new_accelerator()
    model2, opt2, sched2 = prepared_state(acc2, 7)
    holder = HoldsOpaque(0)
    acc2.register_for_checkpointing(holder)
    before = model_clone(model2)
    with pytest.raises(fastckpt.UnsafePickleError, match=r"custom_checkpoint_0\.pkl.*Opaque"):
        fastckpt.accelerate.load_state(acc2, tmp_path / "stock")
    assert_model_state(model2, before)
    assert holder.item == Opaque(0)
    fastckpt.accelerate.load_state(acc2, tmp_path / "stock", trust_pickle=True)
    assert holder.item == Opaque(42)
    assert_restored(model2, opt2, sched2, expected)


def test_registered_object_count_must_match(tmp_path, new_accelerator):
    acc, *_ = _everything(new_accelerator, 1)
    fastckpt.accelerate.save_state(acc, tmp_path / "ckpt")
    acc2, model2, opt2, sched2, dl2, ema2 = _everything(new_accelerator, 2, train=False)
    acc2.register_for_checkpointing(Ema(9))
    before = model_clone(model2)
    with pytest.raises(fastckpt.MissingStateError, match="2 object"):
        fastckpt.accelerate.load_state(acc2, tmp_path / "ckpt")
    acc2._custom_objects.clear()
    with pytest.raises(fastckpt.KeyMismatchError, match="holds 1 custom"):
        fastckpt.accelerate.load_state(acc2, tmp_path / "ckpt")
    assert_model_state(model2, before)


def test_save_and_load_pre_hooks(tmp_path, new_accelerator):
    """A save hook may save a model itself (and take its weights out); the load hook then loads it."""
    acc = new_accelerator()
    main, opt, sched = prepared_state(acc, 8, steps=1)
    side = acc.prepare(torch.nn.Linear(3, 2))
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", len(models), len(weights), Path(output_dir)))
        save_model(models[1], Path(output_dir) / "side.safetensors")
        weights.pop()

    def load_hook(models, input_dir):
        calls.append(("load", len(models), Path(input_dir)))
        load_model(models.pop(), Path(input_dir) / "side.safetensors")

    acc.register_save_state_pre_hook(save_hook)
    path = fastckpt.accelerate.save_state(acc, tmp_path / "ckpt")
    names = {p.name for p in path.iterdir()}
    assert "side.safetensors" in names and "model.safetensors" in names and "model_1.safetensors" not in names
    assert calls == [("save", 2, 2, path)]
    expected = snapshot(main, opt, sched)
    side_expected = model_clone(side)

    acc2 = new_accelerator()
    main2, opt2, sched2 = prepared_state(acc2, 9)
    side2 = acc2.prepare(torch.nn.Linear(3, 2))
    acc2.register_load_state_pre_hook(load_hook)
    fastckpt.accelerate.load_state(acc2, path)
    assert calls[1] == ("load", 2, path)
    assert_restored(main2, opt2, sched2, expected)
    assert_model_state(side2, side_expected)


def test_model_only_on_both_sides(tmp_path, new_accelerator):
    acc, model, opt, sched, dl, ema = _everything(new_accelerator, 1)
    path = fastckpt.accelerate.save_state(acc, tmp_path / "weights", model_only=True)
    assert sorted(p.name for p in path.iterdir()) == ["fastckpt.json", "model.safetensors"]
    full = fastckpt.accelerate.save_state(acc, tmp_path / "full")

    acc2, model2, opt2, sched2, dl2, ema2 = _everything(new_accelerator, 2, train=False)
    before = model_clone(model2)
    with pytest.raises(fastckpt.MissingStateError, match="model_only"):
        fastckpt.accelerate.load_state(acc2, path)
    assert_model_state(model2, before)
    for source in (path, full):
        fastckpt.accelerate.load_state(acc2, source, model_only=True)
        assert_model_state(model2, model_clone(model))
        assert opt2.state_dict()["state"] == {} and acc2.step == 0 and ema2.count == 2


def test_max_shard_size_default_and_explicit(tmp_path, new_accelerator):
    acc = new_accelerator()
    model, opt, sched = prepared_state(acc, 1, steps=1)
    one = fastckpt.accelerate.save_state(acc, tmp_path / "one")  # "10GB": one file each
    assert (one / "model.safetensors").is_file() and (one / "optimizer.safetensors").is_file()
    many = fastckpt.accelerate.save_state(acc, tmp_path / "many", max_shard_size=100)
    assert (many / "model.safetensors.index.json").is_file() and (many / "optimizer.safetensors.index.json").is_file()
    expected = snapshot(model, opt, sched)
    acc2 = new_accelerator()
    model2, opt2, sched2 = prepared_state(acc2, 2)
    fastckpt.accelerate.load_state(acc2, many)
    assert_restored(model2, opt2, sched2, expected)
    with pytest.raises(ValueError, match="unsharded"):
        fastckpt.accelerate.save_state(acc, tmp_path / "x", compat="accelerate", max_shard_size="1GB")


def test_output_dir_required_without_automatic_naming(tmp_path, new_accelerator):
    acc = new_accelerator()
    prepared_state(acc, 1)
    with pytest.raises(ValueError, match="automatic_checkpoint_naming"):
        fastckpt.accelerate.save_state(acc)
    with pytest.raises(fastckpt.MissingStateError):
        fastckpt.accelerate.load_state(acc, tmp_path / "absent")


def _names(project):
    return sorted((p.name for p in (project / "checkpoints").iterdir() if not p.name.startswith(".")),
                  key=lambda n: int(n.split("_")[1]))


def test_c27_rotation_through_the_accelerate_api(tmp_path, new_accelerator):
    project = tmp_path / "proj"
    for n in (9, 10, 100, 1000):
        m = torch.nn.Linear(2, 2)
        fastckpt.save_state(m, output_dir=project / "checkpoints" / f"checkpoint_{n}")
    acc, model, opt, sched, dl, ema = _everything(new_accelerator, 1, project=project, total_limit=2)
    path = fastckpt.accelerate.save_state(acc)
    assert path == (project / "checkpoints" / "checkpoint_1001").absolute()
    assert _names(project) == ["checkpoint_1000", "checkpoint_1001"]
    assert fastckpt.latest_checkpoint(project).name == "checkpoint_1001"
    assert acc.project_configuration.iteration == 1002
    expected = snapshot(model, opt, sched)
    acc2, model2, opt2, sched2, *_ = _everything(new_accelerator, 2, project=project, total_limit=2, train=False)
    fastckpt.accelerate.load_state(acc2)  # input_dir=None: the latest
    assert_restored(model2, opt2, sched2, expected)
    assert acc2.project_configuration.iteration == 1002


def test_iteration_restored_on_resume(tmp_path, new_accelerator):
    """accelerate restarts ``iteration`` at 0 after a resume, so its next save clashes with checkpoint_0 (or
    rotation deletes the wrong folder); fastckpt restores it from the loaded folder's number."""
    project = tmp_path / "proj"
    acc, *_ = _everything(new_accelerator, 1, project=project, total_limit=2)
    for _ in range(3):
        fastckpt.accelerate.save_state(acc)
    assert _names(project) == ["checkpoint_1", "checkpoint_2"]

    acc2, *_ = _everything(new_accelerator, 2, project=project, total_limit=2, train=False)
    assert acc2.project_configuration.iteration == 0
    fastckpt.accelerate.load_state(acc2)
    assert acc2.project_configuration.iteration == 3
    assert fastckpt.accelerate.save_state(acc2).name == "checkpoint_3"
    assert _names(project) == ["checkpoint_2", "checkpoint_3"]

    acc3, *_ = _everything(new_accelerator, 3, project=project, total_limit=2, train=False)
    fastckpt.accelerate.load_state(acc3, project / "checkpoints" / "checkpoint_2")  # roll back one
    assert acc3.project_configuration.iteration == 3
    assert fastckpt.accelerate.save_state(acc3).name == "checkpoint_4"  # never over a newer committed one
    assert _names(project) == ["checkpoint_3", "checkpoint_4"]
    manifest = json.loads((project / "checkpoints" / "checkpoint_4" / "fastckpt.json").read_text())
    assert manifest["processes"] == 1 and manifest["custom_objects"] == 1


def test_a_rank_without_its_rng_file_warns_and_keeps_its_streams(tmp_path):
    """A checkpoint saved by fewer processes than load it: the extra ranks keep their RNG states, with a warning."""
    from fastckpt.accelerate import _rng_rank

    model, opt, sched = make_training_state(1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c")
    assert _rng_rank(ckpt, "fastckpt", 0) == 0
    with pytest.warns(fastckpt.RngRestoreWarning, match="random_states_1.safetensors"):
        assert _rng_rank(ckpt, "fastckpt", 1) is None


@pytest.mark.parametrize("kind", ["DEEPSPEED", "MEGATRON_LM", "XLA"])  # FSDP2: test_fsdp_accelerate.py
def test_sharded_engines_are_refused(tmp_path, kind):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    fake = SimpleNamespace(distributed_type=DistributedType[kind])
    with pytest.raises(NotImplementedError, match=kind):
        fastckpt.accelerate.save_state(fake, tmp_path / "c")
    with pytest.raises(NotImplementedError, match=kind):
        fastckpt.accelerate.load_state(fake, tmp_path / "c")


@requires_cuda
@pytest.mark.parametrize("compat", [None, "accelerate"])
def test_cuda_round_trip_with_cuda_rng(tmp_path, new_accelerator, compat):
    """On a GPU: model and optimizer state on cuda:0, the CUDA generator restored; stock accelerate reads the
    compat output and fastckpt reads stock output."""
    acc = new_accelerator(cpu=False)
    model, opt, sched = prepared_state(acc, 1, steps=2)
    assert next(model.parameters()).device.type == "cuda"
    expected = snapshot(model, opt, sched)
    torch.cuda.manual_seed(77)
    path = fastckpt.accelerate.save_state(acc, tmp_path / "ckpt", compat=compat)
    acc.save_state(tmp_path / "stock")
    after = (draws(), torch.rand(3, device="cuda").tolist())

    for source, loader in ((path, "fastckpt"), (path, "stock" if compat else "fastckpt"), (tmp_path / "stock", "fastckpt")):
        acc2 = new_accelerator(cpu=False)
        model2, opt2, sched2 = prepared_state(acc2, 2)
        torch.cuda.manual_seed(5)
        if loader == "stock":
            acc2.load_state(str(source))
        else:
            fastckpt.accelerate.load_state(acc2, source)
        assert_restored(model2, opt2, sched2, expected)
        assert opt2.state_dict()["state"][0]["exp_avg"].device.type == "cuda"
        assert (draws(), torch.rand(3, device="cuda").tolist()) == after, (source, loader)


@pytest.mark.parametrize("mode", [True, "snapshot"])
def test_async_save_returns_a_handle_holding_the_state_at_the_call(tmp_path, new_accelerator, mode):
    acc, model, opt, sched, dl, ema = _everything(new_accelerator, 1)
    expected = snapshot(model, opt, sched)
    handle = fastckpt.accelerate.save_state(acc, tmp_path / "ckpt", async_save=mode)
    assert isinstance(handle, fastckpt.AsyncSave)
    for p in acc.unwrap_model(model).parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the step after the call changes every parameter in place
    assert handle.wait() == (tmp_path / "ckpt").absolute()
    acc2, model2, opt2, sched2, dl2, ema2 = _everything(new_accelerator, 2, train=False)
    fastckpt.accelerate.load_state(acc2, tmp_path / "ckpt")
    assert_restored(model2, opt2, sched2, expected)


@pytest.mark.parametrize("mode", [True, "snapshot"])
def test_async_save_after_a_data_write_commits_the_call_state_or_raises(tmp_path, new_accelerator, monkeypatch,
                                                                        mode):
    import threading

    import fastckpt.accelerate.async_save as accelerate_async
    from fastckpt.errors import ConcurrentModificationError

    go, real = threading.Event(), accelerate_async.write_checkpoint

    def held(*args, **kwargs):
        assert go.wait(60)
        return real(*args, **kwargs)

    def prepared(seed):
        torch.manual_seed(seed)
        acc = new_accelerator()
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))  # streamed tensors
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        return acc, model, opt

    monkeypatch.setattr(accelerate_async, "write_checkpoint", held)
    acc, model, opt = prepared(1)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    expected = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    handle = fastckpt.accelerate.save_state(acc, tmp_path / "ckpt", async_save=mode)
    for p in acc.unwrap_model(model).parameters():
        p.data.mul_(0.5)  # no version counter sees it
    go.set()
    if mode is True:
        with pytest.raises(ConcurrentModificationError, match="xxh3-128 at the call|written after save_state returned"):
            handle.wait()
        assert not (tmp_path / "ckpt").exists()
        return
    handle.wait()
    acc2, model2, opt2 = prepared(2)
    fastckpt.accelerate.load_state(acc2, tmp_path / "ckpt")
    assert_model_state(acc2.unwrap_model(model2), expected)


def test_strict_false_lists_the_optimizer_state_it_drops(tmp_path, new_accelerator):
    """Issue 27.3 through fastckpt.accelerate: resumed with the first layer frozen and left out of the optimizer,
    strict=False applies the rest and ``LoadResult.skipped`` names each dropped parameter and its state."""
    torch.manual_seed(0)
    acc = new_accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    fastckpt.accelerate.save_state(acc, tmp_path / "ckpt")
    acc2 = new_accelerator()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    fresh[0].requires_grad_(False)
    fresh, opt2 = acc2.prepare(fresh, torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2))
    result = fastckpt.accelerate.load_state(acc2, tmp_path / "ckpt", strict=False)
    where = tmp_path / "ckpt" / "optimizer.safetensors"
    assert result.skipped == [
        f"{where}: optimizer state of '{name}' (step, exp_avg, exp_avg_sq) not applied: the live optimizer does not "
        "optimize that parameter (frozen since the save, or left out of its param_groups)" for name in ("0.weight", "0.bias")]
    for name in ("2.weight", "2.bias"):
        saved = opt.state[dict(model.named_parameters())[name]]
        loaded = opt2.state[dict(fresh.named_parameters())[name]]
        assert all(torch.equal(saved[k], loaded[k]) for k in ("step", "exp_avg", "exp_avg_sq")), name

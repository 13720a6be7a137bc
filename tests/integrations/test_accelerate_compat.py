"""Two-way compatibility with stock accelerate 1.15: ``compat="accelerate"`` output restored by
``Accelerator.load_state`` (model, optimizer and scheduler prepared), and fastckpt reading accelerate's own output
(``model.safetensors`` and ``pytorch_model.bin``) with the pickle policy (``weights_only`` + accelerate's allowlist,
``trust_pickle`` for the rest), all validated before anything changes."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
import safetensors.torch as st
import torch
from helpers.accelerate_state import assert_restored, draws, prepared_state, snapshot
from helpers.common import TiedNet, assert_model_state, assert_nested_equal, make_training_state, model_clone

import fastckpt

ACCELERATE_FILES = {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"}


def _load_pickle(path):
    return torch.load(path, weights_only=False)


def test_compat_checkpoint_restored_by_stock_accelerate(tmp_path, new_accelerator):
    acc = new_accelerator()
    model, opt, sched = prepared_state(acc, 1, steps=3)
    expected = snapshot(model, opt, sched)
    ckpt = fastckpt.save_state(acc.unwrap_model(model), opt, sched, output_dir=tmp_path / "fc", compat="accelerate",
                               step=7)
    after_save = draws()
    acc.save_state(tmp_path / "stock")
    assert {p.name for p in ckpt.iterdir()} == ACCELERATE_FILES | {"fastckpt.json"}
    assert {p.name for p in (tmp_path / "stock").iterdir()} == ACCELERATE_FILES
    # same model file as accelerate's, byte for byte; same pickled content
    assert (ckpt / "model.safetensors").read_bytes() == (tmp_path / "stock" / "model.safetensors").read_bytes()
    for name in ("optimizer.bin", "scheduler.bin"):
        assert_nested_equal(_load_pickle(ckpt / name), _load_pickle(tmp_path / "stock" / name), name)
    rng = _load_pickle(ckpt / "random_states_0.pkl")
    cuda = ["torch_cuda_manual_seed"] if torch.cuda.is_available() else []
    assert list(rng) == ["step", "random_state", "numpy_random_seed", "torch_manual_seed", *cuda]
    assert rng["step"] == 7

    acc2 = new_accelerator()
    model2, opt2, sched2 = prepared_state(acc2, 99)
    draws()
    acc2.load_state(str(ckpt))  # stock accelerate reads fastckpt's output
    assert_restored(model2, opt2, sched2, expected)
    assert acc2.step == 7
    assert draws() == after_save


def _stock_checkpoint(tmp_path, new_accelerator, *, safe=True, seed=2):
    acc = new_accelerator()
    model, opt, sched = prepared_state(acc, seed, steps=2)
    acc.step = 11
    acc.save_state(tmp_path / "stock", safe_serialization=safe)
    return snapshot(model, opt, sched), draws()


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_fastckpt_loads_stock_accelerate_output(tmp_path, new_accelerator, safe):
    expected, after_save = _stock_checkpoint(tmp_path, new_accelerator, safe=safe)
    assert ((tmp_path / "stock" / "model.safetensors").exists()) == safe
    assert ((tmp_path / "stock" / "pytorch_model.bin").exists()) == (not safe)
    model, opt, sched = make_training_state(50)
    draws()
    assert fastckpt.load_state(model, opt, sched, input_dir=tmp_path / "stock") == ([], [])
    assert_restored(model, opt, sched, expected)
    assert draws() == after_save


def test_fastckpt_accelerate_api_loads_stock_output(tmp_path, new_accelerator):
    expected, after_save = _stock_checkpoint(tmp_path, new_accelerator)
    acc = new_accelerator()
    model, opt, sched = prepared_state(acc, 77)
    fastckpt.accelerate.load_state(acc, tmp_path / "stock")
    assert_restored(model, opt, sched, expected)
    assert acc.step == 11
    assert draws() == after_save


def test_tied_model_bin_round_trip(tmp_path, new_accelerator):
    """C2 through accelerate's pickle path: a tied model's pytorch_model.bin holds both names of one storage."""
    acc = new_accelerator()
    torch.manual_seed(3)
    model = TiedNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.tensor([1, 2, 3])).sum())
    opt.step()
    acc.save_state(tmp_path / "stock", safe_serialization=False)
    fresh = TiedNet()
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert fastckpt.load_state(fresh, fopt, input_dir=tmp_path / "stock") == ([], [])
    assert torch.equal(fresh.emb.weight, acc.unwrap_model(model).emb.weight)
    assert fresh.head.weight is fresh.emb.weight
    assert_nested_equal(fopt.state_dict(), opt.state_dict(), "optimizer")


def test_pickle_policy_numpy_scalar_needs_trust_pickle(tmp_path, new_accelerator):
    """torch>=2.6 weights_only refuses numpy scalars in a scheduler state; fastckpt says why, changes nothing."""
    acc = new_accelerator()
    model, opt = acc.prepare(*make_training_state(4)[:2])
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=np.float64(0.5)))
    acc.save_state(tmp_path / "stock")
    expected = snapshot(model, opt, sched)

    live, lopt, _ = make_training_state(60)
    lsched = torch.optim.lr_scheduler.StepLR(lopt, step_size=2, gamma=0.5)
    before = model_clone(live)
    with pytest.raises(fastckpt.UnsafePickleError) as info:
        fastckpt.load_state(live, lopt, lsched, input_dir=tmp_path / "stock")
    message = str(info.value)
    assert "scheduler.bin" in message and "numpy" in message and "trust_pickle=True" in message
    assert isinstance(info.value, pickle.UnpicklingError) and isinstance(info.value, fastckpt.CheckpointError)
    assert_model_state(live, before)
    assert lopt.state_dict()["state"] == {}

    fastckpt.load_state(live, lopt, lsched, input_dir=tmp_path / "stock", trust_pickle=True)
    assert_restored(live, lopt, lsched, expected)
    assert type(lsched.state_dict()["gamma"]) is np.float64


def test_missing_optimizer_bin_fails_before_weights_change(tmp_path, new_accelerator):
    """accelerate overwrites the weights, then fails on optimizer.bin; fastckpt fails first."""
    _stock_checkpoint(tmp_path, new_accelerator)
    (tmp_path / "stock" / "optimizer.bin").unlink()
    model, opt, sched = make_training_state(8)
    before = model_clone(model)
    with pytest.raises(fastckpt.MissingStateError, match="optimizer.bin"):
        fastckpt.load_state(model, opt, sched, input_dir=tmp_path / "stock")
    assert_model_state(model, before)


def test_positional_optimizer_state_must_fit_the_live_groups(tmp_path, new_accelerator):
    _stock_checkpoint(tmp_path, new_accelerator)
    model, _, _ = make_training_state(8)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}])
    before = model_clone(model)
    with pytest.raises(fastckpt.KeyMismatchError, match=r"sizes \[\d+\] .* \[2, \d+\]"):
        fastckpt.load_state(model, opt, input_dir=tmp_path / "stock")
    assert_model_state(model, before)
    assert opt.state_dict()["state"] == {}


def test_weights_only_folder_loads_model_only(tmp_path, new_accelerator):
    acc = new_accelerator()
    model, opt, sched = prepared_state(acc, 5, steps=1)
    acc.save_model(model, tmp_path / "weights")
    assert {p.name for p in (tmp_path / "weights").iterdir()} == {"model.safetensors"}
    live, lopt, lsched = make_training_state(9)
    before = model_clone(live)
    with pytest.raises(fastckpt.MissingStateError, match="model_only=True"):
        fastckpt.load_state(live, lopt, lsched, input_dir=tmp_path / "weights")
    with pytest.raises(fastckpt.MissingStateError, match="model_only=True"):
        fastckpt.load_state(live, input_dir=tmp_path / "weights")
    assert_model_state(live, before)
    fastckpt.load_state(live, lopt, input_dir=tmp_path / "weights", model_only=True)
    assert_model_state(live, model_clone(acc.unwrap_model(model)))
    assert lopt.state_dict()["state"] == {}


def test_ddp_prefixed_keys_load_into_the_bare_model(tmp_path, new_accelerator):
    """A state dict saved from a DistributedDataParallel wrapper (``module.*`` keys) loads into the bare model."""
    _stock_checkpoint(tmp_path, new_accelerator)
    stock = tmp_path / "stock" / "model.safetensors"
    plain = st.load_file(stock)
    st.save_file({f"module.{k}": v for k, v in plain.items()}, stock, metadata={"format": "pt"})
    model, opt, sched = make_training_state(8)
    assert fastckpt.load_state(model, opt, sched, input_dir=tmp_path / "stock") == ([], [])
    assert_nested_equal(dict(model.state_dict()), plain, "model")


def test_compat_rejects_sharding(tmp_path):
    model, opt, sched = make_training_state(1)
    with pytest.raises(ValueError, match="unsharded"):
        fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c", compat="accelerate", max_shard_size="1GB")
    with pytest.raises(ValueError, match="compat"):
        fastckpt.save_state(model, output_dir=tmp_path / "c", compat="deepspeed")
    assert not (tmp_path / "c").exists()


def test_compat_model_only_loads_in_both(tmp_path, new_accelerator):
    model, opt, sched = make_training_state(12)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c", compat="accelerate", model_only=True)
    assert {p.name for p in ckpt.iterdir()} == {"model.safetensors", "fastckpt.json"}
    assert json.loads((ckpt / "fastckpt.json").read_text())["layout"] == "accelerate"
    fresh, fopt, fsched = make_training_state(13)
    fastckpt.load_state(fresh, input_dir=ckpt)  # model-only checkpoint, nothing else asked for
    assert_model_state(fresh, model_clone(model))
    with pytest.raises(fastckpt.MissingStateError, match="optimizer.bin"):
        fastckpt.load_state(fresh, fopt, fsched, input_dir=ckpt)


def test_latest_counts_stock_accelerate_folders_not_unfinished_saves(tmp_path, new_accelerator):
    from accelerate.utils import ProjectConfiguration

    project = tmp_path / "proj"
    acc = new_accelerator(project_config=ProjectConfiguration(project_dir=str(project),
                                                              automatic_checkpoint_naming=True))
    model, opt, sched = prepared_state(acc, 21, steps=1)
    expected = snapshot(model, opt, sched)
    acc.save_state()  # stock: checkpoints/checkpoint_0, no fastckpt.json
    done = fastckpt.save_state(*make_training_state(22), output_dir=project / "checkpoints" / "checkpoint_1")
    (done / "fastckpt.json").unlink()  # fastckpt files without a manifest: an unfinished save
    shutil.copytree(project / "checkpoints" / "checkpoint_0", project / "checkpoints" / "checkpoint_5")
    (project / "checkpoints" / "checkpoint_5" / "random_states_0.pkl").unlink()  # stock save cut before its end
    latest = fastckpt.latest_checkpoint(project)
    assert latest is not None and latest.name == "checkpoint_0"
    live, lopt, lsched = make_training_state(23)
    fastckpt.load_state(live, lopt, lsched, project_dir=project)
    assert_restored(live, lopt, lsched, expected)
    with pytest.raises(fastckpt.MissingStateError, match="did not finish"):
        fastckpt.load_state(live, input_dir=done, model_only=True)
    nxt = fastckpt.save_state(live, lopt, lsched, project_dir=project)
    assert nxt.name == "checkpoint_1" and (nxt / "fastckpt.json").is_file()

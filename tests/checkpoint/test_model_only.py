"""``model_only``: a save writes only the model files (+ config.json) and the manifest and never touches the
optimizer; a model-only load reads only the weights, from either kind of folder; a full load of a model-only
folder raises MissingStateError before anything changes. Also C10 (a model with no parameters)."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import safetensors.torch as official
import torch
from helpers.common import (
    TinyNet,
    assert_model_state,
    assert_nested_equal,
    assert_tensor_dicts_identical,
    batches,
    make_tiny,
    model_clone,
    read_split,
    train,
)
from helpers.crc32c_ref import crc32c_hex
from torch import nn

import fastckpt


def _trained(seed=1, steps=3):
    model = make_tiny(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    train(model, opt, sched, batches(steps))
    return model, opt, sched


def _rng_snapshot():
    return (random.getstate(), np.random.get_state(legacy=True), torch.get_rng_state())


def _assert_rng_unchanged(before) -> None:
    py, npy, tch = before
    assert random.getstate() == py
    now = np.random.get_state(legacy=True)
    assert now[0] == npy[0] and np.array_equal(now[1], npy[1]) and now[2:] == npy[2:]
    assert torch.equal(torch.get_rng_state(), tch)


def test_model_only_save_writes_only_model_files_and_manifest(tmp_path):
    model, opt, sched = _trained()
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "weights", model_only=True)
    assert sorted(p.name for p in ckpt.iterdir()) == ["fastckpt.json", "model.safetensors"]
    manifest = json.loads((ckpt / "fastckpt.json").read_text())
    assert manifest["format"] == "fastckpt" and manifest["format_version"] == 1
    assert manifest["mode"] == "model_only"
    assert list(manifest["files"]) == ["model.safetensors"]
    data = (ckpt / "model.safetensors").read_bytes()
    assert manifest["files"]["model.safetensors"]["bytes"] == len(data)
    assert manifest["files"]["model.safetensors"]["crc32c"] == crc32c_hex(data)
    assert_tensor_dicts_identical(official.load_file(ckpt / "model.safetensors"), model_clone(model), ordered=False)
    assert read_split(ckpt / "model.safetensors")[2]["__metadata__"] == {"format": "pt"}


def test_model_only_save_of_several_models(tmp_path):
    torch.manual_seed(0)
    models = [TinyNet(), nn.Linear(2, 2), nn.Linear(1, 3)]
    ckpt = fastckpt.save_state(models, output_dir=tmp_path / "w", model_only=True)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "fastckpt.json", "model.safetensors", "model_1.safetensors", "model_2.safetensors"]
    torch.manual_seed(1)
    fresh = [TinyNet(), nn.Linear(2, 2), nn.Linear(1, 3)]
    fastckpt.load_state(fresh, input_dir=ckpt, model_only=True)
    for m, f in zip(models, fresh):
        assert_model_state(f, model_clone(m))


def test_model_only_save_does_not_touch_the_optimizer_or_scheduler(tmp_path):
    model, opt, sched = _trained()
    opt_before, sched_before = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    state_ids = {id(p): {k: (v.data_ptr() if torch.is_tensor(v) else v) for k, v in s.items()}
                 for p, s in opt.state.items()}
    fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "w", model_only=True)
    assert_nested_equal(opt.state_dict(), opt_before, "optimizer")
    assert_nested_equal(sched.state_dict(), sched_before, "scheduler")
    assert {id(p): {k: (v.data_ptr() if torch.is_tensor(v) else v) for k, v in s.items()}
            for p, s in opt.state.items()} == state_ids


def test_model_only_load_from_full_checkpoint_reads_only_weights(tmp_path):
    model, opt, sched = _trained(seed=1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "full")
    expected = model_clone(model)

    fresh, fopt, fsched = _trained(seed=2, steps=1)
    opt_before, sched_before = copy.deepcopy(fopt.state_dict()), copy.deepcopy(fsched.state_dict())
    random.seed(42)
    np.random.seed(42)
    torch.manual_seed(42)
    rng_before = _rng_snapshot()
    result = fastckpt.load_state(fresh, fopt, fsched, input_dir=ckpt, model_only=True)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert_model_state(fresh, expected)
    assert_nested_equal(fopt.state_dict(), opt_before, "optimizer")  # not restored
    assert_nested_equal(fsched.state_dict(), sched_before, "scheduler")
    _assert_rng_unchanged(rng_before)  # the RNG streams are not part of a model-only load


def test_model_only_load_never_opens_the_other_parts(tmp_path):
    """Damage every non-model part (same sizes, so the manifest check passes): a model-only load still works."""
    model, opt, sched = _trained(seed=1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "full")
    for name in ("optimizer.safetensors", "random_states_0.safetensors", "scheduler.json"):
        path = ckpt / name
        path.write_bytes(b"\xff" * path.stat().st_size)
    fresh = make_tiny(5)
    fastckpt.load_state(fresh, input_dir=ckpt, model_only=True)
    assert_model_state(fresh, model_clone(model))


def test_model_only_load_from_model_only_folder(tmp_path):
    model, opt, sched = _trained(seed=1)
    ckpt = fastckpt.save_state(model, output_dir=tmp_path / "w", model_only=True)
    fresh = make_tiny(5)
    assert fastckpt.load_state(fresh, input_dir=ckpt, model_only=True) == ([], [])
    assert_model_state(fresh, model_clone(model))


@pytest.mark.parametrize("passed", ["optimizer", "scheduler", "both"])
def test_full_load_of_model_only_folder_raises_before_changing_anything(tmp_path, passed):
    model, opt, sched = _trained(seed=1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "weights_only", model_only=True)
    fresh, fopt, fsched = _trained(seed=2, steps=1)
    weights_before = model_clone(fresh)
    opt_before, sched_before = copy.deepcopy(fopt.state_dict()), copy.deepcopy(fsched.state_dict())
    rng_before = _rng_snapshot()
    kwargs = {"optimizer": fopt if passed != "scheduler" else None,
              "scheduler": fsched if passed != "optimizer" else None}
    with pytest.raises(fastckpt.MissingStateError) as info:
        fastckpt.load_state(fresh, input_dir=ckpt, **kwargs)
    assert isinstance(info.value, FileNotFoundError)
    assert "weights_only" in str(info.value)
    assert_model_state(fresh, weights_before)  # weights unchanged (compared with a clone taken before)
    assert_nested_equal(fopt.state_dict(), opt_before, "optimizer")
    assert_nested_equal(fsched.state_dict(), sched_before, "scheduler")
    _assert_rng_unchanged(rng_before)


def test_load_of_model_only_folder_without_optimizer_or_scheduler_is_not_a_full_load(tmp_path):
    """README (API): a *full load* is one with an optimizer or scheduler passed; the model alone loads fine."""
    model, _, _ = _trained(seed=1)
    ckpt = fastckpt.save_state(model, output_dir=tmp_path / "w", model_only=True)
    fresh = make_tiny(3)
    assert fastckpt.load_state(fresh, input_dir=ckpt) == ([], [])
    assert_model_state(fresh, model_clone(model))


def test_c10_model_only_on_a_model_with_no_parameters(tmp_path):
    empty = nn.Sequential(nn.ReLU(), nn.Identity())
    assert list(empty.state_dict()) == []
    ckpt = fastckpt.save_state(empty, output_dir=tmp_path / "empty", model_only=True)
    assert sorted(p.name for p in ckpt.iterdir()) == ["fastckpt.json", "model.safetensors"]
    assert official.load_file(ckpt / "model.safetensors") == {}
    _, _, header, data = read_split(ckpt / "model.safetensors")
    assert header == {"__metadata__": {"format": "pt"}} and data == b""
    result = fastckpt.load_state(nn.Sequential(nn.ReLU(), nn.Identity()), input_dir=ckpt, model_only=True)
    assert tuple(result) == ([], [])
    assert fastckpt.load_state(nn.Module(), input_dir=ckpt) == ([], [])


def test_c10_full_save_of_a_model_with_no_parameters(tmp_path):
    empty = nn.Module()
    ckpt = fastckpt.save_state(empty, output_dir=tmp_path / "empty_full")
    assert json.loads((ckpt / "fastckpt.json").read_text())["mode"] == "full"
    assert fastckpt.load_state(nn.Module(), input_dir=ckpt) == ([], [])

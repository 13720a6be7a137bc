"""Optimizer state that does not fit the live optimizer is refused in phase 1, under strict=True and strict=False,
with the live optimizer untouched: a moment of another shape than its parameter (ShapeMismatchError), a floating
moment stored as an integer dtype (DtypeError, never a silent cast), a hyper-parameter of another type than the
live group's (HeaderError). The files are edited consistently (header, data and manifest), so only the check can
catch them; state of other shapes (Adafactor's factors, a 0-d ``step``) still loads."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import safetensors.torch as official
import torch
from helpers.common import assert_nested_equal
from safetensors import safe_open
from torch import nn

import fastckpt
from fastckpt.errors import DtypeError, HeaderError, KeyMismatchError, ShapeMismatchError


def _trained(seed: int, make=lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.9, 0.99))):
    torch.manual_seed(seed)
    model = nn.Linear(16, 16)
    opt = make(model.parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()
    return model, opt


def _rewrite(ckpt: Path, edit_tensors=None, edit_groups=None) -> Path:
    """Rewrite optimizer.safetensors with edited tensors / param_groups and record its new size and crc32c."""
    path = ckpt / "optimizer.safetensors"
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if edit_tensors:
        edit_tensors(tensors)
    if edit_groups:
        groups = json.loads(metadata["param_groups"])
        edit_groups(groups)
        metadata["param_groups"] = json.dumps(groups)
    official.save_file(tensors, str(path), metadata=metadata)
    manifest_path = ckpt / "fastckpt.json"
    manifest = json.loads(manifest_path.read_text())
    entry = manifest["files"][path.name]
    entry["bytes"] = path.stat().st_size
    entry["crc32c"] = f"{fastckpt._core.crc32c(path.read_bytes()):08x}"
    entry.pop("tensors", None)
    manifest_path.write_text(json.dumps(manifest))
    return path


def _refused(ckpt: Path, error: type, *, fresh: bool, strict: bool) -> str:
    """Load into a fresh or a trained optimizer; assert ``error`` and that the optimizer is unchanged."""
    model, opt = _trained(5)
    if fresh:
        opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.99))
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(error) as info:
        fastckpt.load_state(model, opt, input_dir=ckpt, strict=strict)
    assert type(info.value) is error
    assert_nested_equal(opt.state_dict(), before, "after a refused load")
    return str(info.value)


@pytest.fixture
def ckpt(tmp_path):
    model, opt = _trained(1)
    return fastckpt.save_state(model, opt, output_dir=tmp_path / "ckpt")


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh_optimizer", "trained_optimizer"])
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not_strict"])
def test_moment_of_another_shape_is_refused(ckpt, fresh, strict):
    def flatten(t):
        t["state.weight.exp_avg"] = t["state.weight.exp_avg"].reshape(256).clone()

    path = _rewrite(ckpt, flatten)
    message = _refused(ckpt, ShapeMismatchError, fresh=fresh, strict=strict)
    assert str(path) in message and "'state.weight.exp_avg'" in message
    assert "[256]" in message and "[16, 16]" in message


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh_optimizer", "trained_optimizer"])
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not_strict"])
def test_floating_moment_stored_as_integer_is_refused(ckpt, fresh, strict):
    def as_int(t):
        t["state.weight.exp_avg"] = t["state.weight.exp_avg"].view(torch.int32).clone()

    path = _rewrite(ckpt, as_int)
    message = _refused(ckpt, DtypeError, fresh=fresh, strict=strict)
    assert str(path) in message and "'state.weight.exp_avg'" in message
    assert "torch.int32" in message and "torch.float32" in message


@pytest.mark.parametrize(("key", "value"), [("lr", "x"), ("weight_decay", True), ("betas", [0.9, 0.99, 0.5]),
                                            ("betas", [0.9, "y"]), ("amsgrad", 0)])
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not_strict"])
def test_hyper_parameter_of_another_type_is_refused(ckpt, key, value, strict):
    def edit(groups):
        groups[0][key] = value

    path = _rewrite(ckpt, edit_groups=edit)
    message = _refused(ckpt, HeaderError, fresh=True, strict=strict)
    assert str(path) in message and "[0]" in message and f"{key}={value!r}" in message


def test_int_for_a_float_hyper_parameter_and_other_state_shapes_load(tmp_path):
    """An int ``lr`` for a float one is fine; Adafactor's row/col factors and 0-d ``step`` are not the
    parameter's shape and load into a fresh Adafactor."""
    make = lambda p: torch.optim.Adafactor(p, lr=0.01)  # noqa: E731
    model, opt = _trained(1, make)
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "ckpt")

    def int_lr(groups):
        groups[0]["lr"] = 1

    _rewrite(ckpt, edit_groups=int_lr)
    fresh = make(model.parameters())
    fastckpt.load_state(model, fresh, input_dir=ckpt)
    assert fresh.param_groups[0]["lr"] == 1
    saved = opt.state_dict()["state"]
    assert_nested_equal(fresh.state_dict()["state"], saved, "Adafactor state")
    assert {tuple(v.shape) for s in saved.values() for v in s.values()} >= {(16,), ()}


def test_saved_state_of_parameters_the_live_optimizer_lacks_is_refused_under_strict(tmp_path):
    # torch's load_state_dict refuses a group of another size; a silent drop would lose saved state
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    fastckpt.save_state(model, opt, output_dir=tmp_path / "c")
    fresh = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    subset = torch.optim.AdamW(fresh[0].parameters())
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(KeyMismatchError, match=r"1\.weight"):
        fastckpt.load_state(fresh, subset, input_dir=tmp_path / "c")
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items()) and not subset.state
    fastckpt.load_state(fresh, subset, input_dir=tmp_path / "c", strict=False)  # takes what fits
    assert torch.equal(subset.state[fresh[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])

"""Stored names against live ones: a file that stores untied values for weights the live model ties is reported
or refused, never dropped silently (item 2 of issue 11); ``torch.compile``'d models save under their plain names
and either form loads into either model (item 8), through ``fastckpt.torch``, ``fastckpt.load_state`` and
accelerate's layout.
"""

from __future__ import annotations

import warnings

import pytest
import safetensors.torch as official
import torch
from helpers.common import assert_model_state, model_clone
from torch import nn

import fastckpt
import fastckpt.torch as ft


class Pair(nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        if tie:
            self.b.weight = self.a.weight


def _untied_file(tmp_path, same: bool = False):
    a = torch.arange(16.0).view(4, 4)
    b = a.clone() if same else -a
    path = tmp_path / "untied.safetensors"
    official.save_file({"a.weight": a, "b.weight": b}, path)
    return path, a


# --------------------------------------------------------------------------------------------------------------
# untied file, tied model
# --------------------------------------------------------------------------------------------------------------


def test_load_model_strict_refuses_untied_values_like_official(tmp_path):
    path, _ = _untied_file(tmp_path)
    with pytest.raises(RuntimeError) as theirs:
        official.load_model(Pair(tie=True), path)
    model = Pair(tie=True)
    before = model_clone(model)
    with pytest.raises(RuntimeError) as ours:
        ft.load_model(model, path)
    assert 'Unexpected key(s) in state_dict: "b.weight"' in str(theirs.value)
    assert 'Unexpected key(s) in state_dict: "b.weight"' in str(ours.value)
    assert_model_state(model, before)  # refused before anything was applied


def test_load_model_non_strict_reports_the_dropped_name(tmp_path):
    path, a = _untied_file(tmp_path)
    theirs = official.load_model(Pair(tie=True), path, strict=False)
    model = Pair(tie=True)
    missing, unexpected = ft.load_model(model, path, strict=False)
    assert (sorted(missing), unexpected) == (sorted(theirs[0]), theirs[1]) == ([], ["b.weight"])
    assert torch.equal(model.a.weight, a) and model.b.weight is model.a.weight


def test_identical_copies_of_a_tie_are_accepted(tmp_path):
    path, a = _untied_file(tmp_path, same=True)  # what a pickled state dict of a tied model holds
    model = Pair(tie=True)
    assert ft.load_model(model, path) == ([], [])
    assert torch.equal(model.b.weight, a) and model.b.weight is model.a.weight


def test_load_state_refuses_untied_checkpoint_into_tied_model(tmp_path):
    untied = Pair(tie=False)
    folder = fastckpt.save_state(untied, output_dir=tmp_path / "c", model_only=True)
    model = Pair(tie=True)
    before = model_clone(model)
    with pytest.raises(fastckpt.KeyMismatchError, match=r"b\.weight") as info:
        fastckpt.load_state(model, input_dir=folder, model_only=True)
    assert "different" in str(info.value)
    assert_model_state(model, before)
    result = fastckpt.load_state(model, input_dir=folder, model_only=True, strict=False)
    assert result == fastckpt.LoadResult([], ["b.weight"])
    assert torch.equal(model.a.weight, untied.a.weight) and model.b.weight is model.a.weight


def test_accelerate_bin_of_untied_model_into_tied_model(tmp_path):
    untied = Pair(tie=False)
    folder = tmp_path / "accel"
    folder.mkdir()
    torch.save(untied.state_dict(), folder / "pytorch_model.bin")
    model = Pair(tie=True)
    with pytest.raises(fastckpt.KeyMismatchError, match=r"b\.weight"):
        fastckpt.load_state(model, input_dir=folder, model_only=True)
    tied = Pair(tie=True)
    torch.save(tied.state_dict(), folder / "pytorch_model.bin")  # both names, one storage: accepted
    assert fastckpt.load_state(model, input_dir=folder, model_only=True) == ([], [])
    assert torch.equal(model.a.weight, tied.a.weight)


# --------------------------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(3, 5)
        self.head = nn.Linear(5, 2)


def _compile(model: nn.Module) -> nn.Module:
    """``_compile(model)``: only wraps (nothing is compiled until a forward, which these tests never run)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch._dynamo's first import warns about torch.jit
        return torch.compile(model)


def _trained(seed: int):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model.head(model.enc(torch.randn(4, 3))).sum().backward()
    opt.step()
    return model, opt


def test_compiled_model_saves_plain_names_and_loads_into_both(tmp_path):
    model, opt = _trained(1)
    compiled = _compile(model)
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    folder = fastckpt.save_state(compiled, opt, output_dir=tmp_path / "c")
    with official.safe_open(folder / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(model.state_dict())
    for target in ("plain", "compiled"):
        fresh, fresh_opt = _trained(2)
        dest = fresh if target == "plain" else _compile(fresh)
        assert fastckpt.load_state(dest, fresh_opt, input_dir=folder) == ([], [])
        assert_model_state(fresh, model_clone(model))
        for p, q in zip(fresh.parameters(), model.parameters()):
            assert torch.equal(fresh_opt.state[p]["exp_avg"], opt.state[q]["exp_avg"])


def test_file_with_orig_mod_names_loads_into_plain_model(tmp_path):
    model, _ = _trained(3)
    path = tmp_path / "compiled.safetensors"
    official.save_model(_compile(model), path)  # names as safetensors writes them: _orig_mod.*
    fresh, _ = _trained(4)
    assert ft.load_model(fresh, path) == ([], [])
    assert_model_state(fresh, model_clone(model))
    plain = tmp_path / "plain.safetensors"
    ft.save_model(model, plain)
    again, _ = _trained(5)
    assert ft.load_model(_compile(again), plain) == ([], [])
    assert_model_state(again, model_clone(model))
    folder = tmp_path / "hf"  # a model folder without manifest (accelerate's layout)
    folder.mkdir()
    official.save_file(_compile(model).state_dict(), folder / "model.safetensors", metadata={"format": "pt"})
    third, _ = _trained(6)
    assert fastckpt.load_state(third, input_dir=folder, model_only=True) == ([], [])
    assert_model_state(third, model_clone(model))


def test_accelerate_compiled_model_round_trip(tmp_path, new_accelerator):
    import fastckpt.accelerate

    acc = new_accelerator()
    model, opt = _trained(7)
    compiled, opt = acc.prepare(_compile(model), opt)
    folder = fastckpt.accelerate.save_state(acc, tmp_path / "c")
    with official.safe_open(folder / "model.safetensors", "pt") as f:
        assert not any("_orig_mod" in k for k in f.keys())
    acc2 = new_accelerator()
    fresh, fresh_opt = _trained(8)
    fresh, fresh_opt = acc2.prepare(fresh, fresh_opt)  # the plain model this time
    assert fastckpt.accelerate.load_state(acc2, folder) == ([], [])
    assert_model_state(acc2.unwrap_model(fresh), model_clone(model))


def test_accelerate_layouts_of_a_compiled_model(tmp_path, new_accelerator):
    import fastckpt.accelerate

    acc = new_accelerator()
    model, opt = _trained(9)
    compiled, opt = acc.prepare(_compile(model), opt)
    acc.save_state(str(tmp_path / "stock"))  # stock accelerate, from the compiled model
    ours = fastckpt.accelerate.save_state(acc, tmp_path / "compat", compat="accelerate")
    with official.safe_open(ours / "model.safetensors", "pt") as f, \
            official.safe_open(tmp_path / "stock" / "model.safetensors", "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())  # the names stock accelerate reads back into its wrapper
    for folder in (tmp_path / "stock", ours):
        acc2 = new_accelerator()
        fresh, fresh_opt = _trained(10)
        fresh, fresh_opt = acc2.prepare(fresh, fresh_opt)  # a plain model
        assert fastckpt.accelerate.load_state(acc2, folder) == ([], [])
        assert_model_state(acc2.unwrap_model(fresh), model_clone(model))
    acc3 = new_accelerator()
    again, again_opt = _trained(11)
    wrapped, again_opt = acc3.prepare(_compile(again), again_opt)
    acc3.load_state(str(ours))  # stock accelerate reads our compat folder into its compiled model
    assert_model_state(again, model_clone(model))


def test_checkpoint_with_orig_mod_names_everywhere_loads_into_plain_model(tmp_path, monkeypatch):
    """A checkpoint written by a fastckpt without unwrapping: ``_orig_mod.`` in model and optimizer names."""
    import fastckpt._state.model as model_mod
    import fastckpt._state.optimizer as optimizer_mod

    model, opt = _trained(12)
    with monkeypatch.context() as m:
        m.setattr(model_mod, "canonical_fqn", lambda name: name)
        m.setattr(optimizer_mod, "canonical_fqn", lambda name: name)
        folder = fastckpt.save_state(_compile(model), opt, output_dir=tmp_path / "old")
    with official.safe_open(folder / "optimizer.safetensors", "pt") as f:
        assert all(k.startswith("state._orig_mod.") for k in f.keys())
    fresh, fresh_opt = _trained(13)
    assert fastckpt.load_state(fresh, fresh_opt, input_dir=folder) == ([], [])
    assert_model_state(fresh, model_clone(model))
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(fresh_opt.state[p]["exp_avg_sq"], opt.state[q]["exp_avg_sq"])

"""``fastckpt convert SRC DST --to fastckpt|accelerate|hf-model [--model module:factory]``: stock accelerate output
to fastckpt (positional optimizer keys kept and recorded, or mapped to fqns through the model), fastckpt to
accelerate (read back by stock ``Accelerator.load_state``), and to a Hugging Face model folder."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest
import safetensors.torch as st
import torch
from helpers.accelerate_state import assert_restored, draws, prepared_state, snapshot
from helpers.common import assert_model_state, assert_nested_equal, batches, make_training_state, model_clone, train

import fastckpt
from fastckpt.cli import main


@pytest.fixture
def stock(tmp_path, new_accelerator):
    acc = new_accelerator()
    model, opt, sched = prepared_state(acc, 3, steps=2)
    acc.save_state(tmp_path / "stock")
    return tmp_path / "stock", snapshot(model, opt, sched), draws()


@pytest.fixture
def factory(tmp_path, monkeypatch):
    """A module ``ckpt_models`` in the working directory: ``build()`` (TinyNet) and ``wrong()`` (other shapes)."""
    (tmp_path / "ckpt_models.py").write_text(textwrap.dedent("""
        import torch
        from helpers.common import TinyNet

        def build():
            return TinyNet()

        def wrong():
            return TinyNet(d_hidden=5)

        def with_groups():
            m = TinyNet()
            params = list(m.parameters())
            return m, torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:]}])
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    yield "ckpt_models"
    sys.modules.pop("ckpt_models", None)


def test_accelerate_to_fastckpt_keeps_positional_keys_and_says_so(tmp_path, stock, capsys):
    src, expected, after_save = stock
    assert main(["convert", str(src), str(tmp_path / "fc")]) == 0
    assert "positional" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "fc" / "fastckpt.json").read_text())
    assert manifest["optimizer_keys"] == "positional" and manifest["mode"] == "full"
    assert sorted(p.name for p in (tmp_path / "fc").iterdir()) == [
        "fastckpt.json", "model.safetensors", "optimizer.safetensors", "random_states_0.safetensors",
        "scheduler.json",
    ]
    assert "state.#0.exp_avg" in st.load_file(tmp_path / "fc" / "optimizer.safetensors")
    model, opt, sched = make_training_state(40)
    draws()
    fastckpt.load_state(model, opt, sched, input_dir=tmp_path / "fc")
    assert_restored(model, opt, sched, expected)
    assert draws() == after_save


def test_accelerate_to_fastckpt_with_the_model_keys_by_fqn(tmp_path, stock, factory):
    src, expected, _ = stock
    assert main(["convert", str(src), str(tmp_path / "fc"), "--model", f"{factory}:build"]) == 0
    assert "optimizer_keys" not in json.loads((tmp_path / "fc" / "fastckpt.json").read_text())
    assert "state.fc1.weight.exp_avg" in st.load_file(tmp_path / "fc" / "optimizer.safetensors")
    model, opt, sched = make_training_state(41)
    fastckpt.load_state(model, opt, sched, input_dir=tmp_path / "fc")
    assert_restored(model, opt, sched, expected)


def test_model_that_does_not_fit_the_positions_is_refused(tmp_path, stock, factory, capsys):
    src, _, _ = stock
    assert main(["convert", str(src), str(tmp_path / "fc"), "--model", f"{factory}:wrong"]) == 2
    err = capsys.readouterr().err
    assert "ShapeMismatchError" in err and "exp_avg" in err
    assert main(["convert", str(src), str(tmp_path / "fc"), "--model", f"{factory}:with_groups"]) == 2
    assert "KeyMismatchError: optimizer 0: saved param_groups have sizes [6], the factory's optimizer [3, 3]" in \
        capsys.readouterr().err
    assert not (tmp_path / "fc").exists()


def test_fastckpt_to_accelerate_is_read_by_stock_accelerate(tmp_path, new_accelerator):
    model, opt, sched = make_training_state(5)
    train(model, opt, sched, batches(3))
    fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "fc", max_shard_size=200, step=6)
    expected = snapshot(model, opt, sched)
    after_save = draws()
    assert main(["convert", str(tmp_path / "fc"), str(tmp_path / "acc"), "--to", "accelerate"]) == 0
    assert sorted(p.name for p in (tmp_path / "acc").iterdir()) == [
        "fastckpt.json", "model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin",
    ]
    acc = new_accelerator()
    model2, opt2, sched2 = prepared_state(acc, 50)
    draws()
    acc.load_state(str(tmp_path / "acc"))
    assert_restored(model2, opt2, sched2, expected)
    assert acc.step == 6
    assert draws() == after_save


def test_round_trip_through_both_layouts_is_exact(tmp_path, stock):
    src, _, _ = stock
    assert main(["convert", str(src), str(tmp_path / "fc")]) == 0
    assert main(["convert", str(tmp_path / "fc"), str(tmp_path / "back"), "--to", "accelerate"]) == 0
    for name in ("optimizer.bin", "scheduler.bin"):
        assert_nested_equal(torch.load(tmp_path / "back" / name, weights_only=False),
                            torch.load(src / name, weights_only=False), name)
    rng, original = (torch.load(d / "random_states_0.pkl", weights_only=False) for d in (tmp_path / "back", src))
    assert list(rng) == list(original)
    assert rng["step"] == original["step"] and rng["random_state"] == original["random_state"]
    assert torch.equal(rng["torch_manual_seed"], original["torch_manual_seed"])
    (kind, keys, *rest), (okind, okeys, *orest) = rng["numpy_random_seed"], original["numpy_random_seed"]
    assert kind == okind and rest == orest and keys.dtype == okeys.dtype and np.array_equal(keys, okeys)
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_to_hf_model(tmp_path):
    model, opt, sched = make_training_state(7)
    fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "fc")
    assert main(["convert", str(tmp_path / "fc"), str(tmp_path / "hf"), "--to", "hf-model",
                 "--max-shard-size", "300"]) == 0
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "model.safetensors.index.json" in names and not any(n.startswith(("optimizer", "random")) for n in names)
    fresh = make_training_state(8)[0]
    fastckpt.load_state(fresh, input_dir=tmp_path / "hf")  # a model-only checkpoint
    assert_model_state(fresh, model_clone(model))


def test_unreadable_source_exits_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "MissingStateError" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

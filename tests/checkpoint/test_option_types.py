"""save_state / load_state refuse options of the wrong type before anything is written or read, with fastckpt's
OptionTypeError / OptionError naming the option (as the CheckpointManager does): a truthy string such as
``model_only="no"`` saved only the weights, and ``load_state(model_only="no")`` left the optimizer unrestored."""

from __future__ import annotations

import pytest
import torch

import fastckpt
from fastckpt.errors import OptionError, OptionTypeError


def _state():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, opt


@pytest.mark.parametrize("flag", ["model_only", "durable", "trainable_only", "share_unchanged"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_a_save_flag_that_is_not_a_bool_is_refused_before_writing(tmp_path, flag, value):
    model, opt = _state()
    with pytest.raises(OptionTypeError, match=f"{flag} must be True or False"):
        fastckpt.save_state(model, opt, output_dir=tmp_path / "ck", **{flag: value})
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("flag", ["model_only", "strict", "trust_pickle", "verify", "cast"])
def test_a_load_flag_that_is_not_a_bool_is_refused_before_anything_changes(tmp_path, flag):
    model, opt = _state()
    fastckpt.save_state(model, opt, output_dir=tmp_path / "ck")
    for group in opt.param_groups:
        group["lr"] = 0.25
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    changed = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(OptionTypeError, match=f"{flag} must be True or False"):
        fastckpt.load_state(model, opt, input_dir=tmp_path / "ck", **{flag: "no"})
    assert all(torch.equal(p, c) for p, c in zip(model.parameters(), changed))
    assert opt.param_groups[0]["lr"] == 0.25
    fastckpt.load_state(model, opt, input_dir=tmp_path / "ck", model_only=False)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.param_groups[0]["lr"] == 0.5


def test_a_folder_that_is_no_path_and_bad_numbers_are_fastckpt_option_errors(tmp_path):
    model, opt = _state()
    with pytest.raises(OptionTypeError, match="output_dir must be a path"):
        fastckpt.save_state(model, opt, output_dir=123)
    with pytest.raises(OptionTypeError, match="input_dir must be a path"):
        fastckpt.load_state(model, opt, input_dir=123)
    for kw, match in (({"threads": -1}, "threads"), ({"step": -1}, "step"), ({"total_limit": 0}, "total_limit")):
        with pytest.raises(OptionError, match=match) as info:
            fastckpt.save_state(model, opt, output_dir=tmp_path / "ck", **kw)
        assert isinstance(info.value, ValueError)  # the contract before these were fastckpt's: still a ValueError
    with pytest.raises(OptionError, match="map_location"):
        fastckpt.load_state(model, opt, input_dir=tmp_path / "ck", map_location="nowhere")
    assert not (tmp_path / "ck").exists()


def test_fastckpt_save_and_load_refuse_flags_that_are_not_bools(tmp_path):
    with pytest.raises(OptionTypeError, match="durable must be True or False"):
        fastckpt.save({"step": 1}, tmp_path / "d", durable="no")
    assert not (tmp_path / "d").exists()
    fastckpt.save({"step": 1}, tmp_path / "d")
    with pytest.raises(OptionTypeError, match="verify must be True or False"):
        fastckpt.load(tmp_path / "d", verify="no")
    with pytest.raises(OptionError, match="threads"):
        fastckpt.load(tmp_path / "d", threads=-1)
    with pytest.raises(OptionError, match="map_location"):
        fastckpt.load(tmp_path / "d", map_location="nowhere")
    assert fastckpt.load(tmp_path / "d") == {"step": 1}


@pytest.mark.parametrize("call,error,match", [
    (lambda p, m, o: fastckpt.save_state(None, output_dir=p), OptionTypeError, "model is None"),
    (lambda p, m, o: fastckpt.save_state("x", output_dir=p), OptionTypeError, r"model\[0\] is a str"),
    (lambda p, m, o: fastckpt.save_state(m, o, output_dir=p, threads="4"), OptionTypeError, "threads must be an int"),
    (lambda p, m, o: fastckpt.save_state(m, o, output_dir=p, async_save="yes"), OptionError, "async_save must be"),
    (lambda p, m, o: fastckpt.save_state(m, o, output_dir=p, dtype="bf16"), OptionError, "dtype must be"),
    (lambda p, m, o: fastckpt.save_state(m, o, output_dir=""), OptionError, "empty path"),
    (lambda p, m, o: fastckpt.load_state(None, input_dir=p), OptionTypeError, "model is None"),
    (lambda p, m, o: fastckpt.load_state({"a": 1}, input_dir=p), OptionTypeError, r"model\[0\] is a dict"),
    (lambda p, m, o: fastckpt.load_state(m, o, input_dir=p, threads=2.0), OptionTypeError, "threads must be an int"),
], ids=["save None", "save str", "threads str", "async_save yes", "dtype str", "empty folder", "load None",
        "load dict", "load threads float"])
def test_wrong_objects_and_option_values_are_fastckpt_option_errors(tmp_path, call, error, match):
    """A new user's pass: these were bare TypeError / ValueError (still caught as such: OptionTypeError is a
    TypeError, OptionError a ValueError); a wrongly typed ``threads`` was an OptionError, which ``except TypeError``
    missed."""
    model, opt = _state()
    fastckpt.save_state(model, opt, output_dir=tmp_path / "ck")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(error, match=match) as info:
        call(tmp_path / "ck", model, opt)
    assert type(info.value) is error
    assert sorted(p.name for p in tmp_path.rglob("*")) == before

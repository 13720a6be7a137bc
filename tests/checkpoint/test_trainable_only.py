"""``trainable_only``: only parameters with ``requires_grad`` (and named buffers) are written, the frozen rest is
recorded by name, dtype, shape and xxh3-128 and checked on load; a mismatch raises FrozenWeightsError before
anything changes; ``strict=False`` loads the trainable part and reports the frozen names."""

from __future__ import annotations

import json

import pytest
import safetensors.torch as official
import torch
from helpers.common import assert_tensor_dicts_identical, model_clone
from helpers.finetune import make_frozen_base, trained

import fastckpt
from fastckpt._io.tensor_hashes import content_hashes
from fastckpt.errors import FrozenWeightsError, KeyMismatchError

TRAINABLE = {"head.weight", "head.bias"}
_NAMES = {torch.float32: "F32", torch.int64: "I64"}


def _saved(tmp_path, **kwargs):
    model = make_frozen_base(0, head_seed=1)
    opt = trained(model)
    path = fastckpt.save_state(model, opt, output_dir=tmp_path / "ckpt", trainable_only=True, **kwargs)
    return model, opt, path


def test_only_trainable_tensors_are_written_and_frozen_ones_recorded(tmp_path):
    model, _opt, path = _saved(tmp_path)
    stored = official.load_file(path / "model.safetensors")
    assert set(stored) == TRAINABLE
    assert_tensor_dicts_identical(stored, {k: model.state_dict()[k] for k in sorted(TRAINABLE)}, ordered=False)
    manifest = json.loads((path / "fastckpt.json").read_text())
    assert manifest["trainable_only"] is True
    frozen = manifest["frozen"]["model"]
    live = model.state_dict(keep_vars=True)
    assert set(frozen) == set(live) - TRAINABLE
    want = content_hashes({n: live[n] for n in frozen})
    for name, info in frozen.items():
        assert info == {"dtype": _NAMES[live[name].dtype], "shape": list(live[name].shape), "xxh3": want[name]}
    assert frozen["base.0.weight"]["dtype"] == "F32" and frozen["base.3.num_batches_tracked"]["dtype"] == "I64"


def test_round_trip_into_the_same_base_is_bit_exact(tmp_path):
    model, opt, path = _saved(tmp_path)
    expected_model, expected_opt = model_clone(model), opt.state_dict()
    fresh = make_frozen_base(0, head_seed=99)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    result = fastckpt.load_state(fresh, fresh_opt, input_dir=path)
    assert result == ([], [])
    assert_tensor_dicts_identical(fresh.state_dict(), expected_model)
    got = fresh_opt.state_dict()
    for k, v in expected_opt["state"].items():
        for key in v:
            assert torch.equal(got["state"][k][key], v[key]), (k, key)
    assert got["param_groups"] == expected_opt["param_groups"]


def test_another_base_raises_frozen_weights_error_and_changes_nothing(tmp_path):
    _model, _opt, path = _saved(tmp_path)
    other = make_frozen_base(5, head_seed=99)
    before = model_clone(other)
    with pytest.raises(FrozenWeightsError, match=r"frozen tensor 'base\.0\.weight'.*differs"):
        fastckpt.load_state(other, input_dir=path, model_only=True)
    assert_tensor_dicts_identical(other.state_dict(), before)
    assert issubclass(FrozenWeightsError, ValueError)


def test_a_frozen_tensor_changed_in_place_after_hashing_is_detected(tmp_path):
    model, _opt, path = _saved(tmp_path)
    target = make_frozen_base(0, head_seed=99)
    fastckpt.load_state(target, input_dir=path, model_only=True)  # hashes (and remembers) the frozen tensors
    with torch.no_grad():
        target.base[2].bias[3] += 1.0  # bumps the version counter: the remembered hash is not used
    with pytest.raises(FrozenWeightsError, match=r"'base\.2\.bias'"):
        fastckpt.load_state(target, input_dir=path, model_only=True)


def test_shape_and_missing_frozen_tensors_are_named(tmp_path):
    _model, _opt, path = _saved(tmp_path)
    target = make_frozen_base(0)
    del target.base[3]  # no BatchNorm: its buffers are recorded but absent
    with pytest.raises(FrozenWeightsError, match=r"'base\.3\.weight'.*not in FrozenBaseNet"):
        fastckpt.load_state(target, input_dir=path, model_only=True)


def test_strict_false_loads_the_trainable_part_and_reports_frozen_names(tmp_path):
    model, _opt, path = _saved(tmp_path)
    other = make_frozen_base(5, head_seed=99)
    base_before = {k: v.clone() for k, v in other.state_dict().items() if k not in TRAINABLE}
    result = fastckpt.load_state(other, input_dir=path, model_only=True, strict=False)
    assert sorted(result.missing_keys) == sorted(set(model.state_dict()) - TRAINABLE)
    assert result.unexpected_keys == []
    for k in TRAINABLE:
        assert torch.equal(other.state_dict()[k], model.state_dict()[k])
    assert_tensor_dicts_identical({k: v for k, v in other.state_dict().items() if k not in TRAINABLE}, base_before)


def test_named_buffers_are_written_and_unknown_ones_refused(tmp_path):
    model = make_frozen_base(0, head_seed=1)
    path = fastckpt.save_state(model, output_dir=tmp_path / "w", model_only=True, trainable_only=True,
                               trainable_buffers=["base.3.running_mean", "base.3.running_var"])
    assert set(official.load_file(path / "model.safetensors")) == TRAINABLE | {"base.3.running_mean",
                                                                                 "base.3.running_var"}
    assert (path / "fastckpt.json").is_file() and not (path / "optimizer.safetensors").exists()
    with pytest.raises(KeyMismatchError, match="base.3.nope"):
        fastckpt.save_state(model, output_dir=tmp_path / "x", trainable_only=True, trainable_buffers=["base.3.nope"])
    assert not (tmp_path / "x").exists()


def test_model_only_trainable_only_round_trip(tmp_path):
    model = make_frozen_base(0, head_seed=1)
    path = fastckpt.save_state(model, output_dir=tmp_path / "w", model_only=True, trainable_only=True)
    assert sorted(p.name for p in path.iterdir()) == ["fastckpt.json", "model.safetensors"]
    target = make_frozen_base(0, head_seed=2)
    assert fastckpt.load_state(target, input_dir=path, model_only=True) == ([], [])
    assert_tensor_dicts_identical(target.state_dict(), model.state_dict())
    assert fastckpt.verify_checkpoint(path).hashes_checked == 2


def test_a_malformed_frozen_record_is_a_header_error(tmp_path):
    _model, _opt, path = _saved(tmp_path)
    manifest = json.loads((path / "fastckpt.json").read_text())
    for bad in ([1, 2], {"model": {"base.0.weight": {"dtype": "F32", "shape": [16, -1], "xxh3": "0" * 32}}},
                {"model": {"base.0.weight": {"dtype": "F32", "shape": [16, 16], "xxh3": "zz"}}}):
        (path / "fastckpt.json").write_text(json.dumps({**manifest, "frozen": bad}))
        with pytest.raises(fastckpt.HeaderError, match="frozen"):
            fastckpt.load_state(make_frozen_base(0), input_dir=path, model_only=True)

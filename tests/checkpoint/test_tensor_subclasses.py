"""C32 (optimum-quanto#100, ao#2478), issue 27 item 5: tensor subclasses in a model.

A traceable wrapper subclass (int8 data + per-row scale here, written by hand; torchao's quantized tensors when
torchao is installed) round-trips exactly and pickle-free: its inner tensors are safetensors entries
(``0._weight_qdata``), its flatten context JSON in the metadata, and a load fills the live subclass in place. Any
other subclass is a TensorSubclassError naming the tensor and its type, raised before anything is written; a
load into a model of another class or settings is refused before anything changes. Float8 training (torchao's
Float8Linear: plain parameters) keeps saving and loading exactly.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from torch.utils._pytree import tree_map

import fastckpt
from fastckpt.errors import CheckpointError, TensorSubclassError


class Int8Weight(torch.Tensor):
    """A quanto-style weight: int8 ``qdata`` and a per-row float ``scale``; any op sees the dequantized values."""

    @staticmethod
    def __new__(cls, qdata, scale, dtype=torch.float32, group=1):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata, scale, dtype=torch.float32, group=1):
        self.qdata, self.scale, self.group = qdata, scale, group

    def __tensor_flatten__(self):
        return ["qdata", "scale"], {"dtype": self.dtype, "group": self.group}

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["qdata"], inner["scale"], ctx["dtype"], ctx["group"])

    def dequantize(self):
        return self.qdata.to(self.dtype) * self.scale[:, None]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return cls(args[0].qdata, args[0].scale, args[0].dtype, args[0].group)
        unwrap = lambda t: t.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class Tagged(torch.Tensor):
    """A subclass with real storage whose type (and ``tag``) a plain entry would lose."""


def _quantized(seed: int, *, group: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    q = torch.randint(-128, 128, (3, 4), dtype=torch.int8, generator=g)
    model[0].weight = torch.nn.Parameter(Int8Weight(q, torch.rand(3, generator=g), group=group), requires_grad=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return model, opt


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt = _quantized(0)
    model(torch.ones(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_wrapper_subclass_round_trips_exactly_and_pickle_free(tmp_path):
    model, opt = _trained()
    fastckpt.save_state(model, opt, output_dir=tmp_path / "ckpt")
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == ["0._weight_qdata", "0._weight_scale", "0.bias", "2.bias", "2.weight"]
        meta = f.metadata()
        assert torch.equal(f.get_tensor("0._weight_qdata"), model[0].weight.qdata)
    assert json.loads(meta["tensor_names"]) == ["0.weight"]
    assert json.loads(meta["0.weight"]) == {
        "_type": f"{__name__}.Int8Weight", "_data": {"dtype": {"__torch_dtype__": "float32"}, "group": 1},
        "_tensor_data_names": ["qdata", "scale"], "_shape": [3, 4], "_dtype": "float32"}
    for path in (tmp_path / "ckpt").rglob("*"):
        assert not path.read_bytes().startswith(b"\x80"), path  # no pickle anywhere

    fresh, fresh_opt = _quantized(1)
    result = fastckpt.load_state(fresh, fresh_opt, input_dir=tmp_path / "ckpt")
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert type(fresh[0].weight) is Int8Weight and fresh[0].weight.group == 1
    assert torch.equal(fresh[0].weight.qdata, model[0].weight.qdata)
    assert torch.equal(fresh[0].weight.scale, model[0].weight.scale)
    for a, b in zip([model[0].bias, model[2].weight, model[2].bias], [fresh[0].bias, fresh[2].weight, fresh[2].bias]):
        assert torch.equal(a, b)
    assert all(torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
               for p, q in zip(opt.param_groups[0]["params"], fresh_opt.param_groups[0]["params"]))
    x = torch.randn(2, 4)
    assert torch.equal(model(x), fresh(x))


def test_a_subclass_without_tensor_flatten_is_refused_before_anything_is_written(tmp_path):
    model = torch.nn.Linear(4, 3)
    model.weight = torch.nn.Parameter(torch.ones(3, 4).as_subclass(Tagged))
    with pytest.raises(TensorSubclassError) as info:
        fastckpt.save_state(model, model_only=True, output_dir=tmp_path / "ckpt")
    assert str(info.value).startswith(f"'weight' is a {__name__}.Tagged (a tensor subclass of Linear without "
                                      "__tensor_flatten__, whose type and attributes a plain tensor entry would lose)")
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, TypeError)
    assert os.listdir(tmp_path) == []  # no folder, no staging leftovers


def test_a_flatten_context_json_cannot_hold_is_refused_naming_tensor_and_type(tmp_path):
    model, _ = _quantized(0)
    model[0].weight.group = object()
    with pytest.raises(TensorSubclassError, match=rf"^'0.weight' is a {__name__}.Int8Weight whose flatten context "
                                                  r"cannot be stored without pickle \(context.group is a builtins.object"):
        fastckpt.save_state(model, model_only=True, output_dir=tmp_path / "ckpt")
    assert os.listdir(tmp_path) == []


def test_a_load_into_a_plain_or_differently_quantized_model_changes_nothing(tmp_path):
    model, _ = _trained()
    fastckpt.save_state(model, model_only=True, output_dir=tmp_path / "ckpt")
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    with pytest.raises(TensorSubclassError, match=rf"model.safetensors: '0.weight' was saved as a {__name__}.Int8Weight "
                                                  r"\(inner tensors \['qdata', 'scale'\]\); Sequential has a plain "
                                                  r"torch.float32 tensor there"):
        fastckpt.load_state(plain, input_dir=tmp_path / "ckpt", model_only=True)
    assert all(torch.equal(before[k], v) for k, v in plain.state_dict().items())
    other, _ = _quantized(1, group=2)
    q_before = other[0].weight.qdata.clone()
    with pytest.raises(TensorSubclassError, match=r"'0.weight' was saved as a .*Int8Weight with _data .*'group': 1.*"
                                                  r"Sequential has a .*Int8Weight with _data .*'group': 2"):
        fastckpt.load_state(other, input_dir=tmp_path / "ckpt", model_only=True)
    assert torch.equal(other[0].weight.qdata, q_before)
    plain_ckpt = tmp_path / "plain"
    fastckpt.save_state(plain, model_only=True, output_dir=plain_ckpt)
    with pytest.raises(TensorSubclassError, match=r"^'0.weight' is stored as a plain tensor but is a .*Int8Weight in "
                                                  r"Sequential"):
        fastckpt.load_state(other, input_dir=plain_ckpt, model_only=True)
    assert torch.equal(other[0].weight.qdata, q_before)


@pytest.mark.filterwarnings("ignore")
def test_torchao_quantized_weights_round_trip_exactly(tmp_path):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    for i, config in enumerate([Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig()]):
        models = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
            quantize_(m, config)
            models.append(m)
        fastckpt.save_state(models[0], model_only=True, output_dir=tmp_path / str(i))
        fastckpt.load_state(models[1], input_dir=tmp_path / str(i), model_only=True)
        for name, a in models[0].state_dict().items():
            b = models[1].state_dict()[name]
            assert type(a) is type(b), name
            inner = a.__tensor_flatten__()[0] if hasattr(a, "__tensor_flatten__") else []
            assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in inner) if inner else torch.equal(a, b)
        x = torch.randn(3, 64)
        assert torch.equal(models[0](x), models[1](x))
        shutil.rmtree(tmp_path / str(i))


@pytest.mark.filterwarnings("ignore")
def test_torchao_float8_training_saves_and_resumes_exactly(tmp_path):
    pytest.importorskip("torchao")
    from torchao.float8 import convert_to_float8_training

    def build(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
        convert_to_float8_training(m)
        return m, torch.optim.AdamW(m.parameters(), lr=0.01)

    model, opt = build(0)
    model(torch.randn(16, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    fastckpt.save_state(model, opt, output_dir=tmp_path / "f8")
    fresh, fresh_opt = build(1)
    fastckpt.load_state(fresh, fresh_opt, input_dir=tmp_path / "f8")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    x = torch.randn(16, 64)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


@pytest.mark.parametrize("kwargs", [{"trainable_only": True}, {"compat": "accelerate"}],
                         ids=["trainable_only", "accelerate"])
def test_saves_that_cannot_record_a_subclass_refuse_it_before_writing(tmp_path, kwargs):
    model, opt = _trained()
    with pytest.raises(TensorSubclassError, match=rf"^tensor subclass\(es\) '0.weight' \({__name__}.Int8Weight\): "):
        fastckpt.save_state(model, opt, output_dir=tmp_path / "ckpt", **kwargs)
    assert os.listdir(tmp_path) == []

"""Conversion while writing (``save_state(..., model_only=True, dtype=...)`` and the core's seventh source entry):
every non-NaN value bit-identical to torch's ``Tensor.to`` for every pair of F64 / F32 / F16 / BF16 (random bit
patterns: normals, subnormals, signed zeros, infinities, overflow), NaN stays NaN; strided sources; integer and
bool tensors unchanged; the manifest and config.json say the dtype; a full training state refuses ``dtype``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.torch as official
import torch
from helpers.common import make_tiny, make_training_state

import fastckpt
from fastckpt import _core
from fastckpt._format.tensors import tensor_source
from fastckpt.errors import DtypeError

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _random_bits(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` values of ``dtype`` with uniformly random bit patterns, plus the special values at the front."""
    rng = np.random.default_rng(seed)
    size = dtype.itemsize
    raw = torch.from_numpy(rng.integers(0, 256, n * size, dtype=np.uint8)).view(INT_OF[size]).view(dtype).clone()
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 65504.0, 65520.0,
                             3.4e38, 1e-45, 6e-8, 1e-40, 1.5, 2.0**-24, 2.0**-25, 2.0**-133], dtype=torch.float64)
    raw[: len(specials)] = specials.to(dtype)
    return raw


def _converted(src: torch.Tensor, to: torch.dtype) -> torch.Tensor:
    source = tensor_source("t", src, NAMES[to])
    data = _core.serialize([source], None)
    (_name, dtype, shape, begin, end), = _core.parse_header(data)[1]
    assert dtype == NAMES[to] and shape == list(src.shape)
    start = len(data) - (end - begin)
    return torch.frombuffer(bytearray(data[start:]), dtype=to).view(src.shape)


def _assert_same_as_torch(got: torch.Tensor, src: torch.Tensor, to: torch.dtype) -> None:
    want = src.to(to)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN exactly where torch has NaN"
    ints = INT_OF[to.itemsize]
    assert torch.equal(got.view(ints)[~nan], want.view(ints)[~nan]), f"{src.dtype} -> {to}: bits differ"


@pytest.mark.parametrize("src_dtype", FLOATS, ids=NAMES.get)
@pytest.mark.parametrize("to", FLOATS, ids=NAMES.get)
def test_every_float_pair_is_bit_identical_to_torch(src_dtype, to):
    src = _random_bits(src_dtype, 50_003, seed=src_dtype.itemsize * 10 + to.itemsize)
    _assert_same_as_torch(_converted(src, to), src, to)


def test_every_f16_and_bf16_bit_pattern_converts_like_torch():
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for half in (torch.float16, torch.bfloat16):
        src = every.view(half)
        for to in FLOATS:
            _assert_same_as_torch(_converted(src, to), src, to)


def test_strided_and_offset_sources_convert_in_logical_order():
    base = _random_bits(torch.float32, 64 * 48, seed=3).view(64, 48)
    for view in (base.t(), base[3:50:2, 5:40], base[:, 7]):
        _assert_same_as_torch(_converted(view, torch.bfloat16), view.contiguous(), torch.bfloat16)


def test_float8_sources_are_refused_naming_the_tensor():
    with pytest.raises(DtypeError, match="'q'.*F8_E4M3"):
        tensor_source("q", torch.zeros(4, dtype=torch.float8_e4m3fn), "BF16")


class _WithBuffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 7)
        self.register_buffer("ids", torch.arange(6, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("scale16", torch.randn(3).to(torch.float16))


@pytest.mark.parametrize("to", [torch.bfloat16, torch.float16, torch.float32])
def test_model_only_export_converts_floats_and_keeps_integers(tmp_path, to):
    model = _WithBuffers()
    path = fastckpt.save_state(model, output_dir=tmp_path / "w", model_only=True, dtype=to)
    stored = official.load_file(path / "model.safetensors")
    for name, live in model.state_dict().items():
        want = live.to(to) if live.is_floating_point() else live
        assert stored[name].dtype == want.dtype and torch.equal(stored[name].view(-1).view(torch.uint8),
                                                                 want.reshape(-1).view(torch.uint8)), name
    manifest = json.loads((path / "fastckpt.json").read_text())
    assert manifest["dtype"] == str(to).removeprefix("torch.")
    assert fastckpt.verify_checkpoint(path).hashes_checked == len(stored)
    target = _WithBuffers().to(to)
    target.ids, target.mask = model.ids.clone(), model.mask.clone()
    fastckpt.load_state(target, input_dir=path, model_only=True)
    assert torch.equal(target.lin.weight, model.lin.weight.to(to))


def test_config_json_says_the_dtype(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8, bos_token_id=0,
                                     eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    path = fastckpt.save_state(model, output_dir=tmp_path / "hf", model_only=True, dtype=torch.bfloat16)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.GPT2LMHeadModel.from_pretrained(path)
    assert loaded.transformer.wte.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight.to(torch.bfloat16))


def test_a_full_training_state_refuses_dtype(tmp_path):
    model, opt, sched = make_training_state(0)
    with pytest.raises(ValueError, match="model_only=True"):
        fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be"):
        fastckpt.save_state(make_tiny(0), output_dir=tmp_path / "c", model_only=True, dtype=torch.int8)
    assert not (tmp_path / "c").exists()

"""PEFT: ``model_only=True, trainable_only=True`` on a PeftModel writes the folder ``PeftModel.save_pretrained``
writes (same adapter_model.safetensors bytes, same adapter_config.json), ``PeftModel.from_pretrained`` and
``fastckpt.load_state`` load it bit-exact; a full trainable-only save holds only adapter + optimizer state.
Tiny GPT-2 built from a config with LoRA rank 8 (no network)."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch as official
import torch
from helpers.common import assert_tensor_dicts_identical

import fastckpt

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
# peft 0.21 calls a transformers 5 API that warns it is deprecated
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _base(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _lora(seed: int = 0, *, train_seed: int = 3):
    model = peft.get_peft_model(_base(seed), peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                                                             lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(train_seed)
    for _ in range(2):
        opt.zero_grad()
        ids = torch.randint(0, 64, (2, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return model, opt


def _adapter(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def test_adapter_folder_is_what_save_pretrained_writes(tmp_path):
    model, _opt = _lora()
    path = fastckpt.save_state(model, output_dir=tmp_path / "fast", model_only=True, trainable_only=True)
    model.save_pretrained(tmp_path / "peft")
    assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors", "fastckpt.json"]
    ours = (path / "adapter_model.safetensors").read_bytes()
    theirs = (tmp_path / "peft" / "adapter_model.safetensors").read_bytes()
    assert ours == theirs
    assert json.loads((path / "adapter_config.json").read_text()) == \
        json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (path / "adapter_config.json").read_text() == (tmp_path / "peft" / "adapter_config.json").read_text()
    keys = set(official.load_file(path / "adapter_model.safetensors"))
    assert keys and all(".default." not in k and "lora_" in k for k in keys)
    assert fastckpt.verify_checkpoint(path).ok


def test_from_pretrained_and_load_state_restore_it_bit_exact(tmp_path):
    model, _opt = _lora()
    path = fastckpt.save_state(model, output_dir=tmp_path / "fast", model_only=True, trainable_only=True)
    loaded = peft.PeftModel.from_pretrained(_base(0), str(path))
    assert_tensor_dicts_identical(_adapter(loaded), _adapter(model), ordered=False)
    fresh = peft.get_peft_model(_base(0), peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                                                          lora_dropout=0.0))
    assert fastckpt.load_state(fresh, input_dir=path, model_only=True) == ([], [])
    assert_tensor_dicts_identical(fresh.state_dict(), model.state_dict())
    with pytest.raises(fastckpt.FrozenWeightsError):  # another base model under the same adapter
        fastckpt.load_state(peft.get_peft_model(_base(1), peft.LoraConfig(r=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)),
                            input_dir=path, model_only=True)


def test_full_trainable_only_save_is_adapter_plus_optimizer(tmp_path):
    model, opt = _lora()
    full = fastckpt.save_state(model, opt, output_dir=tmp_path / "full")
    small = fastckpt.save_state(model, opt, output_dir=tmp_path / "small", trainable_only=True)
    adapter_bytes = sum(v.numel() * v.element_size() for v in _adapter(model).values())
    tensors = official.load_file(small / "model.safetensors")
    assert set(tensors) == set(_adapter(model))
    model_bytes = (small / "model.safetensors").stat().st_size
    opt_bytes = (small / "optimizer.safetensors").stat().st_size
    assert adapter_bytes <= model_bytes < adapter_bytes * 1.05 + 65536
    assert opt_bytes < 2 * adapter_bytes * 1.05 + 65536  # exp_avg + exp_avg_sq of the adapter only
    assert (full / "model.safetensors").stat().st_size > 5 * model_bytes
    resumed, resumed_opt = _lora(train_seed=9)
    fastckpt.load_state(resumed, resumed_opt, input_dir=small)
    assert_tensor_dicts_identical(resumed.state_dict(), model.state_dict())

"""A model-only checkpoint of a transformers model is a Hugging Face model folder: ``AutoModel*.from_pretrained``
and accelerate's ``load_checkpoint_in_model`` read it (one file or shards, tied embeddings kept tied), and fastckpt
reads ``save_pretrained``'s output. Tiny GPT-2 built from a config: no downloads."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate.utils import load_checkpoint_in_model
from helpers.common import assert_model_state, model_clone
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import fastckpt
import fastckpt.accelerate


def _config() -> GPT2Config:
    return GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2)


def _model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(_config()).eval()


@pytest.mark.parametrize("max_shard_size", [None, "8KB"], ids=["one-file", "sharded"])
def test_model_only_checkpoint_loads_with_from_pretrained(tmp_path, max_shard_size):
    model = _model(1)
    ckpt = fastckpt.save_state(model, model_only=True, output_dir=tmp_path / "m", max_shard_size=max_shard_size)
    sharded = (ckpt / "model.safetensors.index.json").is_file()
    assert sharded == (max_shard_size is not None)
    assert json.loads((ckpt / "config.json").read_text())["n_embd"] == 16
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert type(loaded) is GPT2LMHeadModel
    assert_model_state(loaded, model_clone(model))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # stored once, re-tied by transformers
    ids = torch.tensor([[3, 4, 5]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("max_shard_size", [None, "8KB"], ids=["one-file", "sharded"])
def test_model_only_checkpoint_loads_with_load_checkpoint_in_model(tmp_path, max_shard_size):
    model = _model(2)
    ckpt = fastckpt.save_state(model, model_only=True, output_dir=tmp_path / "m", max_shard_size=max_shard_size)
    fresh = _model(3)
    load_checkpoint_in_model(fresh, str(ckpt))
    assert_model_state(fresh, model_clone(model))


def test_accelerate_api_model_only_is_a_hugging_face_folder(tmp_path, new_accelerator):
    acc = new_accelerator()
    model = acc.prepare(_model(4))
    path = fastckpt.accelerate.save_state(acc, tmp_path / "m", model_only=True, max_shard_size="8KB")
    assert (path / "config.json").is_file() and (path / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert_model_state(loaded, model_clone(acc.unwrap_model(model)))


def test_fastckpt_reads_save_pretrained_output(tmp_path):
    model = _model(5)
    model.save_pretrained(tmp_path / "hf", max_shard_size="8KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    fresh = _model(6)
    assert fastckpt.load_state(fresh, input_dir=tmp_path / "hf", model_only=True) == ([], [])
    assert_model_state(fresh, model_clone(model))
    assert fresh.lm_head.weight is fresh.transformer.wte.weight

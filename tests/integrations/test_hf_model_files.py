"""A model-only folder holds what ``save_pretrained`` writes beside the weights: ``config.json`` and
``generation_config.json`` (so ``from_pretrained`` keeps ``max_new_tokens``, sampling settings, eos / pad ids),
through every entry point (``fastckpt.save_state``, ``fastckpt.accelerate.save_state`` in both layouts, ``convert
--to hf-model``), and nothing that needs pickle. Tiny GPT-2 from a config: no downloads."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

import fastckpt
import fastckpt.accelerate
from fastckpt.cli import main as cli_main


def _model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=1, eos_token_id=2)).eval()
    g = model.generation_config
    g.max_new_tokens, g.do_sample, g.top_k, g.temperature, g.pad_token_id, g.eos_token_id = 5, True, 7, 0.7, 3, [2, 9]
    return model


def _json(path):
    return json.loads(path.read_text())


def _same_as_save_pretrained(folder, model, tmp_path):
    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    for name in ("config.json", "generation_config.json"):
        assert _json(folder / name) == _json(reference / name), name
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    g = loaded.generation_config
    assert (g.max_new_tokens, g.do_sample, g.top_k, g.temperature, g.pad_token_id, g.eos_token_id) == \
        (5, True, 7, 0.7, 3, [2, 9])
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_save_state_model_only_writes_generation_config(tmp_path):
    model = _model(1)
    before = model.config.to_json_string()
    folder = fastckpt.save_state(model, model_only=True, output_dir=tmp_path / "m")
    assert model.config.to_json_string() == before  # the live config is not changed
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "fastckpt.json", "generation_config.json", "model.safetensors"]
    assert "generation_config.json" in _json(folder / "fastckpt.json")["files"]
    _same_as_save_pretrained(folder, model, tmp_path)


@pytest.mark.parametrize("compat", [None, "accelerate"])
def test_accelerate_model_only_writes_generation_config(tmp_path, new_accelerator, compat):
    acc = new_accelerator()
    model = acc.prepare(_model(2))
    folder = fastckpt.accelerate.save_state(acc, tmp_path / "m", model_only=True, compat=compat)
    assert not any(p.suffix in (".bin", ".pkl", ".pt") for p in folder.iterdir())
    _same_as_save_pretrained(folder, acc.unwrap_model(model), tmp_path)


def test_convert_to_hf_model_carries_generation_config(tmp_path):
    model = _model(3)
    full = fastckpt.save_state(model, torch.optim.SGD(model.parameters(), lr=0.1), output_dir=tmp_path / "full")
    assert cli_main(["convert", str(full), str(tmp_path / "hf"), "--to", "hf-model"]) == 0
    _same_as_save_pretrained(tmp_path / "hf", model, tmp_path)


def test_model_that_cannot_generate_gets_no_generation_config(tmp_path):
    model = BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20,
                                 vocab_size=40))
    folder = fastckpt.save_state(model, model_only=True, output_dir=tmp_path / "m")
    assert not (folder / "generation_config.json").exists()
    model.save_pretrained(tmp_path / "ref")
    assert not (tmp_path / "ref" / "generation_config.json").exists()
    assert _json(folder / "config.json") == _json(tmp_path / "ref" / "config.json")

"""The JSON files ``save_pretrained`` writes beside a transformers model's weights: ``config.json`` and
``generation_config.json``. Both are text (no pickle); a model without a config gets neither.

``config.json`` is the config as ``save_pretrained`` records it (``architectures`` = the model's class, ``dtype`` =
its parameters' dtype), taken from a copy so the live config is not changed. ``generation_config.json`` is written
for a model that can generate (``model.can_generate()``), with ``save_pretrained``'s options (only values that
differ from the defaults), so ``from_pretrained`` keeps ``max_new_tokens``, sampling settings and eos / pad ids.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["hf_model_files", "model_config_json", "generation_config_json"]


def _unwrapped(model: Any) -> Any:
    inner = getattr(model, "_orig_mod", None)  # a torch.compile'd model
    return inner if inner is not None else model


def model_config_json(model: Any) -> str | None:
    """A transformers model's ``config.json`` text as ``save_pretrained`` writes it, or None without a config."""
    model = _unwrapped(model)
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_json_string", None)):
        return None
    if hasattr(config, "architectures"):  # a transformers PretrainedConfig: record what save_pretrained records
        config = copy.deepcopy(config)
        dtype = getattr(model, "dtype", None)
        if dtype is not None:
            config.dtype = str(dtype).split(".")[-1]
        config.architectures = [type(model).__name__.removeprefix("FSDP")]
    return config.to_json_string()


def generation_config_json(model: Any) -> str | None:
    """``generation_config.json`` text for a model that can generate, else None."""
    model = _unwrapped(model)
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if generation is None or not callable(can_generate) or not can_generate():
        return None
    try:
        return generation.to_json_string(use_diff=True, keys_to_pop=["compile_config"])
    except TypeError:  # older transformers: no keys_to_pop
        return generation.to_json_string(use_diff=True)


def hf_model_files(model: Any) -> dict[str, str]:
    """``{file name: text}`` of the JSON files ``save_pretrained`` would write beside ``model``'s weights."""
    files = {}
    if (config := model_config_json(model)) is not None:
        files["config.json"] = config
    if (generation := generation_config_json(model)) is not None:
        files["generation_config.json"] = generation
    return files

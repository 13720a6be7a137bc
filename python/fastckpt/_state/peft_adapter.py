"""PEFT adapters: the files ``PeftModel.save_pretrained`` writes, from a ``model_only=True, trainable_only=True``
save of a ``PeftModel``, and the key map to load them back.

``adapter_model.safetensors`` holds ``peft.get_peft_model_state_dict(model)`` (PEFT's key names: the adapter
name taken out, e.g. ``base_model.model.fc.lora_A.weight``) with ``{"format": "pt"}`` metadata, and
``adapter_config.json`` the adapter's config as ``PeftConfig.save_pretrained`` writes it (``inference_mode``
true, the base model's ``name_or_path``, sorted keys), so ``PeftModel.from_pretrained(base, folder)`` loads it.
The tensors are the live ones (no copies). ``peft`` is imported only when a model comes from it.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fastckpt.errors import KeyMismatchError

__all__ = ["ADAPTER_FILE", "ADAPTER_CONFIG", "is_peft_model", "adapter_state", "adapter_config_json", "key_map"]

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (checked without importing peft when it is not loaded)."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _adapter_name(model: Any) -> str:
    names = list(model.peft_config)
    if names != ["default"]:
        raise KeyMismatchError(
            f"{type(model).__name__} holds the adapters {names}; fastckpt writes PEFT's folder for one adapter "
            "named 'default' (PeftModel.save_pretrained puts other adapters in subfolders)"
        )
    return names[0]


def _peft_state(model: Any, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=live, adapter_name=_adapter_name(model))


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """``{PEFT key: tensor}`` as ``save_pretrained`` writes it (detached views of the live tensors)."""
    return {k: v.detach() for k, v in _peft_state(model, model.state_dict(keep_vars=True)).items()}


def key_map(model: Any) -> dict[str, str]:
    """``{PEFT key: state_dict name}`` of ``model``'s adapter tensors, to load an adapter folder into it."""
    live = model.state_dict(keep_vars=True)
    owner = {id(t): name for name, t in live.items()}
    return {k: owner[id(v)] for k, v in _peft_state(model, live).items() if id(v) in owner}


def adapter_config_json(model: Any) -> str:
    """The ``adapter_config.json`` text ``PeftModel.save_pretrained`` writes for ``model``'s adapter."""
    # One copy of the config, as save_pretrained makes (``to_dict``): every copy of a set may iterate in another
    # order, so a second copy could list ``target_modules`` differently from PEFT's own file.
    config = model.peft_config[_adapter_name(model)]
    output = config.to_dict()
    if output["base_model_name_or_path"] is None:
        inner = model.base_model if config.is_prompt_learning else model.base_model.model
        output["base_model_name_or_path"] = inner.__dict__.get("name_or_path", None) or None
    output["inference_mode"] = True
    for key, value in output.items():
        if isinstance(value, set):
            output[key] = list(value)
    if config.task_type is None:
        cls = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        output["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    return json.dumps(output, indent=2, sort_keys=True)

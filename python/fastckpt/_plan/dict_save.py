"""What ``fastckpt.save(obj, path)`` writes: a plain checkpoint dict as one folder (see :mod:`fastckpt._io.storage.local.layout`).

=====================  ======================================================================================
``state.safetensors``  every tensor of the dict, named by its key path (a flat ``{str: tensor}`` dict: its
                       keys), tied tensors once; metadata ``format: pt`` and ``{dropped name: kept name}``
``state.json``         the structure: exact JSON (:mod:`fastckpt._state.plain_dict`), tensors by name
``state.pkl``          only with ``trust_pickle=True`` and a value that needs pickle: those values, in order
``fastckpt.json``      the manifest: ``"layout": "dict"``, sizes and crc32c of every file, written last
=====================  ======================================================================================

The folder is committed like every checkpoint (staging folder, manifest last, one rename). The JSON and the pickle
part are made at the call, so an async save holds the values of the call for them too.
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch

from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.storage.local.layout import DICT_LAYOUT, DICT_PICKLE, DICT_STRUCTURE, DICT_TENSORS
from fastckpt._state.plain_dict import dict_payload

__all__ = ["build_dict_plan"]


def build_dict_plan(obj: Any, *, trust_pickle: bool = False) -> SavePlan:
    """The files of a checkpoint-dict folder for ``obj``, over its live tensors (no copies).

    Raises:
        TypeError: ``obj`` is not a dict, list or tuple; or (without ``trust_pickle``) a value needs pickle
            (names its key path and type).
    """
    if not isinstance(obj, (dict, list, tuple)):
        raise TypeError(f"fastckpt.save stores a dict, list or tuple (a checkpoint dict), got {type(obj).__name__}")
    payload = dict_payload(obj, trust_pickle=trust_pickle)
    plan = SavePlan(mode=DICT_LAYOUT, step=0, counts={"layout": DICT_LAYOUT})
    metadata = [("format", "pt"), *((k, v) for k, v in payload.aliases.items() if k != "format")]
    plan.parts.append(FilePart(DICT_TENSORS, payload.tensors, metadata))
    plan.texts[DICT_STRUCTURE] = json.dumps(payload.structure, allow_nan=False)
    if payload.pickled:
        buffer = io.BytesIO()
        torch.save(payload.pickled, buffer)
        plan.texts[DICT_PICKLE] = buffer.getvalue()
        plan.counts["pickle_part"] = DICT_PICKLE
        plan.counts["pickled"] = payload.pickled_paths
    return plan

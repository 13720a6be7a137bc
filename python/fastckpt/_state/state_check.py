"""Phase-1 checks of small states before anything is applied: a saved scheduler / registered object / GradScaler
state must have the shape of the live object's own ``state_dict()``.

``load_state_dict`` of these objects runs in phase 2, after the weights and optimizer state are in place; a state
that would break it (or the next step) must be refused before that. :func:`check_state_like` compares the saved
structure with the live one where both have an entry: a number where the live object holds a number, a dict where
it holds a dict, a tensor where it holds a tensor, recursively. Entries only one side has, ``None`` and values of
other types are let through (torch versions add scheduler fields; ``None`` is a common initial value), so a
legitimate resume is never refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fastckpt.errors import HeaderError

__all__ = ["check_state_like"]


def _kind(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, (bool, int, float, np.integer, np.floating, np.bool_)):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, Mapping):
        return "dict"
    if isinstance(value, (list, tuple)):
        return "sequence"
    return "other"


def _walk(saved: Any, live: Any, where: str, path: str, what: str, depth: int = 0) -> None:
    ks, kl = _kind(saved), _kind(live)
    if "none" in (ks, kl) or "other" in (ks, kl) or depth > 32:
        return
    if ks != kl:
        raise HeaderError(
            f"{path}: the saved {what} state does not fit the live object: {where or 'the state'} is a {ks} "
            f"({type(saved).__name__}) in the file but a {kl} ({type(live).__name__}) in the live object; "
            "nothing was changed"
        )
    if ks == "dict":
        for key in saved:
            if key in live:
                _walk(saved[key], live[key], f"{where}[{key!r}]", path, what, depth + 1)
    elif ks == "sequence" and len(saved) == len(live):
        for i, (a, b) in enumerate(zip(saved, live)):
            _walk(a, b, f"{where}[{i}]", path, what, depth + 1)


def check_state_like(saved: Any, live: Any, *, path: Any, what: str) -> None:
    """Raise if ``saved`` cannot be the state of the object whose current ``state_dict()`` is ``live``.

    Args:
        saved: the state read from the checkpoint.
        live: the live object's ``state_dict()``.
        path: the file it was read from (for the message). what: ``"scheduler 0"``, ``"custom object 1"``.

    Raises:
        HeaderError: ``saved`` is not a dict where ``live`` is, or an entry has another kind than the live one
            (names the file, the entry and both kinds).
    """
    _walk(saved, live, "", str(path), what)

"""Differences between the torch versions fastckpt supports (see pyproject's ``torch`` floor), in one place.

- ``dcp.save`` / ``dcp.load`` take ``no_dist`` from torch 2.7 on; before that DCP decides the same by itself (no
  initialised process group: one process) and the keyword is a ``TypeError``. :func:`no_dist_kwargs` passes it only
  where the call accepts it.

May import: nothing of fastckpt (layer 2, a leaf).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

__all__ = ["no_dist_kwargs"]


@functools.cache
def _accepts_no_dist(fn: Callable[..., Any]) -> bool:
    try:
        return "no_dist" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return False


def no_dist_kwargs(fn: Callable[..., Any], no_dist: bool) -> dict[str, bool]:
    """``{"no_dist": no_dist}`` when ``fn`` (``dcp.save`` or ``dcp.load``) takes that keyword, else ``{}``."""
    return {"no_dist": no_dist} if _accepts_no_dist(fn) else {}

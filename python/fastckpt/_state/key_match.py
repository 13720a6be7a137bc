"""Matching stored tensor names to live ones: ``torch.compile`` wrappers and tied weights stored untied.

- ``torch.compile(model)`` returns a wrapper whose state_dict names carry ``_orig_mod.`` (also inside, for a
  compiled submodule: ``encoder._orig_mod.weight``). :func:`canonical_fqn` drops those segments: fastckpt saves
  the plain names (as accelerate's ``unwrap_model`` does) and matches stored names to live ones by their
  canonical form, so a checkpoint of a compiled model loads into the plain model and the reverse.
- A file that stores two names separately that the live module ties (``b.weight is a.weight``) can only be
  applied once: :func:`untied_conflicts` finds the stored copies whose bytes differ from the kept one, which a
  load reports as unexpected keys (or refuses under ``strict``) instead of dropping silently.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["COMPILED_PREFIX", "canonical_fqn", "untied_conflicts"]

COMPILED_PREFIX = "_orig_mod"


def canonical_fqn(name: str) -> str:
    """``name`` without ``torch.compile``'s ``_orig_mod`` segments: ``"_orig_mod.enc._orig_mod.w"`` -> ``"enc.w"``."""
    if COMPILED_PREFIX not in name:
        return name
    return ".".join(part for part in name.split(".") if part != COMPILED_PREFIX)


def _raw(src: Any) -> np.ndarray:
    start = src.file.data_start
    return np.frombuffer(memoryview(src.file), dtype=np.uint8, count=src.end - src.begin, offset=start + src.begin)


def _same_bytes(a: Any, b: Any) -> bool:
    if a.dtype != b.dtype or list(a.shape) != list(b.shape) or a.end - a.begin != b.end - b.begin:
        return False
    if a.end == a.begin:
        return True
    try:
        return bool(np.array_equal(_raw(a), _raw(b)))
    except (BufferError, TypeError):  # a file without a mapping: read both
        buf_a = np.empty(a.end - a.begin, np.uint8)
        buf_b = np.empty(b.end - b.begin, np.uint8)
        a.file.read_into([(a.name, buf_a)])
        b.file.read_into([(b.name, buf_b)])
        return bool(np.array_equal(buf_a, buf_b))


def untied_conflicts(assignments: list[tuple[Any, Any, str]], live_groups: dict[str, list[str]]) -> list[int]:
    """Indices into ``assignments`` (``(live tensor, source, live name)``) of stored copies that a tie would drop.

    Within each group of live names tied together, the first assignment (state_dict order) is kept; another one
    whose source is a different stored tensor with different bytes is a conflict. Identical copies (a pickled
    state dict keeps both names of a tie) are no conflict.
    """
    first: dict[tuple[str, ...], Any] = {}
    conflicts = []
    for i, (_dst, src, name) in enumerate(assignments):
        group = live_groups.get(name)
        if group is None:
            continue
        key = tuple(group)
        kept = first.setdefault(key, src)
        if kept is src or (kept.file is src.file and kept.name == src.name):
            continue
        if not _same_bytes(kept, src):
            conflicts.append(i)
    return conflicts

"""Putting a value at a DCP object path (``("optim", "param_groups", 0, "lr")``) in a nested state_dict.

DCP's default load planner flattens a nested state_dict and records, for each flat key, the path of keys and list
indices it came from (``planner.mappings``). The reader puts a decoded non-tensor value back at that path. torch
keeps the walk in a private module (``torch.distributed.checkpoint._traverse.set_element``), which the reader uses
when it is there; :func:`set_element` is the same walk for a torch without it, and for tests.

May import: nothing of fastckpt (a leaf of :mod:`fastckpt.dcp`).
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

__all__ = ["set_element"]


def set_element(root: MutableMapping[Any, Any], path: Sequence[str | int], value: Any) -> None:
    """Set ``value`` at ``path`` under ``root``, creating what is missing on the way.

    A missing container is a dict when the key after it is a str, a list when it is an int; a list too short for an
    index is padded with None first (DCP saves list elements one by one, in any order).

    Args:
        root: the nested state_dict (dicts and lists).
        path: keys (str, or int list indices), at least one.
        value: what to put there.

    Raises:
        ValueError: ``path`` is empty.
    """
    if not path:
        raise ValueError("set_element: empty object path")
    container: Any = root
    for key, next_key in zip(path[:-1], path[1:]):
        container = _child(container, key, {} if isinstance(next_key, str) else [])
    if isinstance(container, list):
        _pad(container, path[-1])
    container[path[-1]] = value


def _child(container: Any, key: str | int, empty: dict[Any, Any] | list[Any]) -> Any:
    """``container[key]``, set to ``empty`` first when it is missing (or None in a list)."""
    if isinstance(container, MutableMapping):
        return container.setdefault(key, empty)
    _pad(container, key)
    if container[key] is None:
        container[key] = empty
    return container[key]


def _pad(items: list[Any], index: Any) -> None:
    if len(items) <= index:
        items.extend([None] * (index + 1 - len(items)))

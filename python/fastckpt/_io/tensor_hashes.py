"""Content hashes of live tensors (xxh3-128, see ``_core.hash_tensors``), remembered within the process.

A checkpoint records a content hash per tensor; the frozen weights of a ``trainable_only`` save and the shards
of a ``share_unchanged`` save are recognised by it. Hashing a 14 GB frozen base at every save would cost what the
feature saves, so the hash of a tensor is remembered with the tensor's autograd version counter (``t._version``,
bumped by every in-place operation through torch: ``copy_``, ``add_``, an optimizer step), its ``data_ptr``,
shape, strides and dtype; a later save whose tensor still shows the same values takes the remembered hash and
hashes nothing.

The memory is keyed by the live object (a ``Parameter`` or buffer, held through a weak reference, so a freed
tensor whose address is reused by a new one is never mistaken for it). Writes that bypass the version counter
(through ``.numpy()``, ``.data``, or raw pointers) are not seen; :func:`forget` drops everything.
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping

import torch

from fastckpt import _core
from fastckpt._format.tensors import tensor_source

__all__ = ["content_hashes", "remember", "forget"]

_Key = tuple[Any, ...]
_memory: dict[int, tuple[weakref.ref, _Key, str]] = {}


def _key(t: torch.Tensor, convert_to: str | None) -> _Key:
    return (t.device, t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype, convert_to)


def _drop(ident: int) -> Any:
    return lambda _ref: _memory.pop(ident, None)


def remember(t: torch.Tensor, convert_to: str | None, digest: str) -> None:
    """Remember ``digest`` as the content hash of live tensor ``t`` as it is now (stored in ``convert_to``)."""
    try:
        ref = weakref.ref(t, _drop(id(t)))
    except TypeError:  # pragma: no cover - every torch.Tensor supports weak references
        return
    _memory[id(t)] = (ref, _key(t, convert_to), digest)


def recall(t: torch.Tensor, convert_to: str | None) -> str | None:
    """The remembered hash of ``t`` if it was not changed since (see the module docs), else None."""
    entry = _memory.get(id(t))
    if entry is None or entry[0]() is not t or entry[1] != _key(t, convert_to):
        return None
    return entry[2]


def forget() -> None:
    """Drop every remembered hash (the next save hashes everything again)."""
    _memory.clear()


def content_hashes(tensors: Mapping[str, torch.Tensor], *, convert_to: str | None = None,
                   threads: int = 0) -> dict[str, str]:
    """``{name: xxh3-128 as 32 hex digits}`` of live tensors, as they would be stored (converted to ``convert_to``).

    Tensors unchanged since they were last hashed or written (see the module docs) are not read; the others are
    hashed in one parallel pass in the core (GIL released) and remembered.

    Args:
        tensors: ``{name: tensor}``; pass the live objects (``state_dict(keep_vars=True)`` values), not detached
            views, so the hashes can be remembered.
        convert_to: a safetensors floating dtype name, or None.
        threads: hashing threads, 0 = min(8, cores).

    Raises:
        DtypeError / ValueError: as :func:`fastckpt._format.tensors.tensor_source`.
    """
    out: dict[str, str] = {}
    todo: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors.items():
        known = recall(t, convert_to)
        if known is None:
            todo.append((name, t))
        else:
            out[name] = known
    if todo:
        digests = _core.hash_tensors([tensor_source(n, t.detach(), convert_to) for n, t in todo], threads=threads)
        for (name, t), digest in zip(todo, digests):
            remember(t, convert_to, digest)
            out[name] = digest
    return {name: out[name] for name in tensors}

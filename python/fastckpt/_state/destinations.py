"""Checking live destination tensors before a load writes into any of them.

A live parameter or buffer can have a layout that cannot take a copy: an expanded tensor
(``torch.randn(1, 4).expand(3, 4)``: stride 0, several elements share one memory location) makes ``copy_`` raise a
raw RuntimeError, which used to come after other tensors had been overwritten. :func:`check_destination` refuses such
a destination up front, naming it; any other strided layout (a transposed ``Parameter(randn(8, 4).t())``,
channels_last) is written correctly element by element.
"""

from __future__ import annotations

import torch

from fastckpt.errors import ShapeMismatchError

__all__ = ["has_internal_overlap", "check_destination"]


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an expanded or as_strided view), so it cannot be written."""
    probe = getattr(torch, "_debug_has_internal_overlap", None)  # private: the stride test below decides without it
    verdict = probe(t) if probe is not None else 2  # 0: no, 1: yes, 2: too hard to tell
    if verdict != 2:
        return verdict == 1
    extent = 1  # sufficient test: each dim (by stride) starts past the span of the smaller ones
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride < extent:
            return True
        extent += stride * (size - 1)
    return False


def check_destination(dst: torch.Tensor, name: str, owner: str) -> None:
    """Refuse a destination that cannot receive a stored tensor, before anything is written.

    Raises:
        ShapeMismatchError: ``dst`` has elements that share memory (names the tensor, its shape and strides).
    """
    if dst.numel() > 1 and has_internal_overlap(dst):
        raise ShapeMismatchError(
            f"{owner}.{name} (shape {list(dst.shape)}, strides {list(dst.stride())}) has elements that share memory "
            "(an expanded tensor), so a load cannot write into it; make it a real tensor first "
            f"(e.g. register it as {name.rsplit('.', 1)[-1]}.clone()). Nothing was changed."
        )

"""The state the DCP plugin tests save: every dtype fastckpt.torch handles, a tied pair, uneven shards, non-tensor
values; and the same state as DTensors sharded over any world size (built with ``DTensor.from_local``, so no
collective ever carries a float8 / float4 tensor through gloo)."""

from __future__ import annotations

import math
from typing import Any

import torch

#: tensors sharded along dim 0 or 1 when loaded as DTensors; the rest stay plain (replicated) tensors
SHARDED = ("w", "emb", "head", "i32", "flags", "bf", "f8", "e8m0", "f4")


def newer_dtypes(g: torch.Generator) -> dict[str, torch.Tensor]:
    """F8_E8M0 and F4 tensors, where this torch has the dtypes (2.7 / 2.8 and later)."""
    out = {}
    if hasattr(torch, "float8_e8m0fnu"):
        out["e8m0"] = torch.rand(5, 2, generator=g).mul(8).to(torch.float8_e8m0fnu)
    if hasattr(torch, "float4_e2m1fn_x2"):
        out["f4"] = torch.randint(0, 256, (6, 2), generator=g, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    return out


def full_state(seed: int = 0) -> dict[str, Any]:
    """The reference state: ``head`` is ``emb`` (tied), shapes that split unevenly over 2 and 4 ranks."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(10, 6, generator=g)
    return {
        "w": torch.randn(7, 5, generator=g),
        "emb": emb,
        "head": emb,
        "i32": torch.randint(-1000, 1000, (9, 3), generator=g, dtype=torch.int32),
        "flags": torch.rand(5, 4, generator=g) > 0.5,
        "bf": torch.randn(9, 2, generator=g).bfloat16(),
        "f16": torch.randn(3, 3, generator=g).half(),
        "f64": torch.randn(4, generator=g).double(),
        "f8": torch.randn(6, 4, generator=g).to(torch.float8_e4m3fn),
        "u8": torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8),
        "i64": torch.arange(-3, 3),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        **newer_dtypes(g),
        "step": 7,
        "extra": {"lr": float("inf"), "neg": float("-inf"), "nan": float("nan"), "name": "gpt", "flag": True,
                  "none": None, "t": (1, 2.5, None), "nested": [1, [2, {"a": "b"}]], "big": 2**70},
    }


def template(state: dict[str, Any]) -> dict[str, Any]:
    """Same keys, shapes and dtypes, zero-filled tensors and blank values (what a fresh job loads into)."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=torch.uint8).view(v.dtype) if v.dtype.itemsize == 1 \
                else torch.zeros_like(v)
        else:
            out[k] = _blank(v)
    if "head" in out and "emb" in out:
        out["head"] = out["emb"]
    return out


def _blank(value: Any) -> Any:
    """The containers DCP flattens (dicts, lists) with every leaf None."""
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank(v) for v in value]
    return None


def shard_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """``torch.chunk``'s split of ``n`` rows over ``world`` ranks (DTensor's ``Shard`` rule): ``(start, stop)``."""
    size = math.ceil(n / world) if n else 0
    start = min(n, size * rank)
    return start, min(n, start + size)


def local_shard(t: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    start, stop = shard_bounds(t.shape[dim], world, rank)
    return t.narrow(dim, start, stop - start)


def as_dtensors(state: dict[str, Any], mesh: Any, dim: int, *, zero: bool = False) -> dict[str, Any]:
    """``state`` with the :data:`SHARDED` tensors as DTensors ``Shard(dim)`` over ``mesh`` (ties kept)."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(), mesh.get_local_rank()
    out: dict[str, Any] = {}
    made: dict[int, Any] = {}
    for k, v in state.items():
        if not isinstance(v, torch.Tensor) or k not in SHARDED:
            out[k] = v
            continue
        if id(v) in made:
            out[k] = made[id(v)]
            continue
        local = local_shard(v, dim, world, rank).clone()  # its own storage, as a real shard has
        if zero:
            local = torch.zeros(local.shape, dtype=torch.uint8).view(local.dtype) if local.dtype.itemsize == 1 \
                else torch.zeros_like(local)
        out[k] = made[id(v)] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=v.shape,
                                                  stride=v.stride())
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same(a: Any, b: Any) -> bool:
    """Bit equality for tensors (any dtype), exact equality for values (nan equals nan, types must match)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(_bytes(a), _bytes(b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def mismatches(expected: dict[str, Any], got: dict[str, Any], *, world: int = 1, rank: int = 0,
               dim: int | None = None) -> list[str]:
    """Keys whose loaded value differs from ``expected`` (a DTensor's local shard against its slice)."""
    bad = []
    for k, want in expected.items():
        value = got.get(k)
        if dim is not None and k in SHARDED and hasattr(value, "to_local"):
            want, value = local_shard(want, dim, world, rank), value.to_local()
        if not same(want, value):
            bad.append(k)
    return bad

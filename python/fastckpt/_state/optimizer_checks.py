"""Checks of saved optimizer state against the live optimizer (shapes, dtypes, hyper-parameter kinds), and the
``LoadResult.skipped`` lines for saved state a ``strict=False`` load does not apply; used by
:func:`fastckpt._state.optimizer.read_optimizer_state`."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from fastckpt.errors import DtypeError, HeaderError, ShapeMismatchError

__all__ = ["PARAM_SHAPED_STATE", "check_hyper", "check_state_tensor", "dropped_state_lines"]


#: State that torch's optimizers keep shaped like the parameter (Adam, AdamW, SGD, RMSprop, Adadelta, Adagrad...).
PARAM_SHAPED_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                                "acc_delta", "sum"})


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def _same_shape(name: str, got: list[int], want: list[int]) -> bool:
    one = len(got) <= 1 and len(want) <= 1 and got in ([], [1]) and want in ([], [1])
    return got == want or (name == "step" and one)  # ``step``: 0-d or 1 element, as the optimizer's variant keeps it


def check_state_tensor(key: str, name: str, saved: torch.Tensor, param: Any, live: Any, path: str,
                        label: str) -> None:
    """A saved state tensor must fit the live optimizer: the shape and dtype of the tensor of that name the live
    optimizer already keeps for the parameter; else, for the state torch keeps shaped like the parameter
    (:data:`PARAM_SHAPED_STATE`), its shape and kind of dtype (floating, integer, bool, complex). Other state
    (Adafactor's row/col factors, LBFGS's flat directions) is not of the parameter's shape and is not compared.

    Raises:
        ShapeMismatchError / DtypeError: names the file, the tensor and both shapes / dtypes.
    """
    got, kind = list(saved.shape), _dtype_kind(saved.dtype)
    if isinstance(live, torch.Tensor) and not live.is_sparse:
        want, wanted_dtype, what = list(live.shape), live.dtype, f"the live {label}'s {name!r} state"
        dtype_ok = saved.dtype == live.dtype
    elif name in PARAM_SHAPED_STATE and isinstance(param, torch.Tensor):
        want, wanted_dtype, what = list(param.shape), param.dtype, "the parameter"
        dtype_ok = kind == _dtype_kind(param.dtype)
    else:
        return
    if not _same_shape(name, got, want):
        raise ShapeMismatchError(f"{path}: optimizer state {key!r} has shape {got} but {what} has shape {want}; "
                                 "its next step() would fail. Nothing was changed.")
    if not dtype_ok:
        raise DtypeError(f"{path}: optimizer state {key!r} is stored as {saved.dtype} but {what} is {wanted_dtype}; "
                         "fastckpt never casts silently. Nothing was changed.")


def _value_kind(value: Any) -> Any:
    """What a param_groups value must keep across a save: number (int and float alike), bool, str, or a
    sequence of such of one length; None for values not compared (None itself: an option left to torch)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, torch.Tensor):
        return "bool" if value.dtype == torch.bool else "number" if value.numel() == 1 else None
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)):
        return ("sequence", len(value), tuple(_value_kind(v) for v in value))
    return None


def check_hyper(saved: dict[str, Any], live: dict[str, Any], path: str, saved_index: int, live_index: int,
                 label: str) -> None:
    """Each saved hyper-parameter must be of the kind of the live group's value of that key (``lr="x"`` for a
    float ``lr``, two ``betas`` for a live pair of floats...). Raises HeaderError naming file, group, key, values."""
    for key, value in saved.items():
        if key == "params" or key not in live:
            continue
        want, got = _value_kind(live[key]), _value_kind(value)
        if want is None or got is None or want == got:
            continue
        raise HeaderError(
            f"{path}: metadata 'param_groups'[{saved_index}] (loaded into param group {live_index} of the live "
            f"{label}) has {key}={value!r} but the live value is {live[key]!r}; its next step() would fail. Nothing "
            "was changed."
        )


def dropped_state_lines(orphaned: Sequence[str], state_names: dict[str, list[str]], extra: dict[str, Any], *,
                        path: str, label: str) -> list[str]:
    """``LoadResult.skipped`` lines for saved parameters the live optimizer does not optimize: one per parameter
    that has saved state (its names listed, tensors and other values alike); parameters saved without state
    (never stepped) lose nothing and are not listed."""
    lines = []
    for fqn in orphaned:
        names = [*state_names.get(fqn, []), *(n for n in extra.get(fqn, {}) if n not in state_names.get(fqn, []))]
        if names:
            lines.append(f"{path}: optimizer state of {fqn!r} ({', '.join(names)}) not applied: the live {label} "
                         "does not optimize that parameter (frozen since the save, or left out of its param_groups)")
    return lines

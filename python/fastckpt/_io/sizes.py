"""Sizes in bytes as users write them: an int, or a string with Hugging Face's units (``"10GB"``, ``"512MiB"``).

One parser for every argument that takes a size (``max_shard_size``, ``host_memory_budget``, the CLI's
``--max-shard-size``), so the same string means the same bytes wherever it is passed.

May import: nothing of fastckpt (a shared ``_io`` module).
"""

from __future__ import annotations

import re

__all__ = ["parse_size", "parse_budget"]

_UNITS = {
    "TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10,
    "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]+)\s*$")


def parse_size(size: int | str, what: str = "max_shard_size", minimum: int = 1) -> int:
    """A size in bytes (a shard size limit, a host memory budget), from an int or a string with Hugging Face's units (accelerate's parser).

    ``"10GB"`` = 10 * 10**9, ``"10GiB"`` = 10 * 2**30 (also TB/MB/KB and TiB/MiB/KiB, case-insensitive, decimals
    allowed: ``"1.5GB"``); a lower-case trailing ``b`` means bits, as in accelerate and transformers
    (``"8Gb"`` = 10**9 bytes).

    Raises:
        ValueError: not a positive size, or an unknown unit (the message lists the accepted ones).
        TypeError: neither int nor str.

    ``what`` names the argument in messages; ``minimum``: the smallest size accepted (bytes).
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"{what} must be an int (bytes) or a str like '10GB', got {type(size).__name__}")
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE_RE.match(size)
        unit = m.group(2).upper() if m else ""
        if not m or unit not in _UNITS:
            raise ValueError(
                f"{what} {size!r} is not a size: use bytes (int) or a number with one of the units "
                "TB, GB, MB, KB (powers of 10), TiB, GiB, MiB, KiB (powers of 2); e.g. '10GB'"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
        if m.group(2)[-1] == "b" and not unit.endswith("IB"):
            value //= 8  # "Gb": gigabits
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum} byte(s), got {size!r} ({value} bytes)")
    return value


def parse_budget(budget: int | str | None) -> int | None:
    """``host_memory_budget`` in bytes: an int, a string such as ``"4GB"`` (10**9) or ``"512MiB"`` (the units of
    :func:`parse_size`), or None (no budget).

    Raises:
        ValueError: a negative number, an unknown unit, or neither int nor str.
    """
    if budget is None:
        return None
    try:
        return parse_size(budget, "host_memory_budget", minimum=0)
    except TypeError as exc:
        raise ValueError(str(exc)) from None

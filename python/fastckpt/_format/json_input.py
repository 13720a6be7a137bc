"""JSON read from a checkpoint is untrusted input: every way it can be wrong (syntax, nesting deep enough to exhaust
the recursion limit, integers too long to convert, the wrong top-level type, unknown or malformed codec tags) is a
:class:`~fastckpt.errors.HeaderError` naming the file and the entry, raised before any live object is changed."""

from __future__ import annotations

import json
from typing import Any, Callable

from fastckpt._format.codec import decode
from fastckpt.errors import CheckpointError, HeaderError

__all__ = ["load_json", "decode_json"]

#: what a malformed value can raise while it is parsed or decoded
_MALFORMED = (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OverflowError)


def load_json(text: str | bytes, where: str, expect: type | tuple[type, ...] = dict) -> Any:
    """``json.loads(text)``, which must give an ``expect`` (a dict by default).

    Raises:
        HeaderError: not JSON, too deep, or of another type; the message starts with ``where``.
    """
    try:
        value = json.loads(text)
    except _MALFORMED as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HeaderError(f"{where}: not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(value, expect):
        names = " or ".join(t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,)))
        raise HeaderError(f"{where}: expected a JSON {names}, got {type(value).__name__}")
    return value


def decode_json(data: Any, where: str, *, tensors: Callable[[str], Any] | None = None,
                pickled: Callable[[int], Any] | None = None) -> Any:
    """:func:`fastckpt._format.codec.decode` of untrusted data; malformed tags become a HeaderError naming ``where``."""
    try:
        return decode(data, tensors=tensors, pickled=pickled)
    except CheckpointError:
        raise
    except _MALFORMED as exc:
        raise HeaderError(f"{where}: malformed value ({type(exc).__name__}: {str(exc)[:200]})") from None

"""Where a path points: a local path, or a URL (``scheme://...``) naming a kind of storage.

Every public call that takes a folder or a file passes it through :func:`check_location` first, before anything is
read or written, so a URL fastckpt cannot serve is a ``ValueError`` naming its scheme, never a local folder called
``s3:`` (``Path("s3://bucket/x")`` is ``s3:/bucket/x``). This is the one seam where the kind of storage is picked
by the path's scheme.

``file://`` URLs are refused too (with the local path to pass instead): the local calls take plain paths, as
safetensors, accelerate and DCP's ``FileSystemWriter`` do, and a ``file://`` URL carries host and percent-encoding
rules that a plain path does not.

May import: nothing of fastckpt (layer 2, below everything that takes a path).
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import unquote, urlsplit

from fastckpt.errors import OptionTypeError

__all__ = ["LOCAL", "check_location", "url_scheme"]

#: a URL's scheme as RFC 3986 spells it, followed by ``://``
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")

#: what every entry point supports
LOCAL = "local paths"


def url_scheme(path: Any) -> str | None:
    """The scheme of ``path`` when it is a URL (``"s3"`` for ``"s3://bucket/x"``, lower-cased), else None.

    Args:
        path: a ``str``, ``bytes`` or ``os.PathLike``; anything else is not a URL (None).
    """
    try:
        text = os.fspath(path)
    except TypeError:
        return None
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    match = _URL.match(text)
    return match.group(1).lower() if match else None


def check_location(path: Any, what: str, *, supported: tuple[str, ...] = ()) -> str | None:
    """Refuse a URL whose scheme this entry point does not serve, before anything is written or read.

    Args:
        path: the path or URL a caller passed (None passes: the caller's default applies).
        what: the argument's name for the message (``"output_dir"``, ``"filename"``, ...).
        supported: URL schemes this entry point serves besides local paths (e.g. ``("s3",)``).

    Returns:
        The URL's scheme (one of ``supported``), or None for a local path.

    Raises:
        OptionTypeError: ``path`` is no ``str``, ``bytes`` or ``os.PathLike`` (names ``what`` and the type).
        ValueError: ``path`` is a URL of another scheme; the message names the scheme and what is supported
            (for ``file://``, the local path to pass instead).
    """
    if path is None:
        return None
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise OptionTypeError(f"{what} must be a path (str or os.PathLike) or a URL, got {type(path).__name__} "
                              f"{path!r}")
    scheme = url_scheme(path)
    if scheme is None or scheme in supported:
        return scheme
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    served = ", ".join([LOCAL] + [f"{s}://" for s in supported])
    if scheme == "file":
        local = unquote(urlsplit(text).path) or "/"
        raise ValueError(f"{what}={text!r}: file:// URLs are not taken; pass the local path {local!r} "
                         f"(supported: {served})")
    raise ValueError(f"{what}={text!r}: {scheme}:// storage is not supported here (supported: {served}); "
                     "nothing was read or written")

"""Object storage (``s3://bucket/prefix``): the backend behind :mod:`fastckpt._io.location`, picked by scheme.

A URL names a bucket and a key prefix; :func:`open_store` gives the bucket's client (``_core.ObjectStore``, Rust:
object_store + tokio), one per bucket and ``storage_options``, reused across calls. Configuration comes from the
standard AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP=true`` for a plain-http endpoint),
then the caller's ``storage_options`` (the same keys in lower case, with or without ``aws_``, plus fastckpt's
``part_size``, ``concurrency``, ``max_retries``, ``retry_timeout``, ``retry_backoff``).

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastckpt import _core
from fastckpt._io.location import check_location

__all__ = ["OBJECT_SCHEMES", "ObjectUrl", "parse_url", "open_store", "remote_url"]

#: URL schemes served by this backend
OBJECT_SCHEMES = ("s3",)

#: characters AWS and GCS advise against in object keys (object_store stores them percent-encoded)
_AVOIDED = set('\\{^}%`]">[~<#|*?')

_stores: dict[tuple[int, str, tuple[tuple[str, str], ...]], Any] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class ObjectUrl:
    """``s3://{bucket}/{prefix}``; ``prefix`` has no leading or trailing ``/``."""

    bucket: str
    prefix: str

    def child(self, *names: str) -> ObjectUrl:
        """The URL of ``prefix/name/...``."""
        return ObjectUrl(self.bucket, "/".join([self.prefix, *names]) if self.prefix else "/".join(names))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_url(url: Any, what: str) -> ObjectUrl:
    """``s3://bucket/a/b`` -> ``ObjectUrl("bucket", "a/b")``.

    Raises:
        ValueError: not an ``s3://`` URL, no bucket, no key prefix (a checkpoint is a prefix inside a bucket), or a
            ``.`` / ``..`` / empty segment in the prefix.
    """
    text = os.fspath(url)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    if check_location(text, what, supported=OBJECT_SCHEMES) is None:
        raise ValueError(f"{what}={text!r} is not an s3:// URL")
    rest = text.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.rstrip("/")
    if not bucket:
        raise ValueError(f"{what}={text!r} names no bucket (s3://BUCKET/PREFIX)")
    if not prefix:
        raise ValueError(f"{what}={text!r} names no key prefix; a checkpoint is a prefix inside the bucket "
                         f"(e.g. s3://{bucket}/run/ckpt)")
    if any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"{what}={text!r}: empty, '.' or '..' segments are not allowed in the key prefix")
    bad = sorted({c for c in prefix if c in _AVOIDED or ord(c) < 32 or ord(c) == 127})
    if bad:
        raise ValueError(f"{what}={text!r}: the key prefix holds {''.join(bad)!r}, characters S3 and GCS advise "
                         "against in keys (they would be stored percent-encoded); use letters, digits and -_.=+!'()@:")
    return ObjectUrl(bucket, prefix)


def remote_url(path: Any, what: str) -> ObjectUrl | None:
    """The :class:`ObjectUrl` when ``path`` is an ``s3://`` URL, None for a local path (or None).

    Raises:
        ValueError: a URL of a scheme no backend serves (see :func:`fastckpt._io.location.check_location`), or a
            malformed ``s3://`` URL (see :func:`parse_url`).
    """
    if check_location(path, what, supported=OBJECT_SCHEMES) is None:
        return None
    return parse_url(path, what)


def open_store(bucket: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The bucket's ``_core.ObjectStore`` for these options (built once per process, then reused: a forked child
    builds its own, as the parent's runtime threads do not exist there).

    Raises:
        ValueError: an unknown ``storage_options`` key or a bad value (named). TypeError: not a mapping.
    """
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a mapping of S3 settings ({{'endpoint_url': ..., 'region': ...}}), "
                        f"got {type(storage_options).__name__} {storage_options!r:.80}")
    options = tuple(sorted((str(k), str(v)) for k, v in (storage_options or {}).items()))
    key = (os.getpid(), bucket, options)
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = _core.ObjectStore(bucket, list(options))
        return store

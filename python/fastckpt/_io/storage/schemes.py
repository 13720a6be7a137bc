"""A location becomes one :class:`~fastckpt._io.storage.base.Storage`: the one place a URL scheme maps to its
backend. A new backend is one sub-package of :mod:`fastckpt._io.storage` plus one line in :data:`SCHEMES`.

May import: everything in ``_io`` (see :mod:`fastckpt._io.storage`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from fastckpt._io.location import check_location
from fastckpt._io.storage.base import Storage
from fastckpt._io.storage.local.backend import LocalStorage
from fastckpt._io.storage.object.backend import ObjectStorage
from fastckpt._io.storage.object.store import OBJECT_SCHEMES, remote_url
from fastckpt._io.storage.tiered.backend import TieredStorage

__all__ = ["SCHEMES", "resolve", "resolve_tiered"]


def _object(location: Any, project_dir: Any, storage_options: Mapping[str, Any] | None, what: str) -> Storage:
    return ObjectStorage(remote_url(location, what), remote_url(project_dir, "project_dir"), storage_options)


def _local(location: Any, project_dir: Any, storage_options: Mapping[str, Any] | None, what: str) -> Storage:
    return LocalStorage(location, project_dir)


#: URL scheme (None: a local path) -> the backend's constructor ``(location, project_dir, storage_options, what)``
SCHEMES: dict[str | None, Callable[[Any, Any, Mapping[str, Any] | None, str], Storage]] = {
    None: _local,
    **{scheme: _object for scheme in OBJECT_SCHEMES},
}


def resolve(location: str | os.PathLike[str] | None, *, project_dir: str | os.PathLike[str] | None = None,
            storage_options: Mapping[str, Any] | None = None, what: str = "output_dir",
            remote: Any = None) -> Storage:
    """The storage that ``location`` (a checkpoint; None: automatic naming under ``project_dir``) names.

    Args:
        location: a local folder or a URL (``s3://bucket/prefix``), or None.
        project_dir: the project for automatic naming (a local folder or URL); None: the current directory.
        storage_options: backend settings (S3: endpoint, region, credentials...); ignored by local folders.
        what: the argument's name for errors (``"output_dir"``, ``"input_dir"``, ``"folder"``).
        remote: an ``s3://`` URL behind the local ``location``: a tiered storage (:func:`resolve_tiered`).

    Returns:
        One :class:`~fastckpt._io.storage.base.Storage`.

    Raises:
        ValueError: a URL scheme no backend serves, a malformed URL, an empty ``project_dir``, or ``location`` and
            ``project_dir`` in different storages (the message names both); with ``remote``, as
            :func:`resolve_tiered`.
    """
    if isinstance(project_dir, (str, os.PathLike)) and os.fspath(project_dir) in ("", b""):
        raise ValueError("project_dir is an empty path; name the project folder, or pass None for the current "
                         "directory")
    if remote is not None:
        return resolve_tiered(location, remote, project_dir=project_dir, storage_options=storage_options)
    scheme = remote_scheme(location, what)
    project_scheme = remote_scheme(project_dir, "project_dir")
    if location is not None and project_dir is not None and scheme is None and project_scheme is not None:
        raise ValueError(f"{what}={location!r} is local but project_dir={project_dir!r} is in object storage; "
                         "pass both in the same storage")
    return SCHEMES[scheme if location is not None else project_scheme](location, project_dir, storage_options, what)


def remote_scheme(path: Any, what: str) -> str | None:
    """The URL scheme of ``path`` when a backend serves it, None for a local path or None (ValueError else)."""
    return check_location(path, what, supported=tuple(s for s in SCHEMES if s is not None))


def resolve_tiered(location: str | os.PathLike[str] | None, remote: Any, *,
                   project_dir: str | os.PathLike[str] | None = None,
                   storage_options: Mapping[str, Any] | None = None) -> TieredStorage:
    """The local folder (or project) ``location`` in front of the object storage ``remote`` (an ``s3://`` URL):
    a tiered save (``save_state(..., remote=)``).

    Raises:
        ValueError: ``remote`` is not an ``s3://`` URL, or ``location`` / ``project_dir`` are not local folders.
    """
    url = remote_url(remote, "remote")
    if url is None:
        raise ValueError(f"remote={remote!r} is not an s3:// URL; a tiered save uploads to object storage")
    local = resolve(location, project_dir=project_dir, what="output_dir")
    if not isinstance(local, LocalStorage):
        raise ValueError("with remote=, output_dir / project_dir are the local tier: pass local folders")
    return TieredStorage(local, ObjectStorage(url, None, storage_options))

"""What the public calls do with an ``s3://`` location: pick the checkpoint (explicit, or automatic naming under a
project prefix), save through a local staging folder and commit remotely, or fetch and load locally.

:class:`~fastckpt._io.storage.object.backend.ObjectStorage` (the verbs every public call speaks) and the checkpoint
manager's remote tier hand a callable that does the local work on a folder (or, for a save, the plan to upload from
memory); everything about the store stays in ``_io``.

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from fastckpt._io.files import SavePlan
from fastckpt._io.storage.object.commit import committed_manifest, save_object_checkpoint, save_plan_objects
from fastckpt._io.storage.object.fetch import RemoteCheckpoint, as_fetched, fetched_checkpoint
from fastckpt._io.storage.object.project import (
    latest_object_checkpoint,
    next_object_checkpoint,
    object_checkpoint_numbers,
    rotate_object_checkpoints,
)
from fastckpt._io.storage.object.store import ObjectUrl, open_store
from fastckpt.errors import MissingStateError

__all__ = ["save_remote", "fetched", "opened", "named_as", "pick_remote", "latest_remote"]

T = TypeVar("T")


def save_remote(url: ObjectUrl | None, project: ObjectUrl | None, write: Callable[[Path], Any], *,
                model_only: bool, total_limit: int | None, storage_options: Mapping[str, Any] | None,
                plan: SavePlan | None = None, threads: int = 0,
                before_commit: Callable[[], Any] | None = None) -> str:
    """Save to ``url`` (or the next ``checkpoint_n`` of ``project``) and commit there: ``plan`` uploaded straight
    from its tensors' memory when given (:func:`fastckpt._io.storage.object.commit.save_plan_objects`), else the folder
    ``write(local_folder)`` writes, uploaded; then rotate the project's checkpoints of that kind to ``total_limit``.
    ``before_commit`` (with ``plan``): called right before the manifest object is created; what it raises commits
    nothing. Returns the URL."""
    target = url if url is not None else project
    assert target is not None
    store = open_store(target.bucket, storage_options)
    auto = url is None
    if auto:
        assert project is not None
        url = next_object_checkpoint(store, project, model_only=model_only)
    assert url is not None
    if plan is not None:
        save_plan_objects(store, url, plan, threads=threads, before_commit=before_commit)
    else:
        assert before_commit is None
        save_object_checkpoint(store, url, write)
    if auto and total_limit is not None:
        assert project is not None
        rotate_object_checkpoints(store, project, total_limit, model_only=model_only)
    return str(url)


def latest_remote(project: ObjectUrl, *, model_only: bool, storage_options: Mapping[str, Any] | None) -> str | None:
    """The newest committed checkpoint under ``project`` as an ``s3://`` URL, or None."""
    found = latest_object_checkpoint(open_store(project.bucket, storage_options), project, model_only=model_only)
    return None if found is None else str(found)


@contextlib.contextmanager
def fetched(url: ObjectUrl | None, project: ObjectUrl | None, *, model_only: bool,
            storage_options: Mapping[str, Any] | None, save_id: str | None = None) -> Iterator[Path]:
    """The checkpoint at ``url`` (or the latest under ``project``'s ``checkpoints/``: saved in full, or of either
    kind with ``model_only``, as locally) as a
    folder for the local loader, held in memory and checked against its manifest as it is read
    (:func:`fastckpt._io.storage.object.fetch.fetched_checkpoint`); released afterwards.

    ``save_id``: the save to read (from :func:`pick_remote` on the main process); another committed save there
    raises CheckpointChangedError.

    Raises:
        MissingStateError: no committed checkpoint there. IntegrityError, HeaderError, OSError,
            CheckpointChangedError: see :func:`fastckpt._io.storage.object.fetch.fetched_checkpoint`.
    """
    store, url = _resolve(url, project, model_only=model_only, storage_options=storage_options)
    with fetched_checkpoint(store, url, save_id) as folder, named_as(folder, str(url)):
        yield folder


@contextlib.contextmanager
def named_as(local: Path, url: str) -> Iterator[None]:
    """Errors and warnings raised inside that name ``local`` (a fetched copy, gone once the call returns) name
    ``url`` instead: the exception's string arguments are rewritten in place (same type), the warnings are
    re-issued after the block with the same category."""
    where = str(local)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except Exception as exc:
            exc.args = tuple(as_fetched(a, where, url) if isinstance(a, str) else a for a in exc.args)
            raise
        finally:
            pending = list(caught)
    for w in pending:
        warnings.warn_explicit(as_fetched(str(w.message), where, url), w.category, w.filename, w.lineno)


@contextlib.contextmanager
def opened(url: ObjectUrl | None, project: ObjectUrl | None, *, model_only: bool,
           storage_options: Mapping[str, Any] | None, save_id: str | None = None) -> Iterator[RemoteCheckpoint]:
    """The committed checkpoint :func:`fetched` would read, listed and checked against its manifest but with no
    object read yet (:class:`fastckpt._io.storage.object.fetch.RemoteCheckpoint`: the caller fetches what it needs);
    released afterwards. Raises as :func:`fetched` does, when opening."""
    store, url = _resolve(url, project, model_only=model_only, storage_options=storage_options)
    remote = RemoteCheckpoint(store, url, save_id)
    try:
        with named_as(remote.folder, str(url)):
            yield remote
    finally:
        remote.close()


def _resolve(url: ObjectUrl | None, project: ObjectUrl | None, *, model_only: bool,
             storage_options: Mapping[str, Any] | None) -> tuple[Any, ObjectUrl]:
    """``(store, checkpoint url)``: ``url``, or the latest committed checkpoint under ``project`` (see
    :func:`fetched`)."""
    target = url if url is not None else project
    assert target is not None
    store = open_store(target.bucket, storage_options)
    if url is None:
        assert project is not None
        numbers = object_checkpoint_numbers(store, project, full_only=not model_only)
        if not numbers:
            raise MissingStateError(f"{project.child('checkpoints')}: no committed "
                                    f"{'checkpoint' if model_only else 'full checkpoint'} (no checkpoint_N with a "
                                    "committed manifest)")
        url = numbers[max(numbers)]
    return store, url


def pick_remote(url: ObjectUrl | None, project: ObjectUrl | None, *, model_only: bool,
                storage_options: Mapping[str, Any] | None) -> tuple[ObjectUrl, str]:
    """``(checkpoint url, save id)`` of the committed save :func:`fetched` would read now: what the main process
    of a multi-process load picks, so that every process fetches that one save (``fetched(..., save_id=)``).

    Raises:
        MissingStateError: no committed checkpoint there. HeaderError, OSError: a malformed manifest, the store
            failed.
    """
    store, url = _resolve(url, project, model_only=model_only, storage_options=storage_options)
    manifest = committed_manifest(store, url)
    if manifest is None:
        raise MissingStateError(f"{url}: no committed checkpoint there (no manifests/*.json; a save that did not "
                                "finish is never loaded)")
    return url, manifest["save_id"]

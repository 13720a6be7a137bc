"""Tiered saves: commit a checkpoint in a local folder first, then upload that committed folder to an ``s3://``
prefix in the background and commit it there (``save_state(..., remote="s3://bucket/run")``).

The local commit is an ordinary local save (synchronous, or an :class:`~fastckpt._io.async_save.writer.AsyncSave`);
the upload is the object backend's upload of a local folder (:func:`fastckpt._io.storage.object.commit.upload_folder`:
objects under a new save-id prefix, the manifest object created last), run on a thread of its own. Until that
manifest is created the previous remote checkpoint stays the committed one, so a process that dies mid-upload
leaves it as ``latest_checkpoint(remote)``. At most one upload is in flight: the next tiered save first waits for
it (and raises its error if nobody did), and the folder is kept out of local rotation
(:func:`~fastckpt._io.storage.local.numbering.keep_from_rotation`) until its upload ends, so that no save's rotation removes a folder
still being uploaded.

May import: what this sub-package's ``__init__`` lists.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastckpt._io.async_save.exit_report import watch
from fastckpt._io.async_save.outcome import Outcome
from fastckpt._io.async_save.writer import AsyncSave
from fastckpt._io.storage.local.numbering import keep_from_rotation, release_from_rotation
from fastckpt._io.storage.object.commit import upload_folder
from fastckpt._io.storage.object.project import rotate_object_checkpoints
from fastckpt._io.storage.object.store import ObjectUrl, open_store

__all__ = ["TieredSave", "start_tiered", "finish_tiered"]

_lock = threading.Lock()
_pending: list[TieredSave] = []


class TieredSave:
    """The handle of one tiered save: the local commit, then the upload and remote commit in the background.

    Attributes:
        remote: the ``s3://`` URL the checkpoint is committed at once uploaded (a ``str``).
        local_save: the local :class:`~fastckpt._io.async_save.writer.AsyncSave` (``async_save``), else None.
    """

    def __init__(self, local: Path | AsyncSave, remote: str) -> None:
        self.remote = remote
        self.local_save = local if isinstance(local, AsyncSave) else None
        self._local_path = local if isinstance(local, Path) else None
        self._finished = Outcome()  # waited on with no lock the uploader needs (a Ctrl-C in wait() is harmless)
        self._error: BaseException | None = None
        self._reported = False

    @property
    def local(self) -> Path:
        """The local checkpoint folder (absolute; with ``async_save`` committed only once :meth:`wait_local`
        returned)."""
        return self._local_path if self._local_path is not None else self.local_save.path  # type: ignore[union-attr]

    def wait_local(self, timeout: float | None = None) -> Path:
        """Block until the local checkpoint is committed; returns its folder.

        Raises:
            TimeoutError: an async local save not finished within ``timeout`` seconds.
            Exception: the async local save's error (nothing is then uploaded).
        """
        if self.local_save is not None:
            return self.local_save.wait(timeout)
        return self.local

    def done(self) -> bool:
        """True once the remote commit is made or the save failed (never blocks)."""
        return self._finished.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the checkpoint is committed at :attr:`remote`; returns that URL.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds (the upload goes on).
            OSError: the store failed after the bounded retries (names the object); the previous remote checkpoint
                is then the committed one. ConcurrentSaveError, IntegrityError: see
                :func:`fastckpt._io.storage.object.commit.save_object_checkpoint`. Any error of the local save.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"tiered save to {self.remote} not committed within {timeout} s (the upload goes on)")
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.remote

    def __repr__(self) -> str:
        state = "uploading" if not self.done() else ("failed" if self._error is not None else "committed")
        return f"TieredSave({str(self.local)!r} -> {self.remote!r}, {state})"

    def exception(self) -> BaseException | None:
        """The error of the local save or the upload once failed; None while running or after success."""
        return self._error if self._finished.done() else None

    def _run(self, url: ObjectUrl, project: ObjectUrl | None, total_limit: int | None, model_only: bool,
             storage_options: Mapping[str, Any] | None) -> None:
        try:
            folder = self.wait_local()
            store = open_store(url.bucket, storage_options)
            upload_folder(store, url, folder)
            if project is not None and total_limit is not None:  # only after the newer remote commit
                rotate_object_checkpoints(store, project, total_limit, model_only=model_only)
        except BaseException as exc:
            self._error = exc
        finally:
            try:
                release_from_rotation(self.local)
            finally:
                self._finished.finish()


def _unreported() -> list[tuple[str, BaseException]]:
    """The finished uploads whose failure nothing raised yet, marked reported (:mod:`fastckpt._io.async_save.exit_report`)."""
    with _lock:
        pending = list(_pending)
    failed = [h for h in pending if h.done() and h._error is not None and not h._reported]
    for h in failed:
        h._reported = True
    return [(f"the tiered save to {h.remote}", h._error) for h in failed]  # type: ignore[misc]


def finish_tiered() -> None:
    """Wait for the tiered upload in flight; re-raise its error if no ``wait()`` raised it (once).

    Raises:
        Exception: the earlier tiered save's error, with a note naming it; the new save is then not made.
    """
    with _lock:
        pending = list(_pending)
        _pending.clear()
    for handle in pending:
        handle._finished.wait()
        if handle._error is not None and not handle._reported:
            handle._reported = True
            handle._error.add_note(f"(raised by the earlier tiered save to {handle.remote}, reported at the next "
                                   "save)")
            raise handle._error


def start_tiered(local: Path | AsyncSave, remote: ObjectUrl, *, project_root: Path | None, model_only: bool,
                 total_limit: int | None, storage_options: Mapping[str, Any] | None) -> TieredSave:
    """Upload the local checkpoint ``local`` (committed, or committing) in the background and return its handle.

    ``project_root``: with automatic naming, the local project folder: the checkpoint is committed at
    ``remote/{checkpoints|model_only}/checkpoint_{n}`` (the local name), and ``total_limit`` rotates the remote
    project after the commit. None: ``remote`` is the checkpoint's own URL.
    """
    path = local if isinstance(local, Path) else local.path
    url = remote.child(path.parent.name, path.name) if project_root is not None else remote
    handle = TieredSave(local, str(url))
    project = remote if project_root is not None else None
    thread = threading.Thread(target=handle._run, args=(url, project, total_limit, model_only, storage_options),
                              name="fastckpt-tiered-upload")  # not a daemon: a normal exit finishes the upload
    keep_from_rotation(path)  # until the upload ends, a plain save's rotation leaves this folder
    with _lock:
        _pending.append(handle)
    watch(_unreported)  # an upload that fails and nobody waits on is reported at exit
    thread.start()
    return handle

"""``torch.distributed.checkpoint`` (DCP) storage on fastckpt's Rust core: atomic, pickle-free, resharding.

Use the plugin with DCP unchanged::

    import torch.distributed.checkpoint as dcp
    import fastckpt.dcp

    dcp.save(state_dict, storage_writer=fastckpt.dcp.StorageWriter("ckpt/step_100"))         # every rank
    dcp.async_save(state_dict, storage_writer=fastckpt.dcp.StorageWriter("ckpt/step_200"))   # thread checkpointer
    dcp.load(state_dict, storage_reader=fastckpt.dcp.StorageReader("ckpt/step_100"))         # any world size

or through the two helpers here, which raise fastckpt's own exception (``DtypeError``, ``HeaderError``, ...) on
every rank instead of DCP's ``CheckpointException`` (a ``BaseException`` wrapping it), and remove the staging
folder of a failed save at once::

    fastckpt.dcp.save(state_dict, "ckpt/step_100", process_group=None)   # -> DCP's Metadata
    fastckpt.dcp.load(state_dict, "ckpt/step_100")                       # fills state_dict in place

``fastckpt.dcp.load`` plans with :class:`LoadPlanner` (DCP's default planner plus a dtype check while planning, so
a mismatch on any rank raises on every rank before any rank reads); pass ``planner=fastckpt.dcp.LoadPlanner()`` to
``dcp.load`` for the same.

A folder holds ``shard-{rank:05d}-of-{world:05d}.safetensors`` (each rank's chunks; tied weights stored once),
``dcp_metadata.json`` (DCP's global metadata as JSON: dtypes, sizes, chunk boxes, where each chunk lives, the
non-tensor values; see :mod:`fastckpt._format.dcp_metadata`), ``dcp_index.bin`` (the same chunks as an index a
rank looks its boxes up in without reading every rank's entries; see :mod:`fastckpt._format.dcp_index` and
:mod:`fastckpt.dcp.indexed`) and ``fastckpt.json`` (the manifest: sizes and
crc32c of every file, written last; ``fastckpt verify`` checks it). No file holds a pickle. The checkpoint is
committed in one step (staging folder beside it, fsync of every file and folder, ``commit_dir``); a save that
fails or is killed on any rank leaves the previous folder exact. ``fastckpt consolidate`` turns such a folder
into a Hugging Face model folder.

Writing into a checkpoint someone else commits (``fastckpt.save_state`` under FSDP2)::

    writer = fastckpt.dcp.StorageWriter(staging / "model", commit=False)   # same folder on every rank
    dcp.save(model_state_dict, storage_writer=writer, process_group=pg)     # or fastckpt.dcp.save(..., writer=)
    writer.files  # on the coordinator: {"shard-00000-of-00002.safetensors": {"bytes", "crc32c", "tensors"}, ...}

With ``commit=False`` the files go straight into the given folder (created if needed), ``dcp_metadata.json`` is
written last and fsynced with the folder, no manifest is written and nothing is renamed: the outer save lists
:attr:`StorageWriter.files` in its own manifest (as ``model/<name>`` or however it lays them out) and commits the
whole checkpoint at once. :class:`StorageReader` reads such a subfolder the same way (it checks a manifest only
when the folder has its own).

Errors (each a :class:`fastckpt.CheckpointError` subclass and a builtin): ``TypeError`` for a non-tensor value
that needs pickle (names its key, at save); ``DtypeError`` when a stored tensor meets a template of another dtype
(names the key and both dtypes; DCP would cast silently); ``HeaderError`` for malformed metadata or a file whose
header disagrees with it (names the file); ``MissingStateError`` for a missing file; ``IntegrityError`` for a size
that differs from the manifest.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from fastckpt._format.dcp_metadata import METADATA_FILE
from fastckpt._io.group.torch_compat import no_dist_kwargs
from fastckpt._io.storage import resolve
from fastckpt.dcp.planner import LoadPlanner, SavePlanner
from fastckpt.dcp.reader import StorageReader
from fastckpt.dcp.writer import StorageWriter, shard_file_name
from fastckpt.errors import MissingStateError

__all__ = ["StorageWriter", "StorageReader", "LoadPlanner", "SavePlanner", "save", "load", "METADATA_FILE", "shard_file_name", "original_error"]


def original_error(exc: CheckpointException) -> BaseException:
    """The exception a rank raised inside DCP: this process's own when it failed (or, when it stopped because the
    process reading shared boxes for it failed, that process's), else the lowest rank's."""
    failures = exc.failures
    if not failures:
        return exc
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    wrapped = failures.get(rank, failures[min(failures)])
    error = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    peer = getattr(error, "shared_read_peer", None)  # stopped because the rank reading for it failed: that one's
    if peer is not None and peer in failures:
        error = failures[peer][0] if isinstance(failures[peer], tuple) else failures[peer]
    return error


@contextlib.contextmanager
def _single_process(no_dist: bool):
    """Without a process group DCP warns that it assumes one process; that is what these helpers mean."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)",  # 2.7+ | 2.6
                                    category=UserWarning)
        yield


def save(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: Any = None, threads: int = 0,
         durable: bool = True, commit: bool = True, planner: Any = None,
         writer: StorageWriter | None = None, storage_options: dict[str, Any] | None = None) -> Metadata:
    """``dcp.save(state_dict, storage_writer=StorageWriter(path, ...))``, raising the original error on every rank.

    Args:
        state_dict: DCP's state dict (tensors, DTensors, plain values, ``Stateful`` objects), same keys on every rank.
        path: the checkpoint folder (replaced atomically; see :class:`StorageWriter`).
        process_group: the ranks that save together (default: the whole world, or none without a process group).
        threads, durable, commit, storage_options: see :class:`StorageWriter` (``path`` may be ``s3://bucket/prefix``).
        planner: a DCP ``SavePlanner`` (default :class:`fastckpt.dcp.SavePlanner` without caching: DCP's
            ``DefaultSavePlanner`` whose coordinator merge runs over columns, with the same global plan and metadata).
        writer: a writer to use instead of a new one (to read its :attr:`StorageWriter.files` afterwards).

    Returns:
        DCP's global ``Metadata``.

    Raises:
        TypeError, DtypeError, OSError, ...: what the failing rank raised (this rank's own, or the lowest failing
        rank's); the previous checkpoint at ``path`` is intact.
    """
    if writer is None:  # the path becomes the writer's storage, once
        writer = StorageWriter(path, threads=threads, durable=durable, commit=commit, storage_options=storage_options)
    else:  # the writer's own storage is used; the path is still checked as any path is
        resolve(path, what="path")
    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        with _single_process(no_dist):
            planner = planner if planner is not None else SavePlanner()
            return _dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=process_group,
                             **no_dist_kwargs(_dcp.save, no_dist))
    except CheckpointException as exc:
        writer.abort()
        raise original_error(exc) from exc
    except BaseException:
        writer.abort()
        raise


def load(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: Any = None, threads: int = 0,
         planner: Any = None, verify: bool = True, storage_options: dict[str, Any] | None = None,
         read_once: bool = True) -> None:
    """``dcp.load(state_dict, storage_reader=StorageReader(path, ...))``, raising the original error on every rank.

    Fills ``state_dict`` in place (tensors, DTensors of any placement, plain values), resharding as needed.
    ``planner`` defaults to :class:`LoadPlanner`, which checks dtypes while planning: a mismatch on any rank
    raises on every rank before anything is read. ``verify`` (default): each rank sums every stored chunk it reads
    from and compares it with the crc32c in the folder's manifest before it fills any tensor (IntegrityError
    naming the file and tensor); with several processes another rank may already have filled its own tensors
    when one rank's chunk is damaged (DCP's read step has no barrier between the ranks' reads). ``read_once``
    (default): a box several processes load (replicated tensors) is read by one of them and sent to the others
    (see :class:`StorageReader`); the checkpoint's bytes are read from storage once in total.

    Raises:
        MissingStateError: ``state_dict`` keys the checkpoint does not hold (every one named, with the path),
            on every rank, before anything is read (DCP itself raises a bare ``RuntimeError`` naming one).
        HeaderError, DtypeError, ShapeMismatchError, IntegrityError, ...: what the failing rank raised.
    """
    reader = StorageReader(path, threads=threads, verify=verify, storage_options=storage_options,
                           process_group=process_group, read_once=read_once)
    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        with _single_process(no_dist):
            _dcp.load(state_dict, storage_reader=reader, planner=planner if planner is not None else LoadPlanner(),
                      process_group=process_group, **no_dist_kwargs(_dcp.load, no_dist))
    except CheckpointException as exc:
        error = original_error(exc)
        if reader.metadata_error is not None and isinstance(error, AssertionError):
            raise reader.metadata_error from exc  # DCP turns a failed read_metadata into an AssertionError
        if type(error) is RuntimeError and str(error).startswith("Missing key in checkpoint state_dict"):
            # another planner than LoadPlanner: DCP's own message names one key
            error = MissingStateError(f"{str(error).rstrip('.')} (pass planner=fastckpt.dcp.LoadPlanner() to "
                                      "name every missing key)")
        if isinstance(error, MissingStateError):
            raise MissingStateError(f"{os.fspath(path)}: {error}") from exc
        raise error from exc

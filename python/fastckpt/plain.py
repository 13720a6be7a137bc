"""``fastckpt.save`` / ``fastckpt.load``: plain checkpoint dicts, where ``torch.save`` / ``torch.load`` are used.

Nested dicts, lists and tuples of tensors and plain values become one crash-safe checkpoint folder: the tensors
in ``state.safetensors`` (written by the Rust core in one parallel pass straight from tensor memory, tied tensors
once), the structure as exact JSON in ``state.json`` (no pickle), and the manifest (see
:mod:`fastckpt._plan.dict_save` for the files). What comes back has the types that went in: integer and tuple
keys, tuples vs lists, OrderedDict, None, inf/nan, numpy scalars, ``torch.dtype`` / ``torch.device`` /
``torch.Size``, ``nn.Parameter``. A flat ``{str: tensor}`` dict is a plain safetensors file that
``safetensors.torch.load_file(path + "/state.safetensors")`` reads as it was.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from fastckpt._io.async_save.modes import check_mode, writer_for
from fastckpt._io.async_save.writer import AsyncSave, WriteTo, finish_pending, wait_for_saves_to
from fastckpt._io.location import check_location
from fastckpt._io.storage.local.commit import check_target, claim_target, write_checkpoint
from fastckpt._io.storage.local.folder import RETRIES, pinned
from fastckpt._plan.dict_load import read_dict_checkpoint
from fastckpt._plan.dict_save import build_dict_plan
from fastckpt._plan.load import check_input_dir
from fastckpt.checkpoint_impl import _check_common, _check_flags
from fastckpt.errors import CheckpointChangedError, OptionError

__all__ = ["save", "load"]


def save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    trust_pickle: bool = False,
    async_save: bool | str = False,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    host_memory_budget: int | str | None = None,
    durable: bool = True,
    threads: int = 0,
) -> Path | AsyncSave:
    """Save a checkpoint dict to the folder ``path``, crash-safely and without pickle.

    Args:
        obj: a dict, list or tuple, nested, of tensors (any dtype safetensors stores, CPU or CUDA) and plain
            values: None, bool, int, float (inf and nan too), str, bytes, numpy scalars and arrays, ``torch.dtype``,
            ``torch.device``, ``torch.Size``, dict / OrderedDict / Counter (any hashable keys of these kinds),
            list, tuple, set, frozenset.
        path: the checkpoint folder; replaced atomically if it exists (the previous one stays until the commit).
        trust_pickle: values of other types (custom objects, namedtuples, enums, functions) are written to the
            pickle part ``state.pkl``, which only ``load(..., trust_pickle=True)`` reads; default False refuses
            them.
        async_save: ``True``: return at once; tensors are written in the background. With ``optimizers``, their
            parameters and state are streamed from the live tensors and only each optimizer's next ``step()``
            waits, and a tensor written behind torch's back (``p.data``) before it was written fails the save
            (hashed at the call, as ``save_state``); ``"stream"`` skips those hashes; without ``optimizers``, both
            are ``"snapshot"``. ``"snapshot"``: the tensors are copied at the
            call into a reused host buffer pool, then written. The structure (JSON, pickle part) is made at the
            call either way. At most one async save is in flight.
        optimizers: the optimizers whose parameters and state ``obj`` holds (for ``async_save=True``).
        host_memory_budget: ``async_save=True`` with ``optimizers``: host bytes the copies may use (an int or
            ``"4GB"``); None: as needed.
        durable: fsync every file and folder before the commit (default True).
        threads: writer threads; 0 picks min(8, cores).

    Returns:
        The committed folder (absolute); with ``async_save``, an :class:`~fastckpt.AsyncSave` whose ``wait()``
        returns it once committed.

    Raises:
        TypeError: ``obj`` is not a dict, list or tuple, or a value needs pickle and ``trust_pickle`` is False (names
            its key path, e.g. ``checkpoint.hyper_parameters.activation``, and its type).
        DtypeError / MetaTensorError / ValueError: a tensor the format cannot hold (names it).
        ValueError: a bad ``async_save`` or ``threads``, or a URL (``s3://``, ``gs://``, ``file://``, ...): only
            local folders. NotADirectoryError: ``path`` is a file.
        DestinationNotWritableError: ``path``'s folder cannot be made or takes no new files (read-only, no
            permission, ``/proc``): raised at the call in every ``async_save`` mode, before anything is written,
            naming ``path``; also the builtin OSError subclass of its errno (``PermissionError``...).
        OSError: the folder cannot be written; nothing is left behind and the previous checkpoint is intact.

    Example:
        >>> fastckpt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 100}, "ckpt")
        >>> state = fastckpt.load("ckpt")
        >>> optimizer.load_state_dict(state["optimizer"])
    """
    _check_flags(trust_pickle=trust_pickle, durable=durable)
    check_mode(async_save)
    _check_common(threads)
    opts = [] if optimizers is None else list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    for i, opt in enumerate(opts):
        if not hasattr(opt, "param_groups") or not hasattr(opt, "register_step_pre_hook"):
            raise TypeError(f"optimizers[{i}] is a {type(opt).__name__}, expected a torch.optim.Optimizer")
    check_location(path, "path")
    finish_pending(wait=async_save != "snapshot")
    target = check_target(path, "path")
    plan = build_dict_plan(obj, trust_pickle=trust_pickle)
    write = functools.partial(write_checkpoint, durable=durable, threads=threads)
    # the writers of save_state's modes (fastckpt._io.async_save.modes); without optimizers an async save is a snapshot
    writer = writer_for(async_save if opts or not async_save else "snapshot", optimizers=opts,
                        budget=host_memory_budget)
    # an async save claims the folder at the call (claim_target), as the synchronous write does before its first byte
    return writer.write(plan, WriteTo(target.absolute() if async_save else target, write, claim=claim_target))


def load(
    path: str | os.PathLike[str],
    *,
    map_location: str | torch.device | dict[str, str] | None = None,
    trust_pickle: bool = False,
    verify: bool = True,
    threads: int = 0,
) -> Any:
    """Load what :func:`save` wrote to the folder ``path``: every file is checked first, then the object built.

    Args:
        path: a folder written by :func:`save` (a symlink to one is followed).
        map_location: where tensors land: a device (``"cpu"``, ``"cuda:0"``, ``torch.device``), or a
            ``{saved device: device}`` dict as ``torch.load`` takes; None: the device each tensor was saved from.
            CPU tensors are zero-copy views of a private mapping of the file (writing to them never reaches it).
        trust_pickle: read the pickle part ``state.pkl`` (written by ``save(..., trust_pickle=True)``).
            Unpickling can run arbitrary code: only for checkpoints you trust.
        verify: sum every byte of ``state.safetensors`` against the manifest's crc32c before any tensor is
            returned (IntegrityError naming the file and tensor), as :func:`fastckpt.load_state` does; False skips
            that sum (the small JSON files are always checked against the manifest: that is how a load tells one
            save from the next).
        threads: reader threads for the sums; 0 picks min(8, cores).

    Returns:
        The saved object, with its types (see the module docs); tied tensors share their storage again.

    Raises:
        MissingStateError: no such folder, no manifest, or a folder saved by ``save_state`` (another layout).
        HeaderError / IntegrityError: a damaged, truncated or inconsistent checkpoint (names the file and tensor).
        UnsafePickleError: the checkpoint has a pickle part and ``trust_pickle`` is False (names the part and the
            key paths it holds).
        ValueError: a URL ``path`` (only local folders), a tensor saved from a device this machine lacks (pass
            ``map_location``), or a bad ``map_location``.
        CheckpointChangedError: other saves replaced the folder while it was read, 5 times in a row.
    """
    _check_flags(trust_pickle=trust_pickle, verify=verify)
    _check_common(threads)
    check_location(path, "path")
    _check_map_location(map_location)
    folder = check_input_dir(Path(path))
    wait_for_saves_to(folder.absolute())
    for attempt in range(RETRIES):  # another save may replace the folder while it is read: start over
        try:
            with pinned(folder, verify=verify, threads=threads) as handle:
                return read_dict_checkpoint(handle, map_location=map_location, trust_pickle=trust_pickle)
        except CheckpointChangedError:
            if attempt == RETRIES - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _check_map_location(map_location: Any) -> None:
    devices = map_location.values() if isinstance(map_location, dict) else [map_location]
    for device in devices:
        if device is None:
            continue
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise OptionError(f"map_location {map_location!r} is not a torch device (or a dict of them): {exc}") \
                from None

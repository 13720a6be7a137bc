"""A :class:`~fastckpt.CheckpointManager` save of one step: into the memory tier (committed before ``step()``
returns, durable and replicated in the background), or straight to the durable tier (no memory tier).

A memory tier without room for the state (``/dev/shm`` full: ``ENOSPC``, a quota: ``EDQUOT``, tmpfs out of pages:
``ENOMEM``, at any file of the snapshot) does not lose the step: the partial snapshot is removed (its staging
folder; nothing was committed, so no restore can see it), a :class:`~fastckpt.errors.MemoryTierFullWarning` names
the memory folder, the bytes the state needs and the remedies, and the step is written to the durable tier in
``step()`` instead (:meth:`fastckpt.manager.durable.DurableWriter.write_now` on the main process; with several
processes another process's durable copy is the main process's, and a sharded state's durable save follows in
``step()`` anyway). The next save tries the memory tier again.

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import errno
import shutil
import warnings
from pathlib import Path
from typing import Any

from fastckpt._io.async_save.snapshot import has_device_tensors
from fastckpt._io.async_save.writer import submit
from fastckpt._io.group.distributed import Session
from fastckpt._io.storage.local.commit import write_checkpoint
from fastckpt._io.storage.local.layout import CHECKPOINTS_DIR
from fastckpt._io.storage.local.numbering import rotate_checkpoints
from fastckpt.errors import MemoryTierFullWarning

__all__ = ["FULL", "save_durably", "save_memory"]

#: what a full memory tier raises (tmpfs: ENOSPC, or ENOMEM when it cannot get pages; a quota: EDQUOT)
FULL = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)


def save_memory(mgr: Any, plan: Any, step: int, *, fallback: bool = True) -> Path | None:
    """Commit ``plan`` (step ``step``) in ``mgr``'s memory tier, then hand it to the durable writer and the
    replicator. A full memory tier (:data:`FULL`): the partial snapshot removed, warned, and with ``fallback`` the
    step written durably here when this process writes the durable tier.

    Returns:
        The committed memory-tier folder; the durable folder written instead, or None when this process's memory
        tier had no room and the durable tier is written by others (the main process, or the sharded save after).

    Raises:
        ValueError: the state is larger than ``host_memory_budget``. OSError: the tier cannot be written for
            another reason (the partial snapshot is removed; the previous checkpoint stays).
    """
    memory = mgr.memory
    assert memory is not None
    if mgr.budget is not None:
        if plan.nbytes > mgr.budget:
            raise ValueError(f"the state is {plan.nbytes} bytes, over host_memory_budget={mgr.budget} bytes; "
                             "raise the budget or pass memory=False")
        if mgr.durable is not None and 2 * plan.nbytes > mgr.budget:
            mgr.durable.wait()  # the older snapshot goes once its durable copy is made
    if mgr.durable is not None and step == mgr._handed:  # its copy reads the folder this save replaces
        mgr.durable.idle()
    save = None
    try:
        save = memory.begin(step=step)
        if has_device_tensors(plan):  # staged through the host buffer pool (device-to-host copies)
            submit(plan, save.staging, write=lambda p, _t, **kw: save.write(
                p, threads=mgr.threads, ready=kw.get("ready")), blocking=True).wait()
        else:
            save.write(plan, threads=mgr.threads)
        committed = save.commit()
    except OSError as exc:
        if save is not None:
            save.abort()  # the partial snapshot goes: nothing of it is committed or restorable
        if exc.errno not in FULL:
            raise
        return _full(mgr, plan, step, exc, fallback)
    except BaseException:
        if save is not None:
            save.abort()
        raise
    if mgr.durable is not None:
        mgr.durable.submit(step)
    if mgr.replicator is not None:
        mgr.replicator.submit(step)
    return Path(committed.location)


def _full(mgr: Any, plan: Any, step: int, exc: OSError, fallback: bool) -> Path | None:
    memory = mgr.memory
    try:
        free = shutil.disk_usage(memory.root).free
        room = f"{free} bytes free there now"
    except OSError:
        room = "its free space unknown"
    if fallback and mgr.durable is not None:
        instead = f"step {step} is written to the durable tier {mgr.project} now, in step()"
    else:
        instead = f"step {step} is made durable by {'every process' if mgr.sharded else 'process 0'} in the durable tier"
    warnings.warn(f"CheckpointManager: the memory tier {memory.root} has no room for step {step} ({exc.strerror or exc}"
                  f"; the state needs {plan.nbytes} bytes, {room}); the partial snapshot was removed and {instead}. "
                  "Pass memory=False (durable saves only), give the memory tier a larger folder (memory='/path', or "
                  "a larger /dev/shm), or save a smaller state", MemoryTierFullWarning, stacklevel=4)
    if fallback and mgr.durable is not None:
        return mgr.durable.write_now(plan, step, threads=mgr.threads)
    return None


def save_durably(mgr: Any, plan: Any, step: int) -> Path:
    """Without a memory tier: ``plan`` committed durably by the main process in ``step()`` (every process waits
    for it and raises its failure), then rotated to ``keep``."""
    target = mgr.project / CHECKPOINTS_DIR / f"checkpoint_{step}"

    def write() -> Path:
        write_checkpoint(plan, target, durable=True, threads=mgr.threads)
        if mgr.keep is not None:
            rotate_checkpoints(mgr.project, mgr.keep)
        return target

    return Session(f"CheckpointManager save of step {step}", mgr.timeout).on_main(write)

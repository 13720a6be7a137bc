"""What a :class:`~fastckpt.CheckpointManager` claims, makes and installs once its options are checked, and the
undoing of it all when the constructor fails part way (a collective timing out, another process failing, an
interrupt): a failed constructor leaves no owner file in ``/dev/shm``, no folder or project id file it made, no
gloo group and no signal handler.

In order: the memory folder (made, probed, claimed: :class:`~fastckpt._io.storage.memory.MemoryTier`), the durable
writer (main process), the gloo group and the replicator (several processes), the store keys' name and the project
folder's incarnation id (the main process makes them, every process receives them:
:mod:`fastckpt.manager.incarnation`), the event board, the signal handlers and their finalizer.

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import contextlib
import secrets
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fastckpt._io.group.distributed import Session
from fastckpt._io.storage.memory import MemoryTier
from fastckpt.manager.durable import DurableWriter
from fastckpt.manager.incarnation import missing_folders, project_id, undo_made
from fastckpt.manager.options import check_writable
from fastckpt.manager.preemption import EventBoard
from fastckpt.manager.replicas import Replicator

__all__ = ["start", "undo_start"]


def start(mgr: Any, root: Path | None, memory: Any, replicas: int, keep: int | None, storage_options: Any,
          number: int) -> None:
    """Claim, make and install what ``mgr`` holds (``number``: the manager's sequence number in this process,
    the same on every rank); what is done is recorded on ``mgr`` for :func:`undo_start`."""
    if root is not None:
        mgr._made += missing_folders(root)
        check_writable(root, memory)
        # one run per tier; each snapshot names its project and its incarnation (a restore skips another's)
        mgr.memory = MemoryTier(root, project=str(Path(mgr.project).resolve())).claim()
    if mgr.memory is not None and mgr.rank == 0 and not mgr.sharded:  # sharded: written in step()
        mgr.durable = DurableWriter(mgr.memory, mgr.project, keep=keep, remote=mgr.remote,
                                    storage_options=storage_options)
    if mgr.distributed and (replicas or mgr.memory is not None):  # every rank makes it (a collective)
        mgr.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=mgr.timeout))
    if mgr.distributed and replicas and mgr.memory is not None:
        mgr.replicator = Replicator(mgr.memory, rank=mgr.rank, world=mgr.world, replicas=replicas, group=mgr.group)

    def main() -> tuple[str, str | None]:  # the store keys' name (unused by any earlier launch sharing the store:
        pid = None  # an elastic restart) and the project's incarnation id (the main process writes it)
        if mgr.memory is not None:
            pid, made = project_id(mgr.project)
            mgr._made += made
        return secrets.token_hex(8), pid

    token, mgr.project_id = Session("CheckpointManager: naming its store keys", mgr.timeout).on_main(main)
    if mgr.memory is not None:
        mgr.memory.project_id = mgr.project_id
    store = dist.distributed_c10d._get_default_store() if mgr.distributed else None
    mgr.board = EventBoard(store, f"fastckpt/manager/{number}" + (f"/{token}" if mgr.distributed else ""))
    mgr.signals.install()
    # a manager never closed (dropped, or its close raised) must not keep catching SIGTERM
    mgr._finalizer = weakref.finalize(mgr, mgr.signals.uninstall)


def undo_start(mgr: Any) -> None:
    """Undo what :func:`start` did before it failed (never raises over the constructor's error)."""
    mgr.signals.uninstall()
    if mgr._finalizer is not None:
        mgr._finalizer.detach()
    if mgr.memory is not None:
        mgr.memory.unclaim()
    if mgr.group is not None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(mgr.group)
    undo_made(mgr._made)

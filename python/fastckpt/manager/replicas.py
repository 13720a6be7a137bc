"""Peer replicas in the background: after each save every process sends its memory-tier checkpoint to the
``replicas`` peers :func:`fastckpt._io.storage.peer.peer_ranks` names and receives the ones it keeps for others,
over a gloo group of its own (``dist.new_group(backend="gloo")``), in a thread, so the training collectives on the
default group never wait for it.

Every process replicates every save, in order (saves are agreed, so the sends and receives pair up); a new save
first waits for the previous replication to end (one in flight; the memory tier holds that folder meanwhile). A
failure (a peer died) is kept and raised at the next save or ``close()``.

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from fastckpt._io.storage.memory import MemoryTier
from fastckpt._io.storage.peer import exchange, peer_ranks, replica_tier

__all__ = ["Replicator"]

logger = logging.getLogger("fastckpt")


class Replicator:
    """Sends this rank's memory-tier checkpoints to its peers and keeps theirs (see the module docs)."""

    def __init__(self, memory: MemoryTier, *, rank: int, world: int, replicas: int, group: Any) -> None:
        self.memory = memory
        self.rank = rank
        self.group = group
        self.sends = peer_ranks(rank, world, replicas)
        self.recvs = [r for r in range(world) if rank in peer_ranks(r, world, replicas)]
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.done: int | None = None
        self.seconds: float | None = None

    def wait(self) -> None:
        """Wait for the replication in flight; raise its failure (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        exc, self._error = self._error, None
        if exc is not None:
            exc.add_note("(raised by the CheckpointManager's background peer replication)")
            raise exc

    def submit(self, step: int) -> None:
        """Replicate ``step`` (committed in the memory tier) in the background."""
        self.wait()
        self.memory.hold(step)
        self._thread = threading.Thread(target=self._run, args=(step,), name="fastckpt-replicas", daemon=True)
        self._thread.start()

    def _run(self, step: int) -> None:
        started = time.perf_counter()
        try:
            folder = self.memory.folder / f"checkpoint_{step}"
            exchange(folder, self.sends, [(src, replica_tier(self.memory.root, src)) for src in self.recvs],
                     self.group)
            self.done, self.seconds = step, time.perf_counter() - started
            logger.debug("CheckpointManager: step %d replicated to ranks %s in %.3f s", step, self.sends,
                         self.seconds)
        except BaseException as exc:  # raised by wait()
            self._error = exc
        finally:
            self.memory.release(step)
            self.memory.prune()  # the older snapshot it held goes now that a newer one is committed

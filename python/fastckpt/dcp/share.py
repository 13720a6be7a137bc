"""Read once per replica group: when several ranks load the same box of the same stored chunk (a replicated tensor,
DDP, HSDP replicas, AdamW's ``step``), one of them reads it and sends it to the others.

:func:`assign` runs on the coordinator inside DCP's planning round (the reader's ``prepare_global_plan``, which
sees every rank's plan): each box wanted by several ranks gets one reader (the one with the fewest elements to
read so far, so the reads spread over the ranks) and a tag; every rank's plan carries what it reads for others and
what it receives (``LoadPlan.storage_data["share"]``). :class:`Exchange` runs in ``read_data`` on every rank, over
point-to-point messages of the process group (gloo on CPU):

1. each rank posts, before reading, a receive of a status from every rank it receives from;
2. it reads what it reads (its own boxes and the ones it reads for others); then sends each receiver a status
   (0: the data follows, 1: this rank failed) and, when it succeeded, the boxes, while the others read;
3. it waits for every status, receives the boxes of the ranks that succeeded (always, so no sender is left
   waiting), waits for its own sends, and raises when it or a rank it receives from failed.

A rank that fails to read therefore makes every rank that waits on it raise :class:`~fastckpt.errors.CheckpointError`
naming it, at once; a rank that died makes them raise when the process group's timeout expires. DCP's read round
then raises on every rank, as for any failed read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from fastckpt.errors import CheckpointError

__all__ = ["assign", "Exchange", "PeerReadError"]

#: the tag of the status messages; a box's data goes with its own tag (1, 2, ...)
_STATUS = 0


class PeerReadError(CheckpointError):
    """This rank's load stopped because a rank that reads boxes for it failed: ``shared_read_peer`` is that rank
    (:func:`fastckpt.dcp.original_error` and a sharded load report that rank's own error instead)."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.shared_read_peer = peer

    def __reduce__(self) -> Any:  # DCP gathers every rank's exception by pickling it
        return type(self), (str(self), self.shared_read_peer)


def assign(plans: list[Any]) -> list[Any]:
    """Every rank's plan with its share of the reads (see the module docs); the plans as given when no box is
    wanted by two ranks."""
    from torch.distributed.checkpoint.planner import LoadItemType

    holders: dict[tuple, dict[int, int]] = {}
    for rank, plan in enumerate(plans):
        for pos, item in enumerate(plan.items):
            if item.type == LoadItemType.BYTE_IO:
                continue
            key = (item.storage_index.fqn, tuple(int(o) for o in (item.storage_index.offset or ())),
                   tuple(int(o) for o in item.storage_offsets), tuple(int(n) for n in item.lengths))
            holders.setdefault(key, {}).setdefault(rank, pos)  # a rank's second copy of a box is read by it
    load = [0] * len(plans)
    reads: list[list[tuple[int, list[int], int]]] = [[] for _ in plans]
    recvs: list[list[tuple[int, int, int]]] = [[] for _ in plans]
    tag = _STATUS
    for key, ranks in holders.items():
        if len(ranks) < 2:
            continue
        tag += 1
        reader = min(ranks, key=lambda r: (load[r], r))
        load[reader] += math.prod(key[3])
        others = [r for r in ranks if r != reader]
        reads[reader].append((ranks[reader], others, tag))
        for r in others:
            recvs[r].append((ranks[r], reader, tag))
    if tag == _STATUS:
        return plans
    return [dataclasses.replace(plan, storage_data={"share": {"read": reads[r], "recv": recvs[r]}})
            for r, plan in enumerate(plans)]


class Exchange:
    """One rank's side of the shared reads of a load (see the module docs).

    Args:
        share: ``plan.storage_data["share"]`` of this rank.
        group: the process group whose ranks the plan counts (None: the default group).
        what: the load, for messages.
    """

    def __init__(self, share: dict[str, Any], group: Any, what: str) -> None:
        self.reads = {int(pos): ([int(r) for r in receivers], int(tag)) for pos, receivers, tag in share["read"]}
        self.recvs = {int(pos): (int(reader), int(tag)) for pos, reader, tag in share["recv"]}
        self.group = group
        self.what = what
        self._status: dict[int, tuple[torch.Tensor, Any]] = {}
        self._sends: list[Any] = []
        self._held: list[torch.Tensor] = []  # what the pending sends send from

    def _global(self, rank: int) -> int:
        import torch.distributed as dist

        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def start(self) -> None:
        """Post the receive of each reader's status (before this rank reads anything)."""
        import torch.distributed as dist

        for reader in sorted({reader for reader, _ in self.recvs.values()}):
            status = torch.ones(1, dtype=torch.int64)
            self._status[reader] = (status, dist.irecv(status, src=self._global(reader), group=self.group,
                                                       tag=_STATUS))

    def send(self, sources: dict[int, torch.Tensor] | None) -> None:
        """Send every receiver a status, then (``sources``: ``{plan position: the box's bytes, uint8}``; None when
        this rank failed) the boxes it reads for it."""
        import torch.distributed as dist

        receivers = sorted({r for rs, _ in self.reads.values() for r in rs})
        for r in receivers:
            status = torch.tensor([0 if sources is not None else 1], dtype=torch.int64)
            self._held.append(status)
            self._sends.append(dist.isend(status, dst=self._global(r), group=self.group, tag=_STATUS))
        if sources is None:
            return
        for pos, (rs, tag) in sorted(self.reads.items(), key=lambda kv: kv[1][1]):
            data = sources[pos]
            self._held.append(data)
            for r in rs:
                self._sends.append(dist.isend(data, dst=self._global(r), group=self.group, tag=tag))

    def receive(self, buffers: dict[int, torch.Tensor]) -> list[int]:
        """Fill ``buffers`` (``{plan position: uint8 buffer of the box}``) from the readers that succeeded, wait
        for this rank's sends; returns the readers that reported a failure.

        Raises:
            CheckpointError: a message did not arrive within the process group's timeout (names the process).
        """
        import torch.distributed as dist

        failed = []
        for reader, (status, work) in self._status.items():
            self._wait(work, reader)
            if int(status[0]) != 0:
                failed.append(reader)
        pending = [(dist.irecv(buffers[pos], src=self._global(reader), group=self.group, tag=tag), reader)
                   for pos, (reader, tag) in sorted(self.recvs.items(), key=lambda kv: kv[1][1])
                   if reader not in failed]
        for work, reader in pending:
            self._wait(work, reader)
        for work in self._sends:
            self._wait(work, None)
        self._sends, self._held = [], []
        return failed

    def _wait(self, work: Any, peer: int | None) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: a peer gone, or the group's timeout
            who = f"process {peer}" if peer is not None else "a process this one sends to"
            raise CheckpointError(f"{self.what}: the boxes shared with {who} did not arrive: {exc}") from exc

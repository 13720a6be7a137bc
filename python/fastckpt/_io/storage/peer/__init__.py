"""Peer replicas: each process's memory-tier checkpoint also held in the memory tiers of ``k`` other processes
(NVIDIA resiliency's clique replication, Orbax's replicator), so a process whose machine was replaced restores
its part from a peer's RAM instead of from disk or object storage.

A replica of rank ``src`` lives in the receiving rank's memory tier under ``replicas/rank{src}`` as a
:class:`~fastckpt._io.storage.memory.MemoryTier` of tier ``"peer"``: a committed folder like any other (manifest
last, one rename), so it is listed, opened and checked (crc32c) like the own tier. The bytes travel over a
dedicated gloo process group (:func:`exchange`), in a thread of their own, so training collectives on the default
group are never blocked by them.

Wire format of one folder: an int64 tensor ``[header bytes]``, the UTF-8 JSON header ``{"step": n, "files":
[[name, bytes], ...]}`` (the manifest listed last), then each file as a uint8 tensor. A sender with nothing to
send sends a header of length 0.

May import: layers 0-2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fastckpt._io.storage.local.layout import MANIFEST, read_manifest
from fastckpt._io.storage.memory import MemorySave, MemoryTier

__all__ = ["exchange", "peer_ranks", "replica_tier", "replica_sources", "send_folder", "recv_folder"]

REPLICAS_DIR = "replicas"


def replica_tier(memory_root: Path, src: int) -> MemoryTier:
    """The tier holding rank ``src``'s replica inside ``memory_root`` (another rank's memory tier)."""
    return MemoryTier(Path(memory_root) / REPLICAS_DIR / f"rank{src}", tier="peer")


def replica_sources(memory_root: Path) -> list[int]:
    """The ranks whose replicas ``memory_root`` holds a folder for."""
    base = Path(memory_root) / REPLICAS_DIR
    if not base.is_dir():
        return []
    return sorted(int(p.name[4:]) for p in base.iterdir() if p.name.startswith("rank") and p.name[4:].isdigit())


def peer_ranks(rank: int, world: int, replicas: int, local_world: int | None = None) -> list[int]:
    """The ``replicas`` ranks that hold ``rank``'s replicas: ranks on other machines first (``local_world``
    processes per machine, ``LOCAL_WORLD_SIZE``; the same local rank on the next machines before the others), then
    the ones on the same machine, each group by distance ``(peer - rank) mod world``. On one machine: simply the
    next ranks. At most ``world - 1``."""
    if world < 2 or replicas < 1:
        return []
    local = local_world or int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    stride = local if 0 < local < world and world % local == 0 else world

    def key(d: int) -> tuple[bool, bool, int]:
        peer = (rank + d) % world
        return peer // stride == rank // stride, d % stride != 0, d

    return [(rank + d) % world for d in sorted(range(1, world), key=key)[:replicas]]


def _header(folder: Path | None) -> tuple[bytes, list[Path]]:
    if folder is None:
        return b"", []
    manifest = read_manifest(folder)
    names = [n for n in manifest.get("files", {}) if n != MANIFEST] + [MANIFEST]
    paths = [folder / n for n in names]
    head = {"step": int(manifest.get("step", 0)), "files": [[n, p.stat().st_size] for n, p in zip(names, paths)]}
    return json.dumps(head).encode(), paths


def _file_tensor(path: Path) -> torch.Tensor:
    data = np.fromfile(path, dtype=np.uint8)
    return torch.from_numpy(data)


def send_folder(folder: Path | None, dst: int, group: Any) -> list[Any]:
    """Send the committed checkpoint ``folder`` (None: nothing) to rank ``dst`` over ``group``; returns the
    pending send requests (wait on them)."""
    head, paths = _header(folder)
    reqs = [dist.isend(torch.tensor([len(head)], dtype=torch.int64), dst, group=group)]
    if head:
        reqs.append(dist.isend(torch.frombuffer(bytearray(head), dtype=torch.uint8), dst, group=group))
        for p in paths:
            t = _file_tensor(p)
            if t.numel():
                reqs.append(dist.isend(t, dst, group=group))
    return reqs


def recv_folder(src: int, group: Any, into: MemoryTier) -> int | None:
    """Receive one folder from rank ``src`` over ``group`` and commit it in ``into``; returns its step, or None
    when ``src`` had nothing to send.

    Raises:
        OSError: the folder cannot be written (nothing is committed).
    """
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    if int(size) == 0:
        return None
    head_t = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(head_t, src, group=group)
    head = json.loads(bytes(head_t.numpy()).decode())
    save: MemorySave = into.begin(step=int(head["step"]))
    try:
        for name, nbytes in head["files"]:
            buf = torch.empty(int(nbytes), dtype=torch.uint8)
            if nbytes:
                dist.recv(buf, src, group=group)
            if "/" in name or name.startswith("."):
                raise OSError(f"replica from rank {src}: refusing file name {name!r}")
            buf.numpy().tofile(save.staging / name)
        save.commit()
    except BaseException:
        save.abort()
        raise
    return int(head["step"])


def exchange(own: Path | None, sends: list[int], recvs: list[tuple[int, MemoryTier]], group: Any) -> list[int | None]:
    """Send ``own`` (a committed folder, or None) to each rank of ``sends`` and receive one folder from each
    ``(src, tier)`` of ``recvs`` into that tier; returns the received steps. Every rank of the group calls it with
    matching lists (what :func:`peer_ranks` gives every rank)."""
    reqs: list[Any] = []
    for dst in sends:
        reqs += send_folder(own, dst, group)
    got = [recv_folder(src, group, tier) for src, tier in recvs]
    for r in reqs:
        r.wait()
    return got

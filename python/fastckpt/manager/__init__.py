"""``fastckpt.CheckpointManager``: periodic, preemption-safe and crash-safe checkpoints of a training loop, with a
memory tier under ``/dev/shm``, peer replicas and a restore that takes the newest intact step across tiers.

Modules: :mod:`~fastckpt.manager.checkpoint_manager` (the manager), :mod:`~fastckpt.manager.preemption` (signals,
the agreement on the step), :mod:`~fastckpt.manager.schedule` (every n steps / seconds, continuous, Young/Daly),
:mod:`~fastckpt.manager.state` (what is saved), :mod:`~fastckpt.manager.durable` (the durable tier in the
background), :mod:`~fastckpt.manager.replicas` (peer replicas), :mod:`~fastckpt.manager.restore` (across tiers),
:mod:`~fastckpt.manager.saving` (one save: the memory tier, a full one's durable fallback),
:mod:`~fastckpt.manager.incarnation` (the project folder's id that memory snapshots record),
:mod:`~fastckpt.manager.starting` (what a manager claims and installs, undone when its constructor fails).
"""

from __future__ import annotations

from fastckpt.manager.checkpoint_manager import CheckpointManager
from fastckpt.manager.preemption import Preempted, release_kept
from fastckpt.manager.schedule import young_daly_interval

__all__ = ["CheckpointManager", "Preempted", "release_kept", "young_daly_interval"]

"""Phase 2 of a load: :class:`LoadPlan`, a load that phase 1 (:func:`fastckpt._plan.load.plan_load`, or
:func:`fastckpt._plan.accelerate_load.plan_accelerate_load` for accelerate's layout) has validated in full, and
:meth:`LoadPlan.apply`, which changes the live objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastckpt._state.live_targets import read_tensors
from fastckpt._state.model import ModelLoadPlan, apply_module_load
from fastckpt._state.rng import RngState

__all__ = ["LoadPlan"]


@dataclass
class LoadPlan:
    """A validated load: apply it with :meth:`apply`."""

    models: list[ModelLoadPlan] = field(default_factory=list)
    optimizers: list[tuple[Any, dict]] = field(default_factory=list)
    schedulers: list[tuple[Any, dict]] = field(default_factory=list)
    rng: RngState | None = None
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    objects: list[tuple[Any, Any]] = field(default_factory=list)  # (obj, state) for obj.load_state_dict(state)
    live_reads: list[tuple[Any, list]] = field(default_factory=list)  # (file, [(name, live tensor)]), phase 2

    def apply(self, *, threads: int = 0) -> None:
        """Phase 2: change the live objects."""
        for plan in self.models:
            apply_module_load(plan, threads=threads)
        for file, targets in self.live_reads:  # optimizer state read in place (fastckpt._state.live_targets)
            read_tensors(file, targets, threads=threads)
        for opt, state in self.optimizers:
            opt.load_state_dict(state)
        for sched, state in self.schedulers:
            sched.load_state_dict(state)
        for obj, state in self.objects:
            obj.load_state_dict(state)
        if self.rng is not None:
            self.rng.restore()

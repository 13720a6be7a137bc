"""Phase 2 of a load: :class:`LoadPlan`, a load that phase 1 (:func:`fastckpt._plan.load.plan_load`, or
:func:`fastckpt._plan.accelerate_load.plan_accelerate_load` for accelerate's layout) has validated in full, and
:meth:`LoadPlan.apply`, which changes the live objects.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from fastckpt._state.live_targets import read_tensors
from fastckpt._state.model import ModelLoadPlan, apply_module_load
from fastckpt._state.rng import RngState

__all__ = ["LoadPlan", "apply_undoable"]


def apply_undoable(loads: list[tuple[Any, Any]]) -> None:
    """``obj.load_state_dict(state)`` for each pair; if one raises, the objects already loaded get their previous
    ``state_dict()`` back (a deep copy taken before) and the error propagates, with a note saying so. Objects
    without a ``state_dict`` (nothing to put back) are loaded last."""
    done: list[tuple[Any, Any]] = []
    loads = sorted(loads, key=lambda pair: not callable(getattr(pair[0], "state_dict", None)))
    try:
        for obj, state in loads:
            if not callable(getattr(obj, "state_dict", None)):
                obj.load_state_dict(state)
                continue
            previous = copy.deepcopy(obj.state_dict())
            obj.load_state_dict(state)
            done.append((obj, previous))
    except BaseException as exc:
        for obj, previous in reversed(done):
            obj.load_state_dict(previous)
        exc.add_note(f"fastckpt: {type(obj).__name__}.load_state_dict failed; {len(done)} object(s) loaded before "
                     "it were put back and nothing else was changed")
        raise


@dataclass
class LoadPlan:
    """A validated load: apply it with :meth:`apply`."""

    models: list[ModelLoadPlan] = field(default_factory=list)
    optimizers: list[tuple[Any, dict]] = field(default_factory=list)
    schedulers: list[tuple[Any, dict]] = field(default_factory=list)
    rng: RngState | None = None
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # saved parts not applied (strict=False), with the reason
    objects: list[tuple[Any, Any]] = field(default_factory=list)  # (obj, state) for obj.load_state_dict(state)
    live_reads: list[tuple[Any, list]] = field(default_factory=list)  # (file, [(name, live tensor)]), phase 2

    def apply(self, *, threads: int = 0) -> None:
        """Phase 2: change the live objects.

        Schedulers and registered objects go first, each one's state kept: if a ``load_state_dict`` raises, those
        already applied get their state back and the error is raised with nothing else changed.
        """
        apply_undoable([*self.schedulers, *self.objects])
        for plan in self.models:
            apply_module_load(plan, threads=threads)
        for file, targets in self.live_reads:  # optimizer state read in place (fastckpt._state.live_targets)
            read_tensors(file, targets, threads=threads)
        for opt, state in self.optimizers:
            opt.load_state_dict(state)
        if self.rng is not None:
            self.rng.restore()

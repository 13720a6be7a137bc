"""Which LR scheduler class saved a state, so a load can refuse (``strict``) or skip the state of another class.

The classes are recorded in the manifest (``"scheduler_classes"``, one ``module.QualName`` per scheduler, seen
through accelerate's ``AcceleratedScheduler`` wrapper). A state of another class would load without complaint
(``load_state_dict`` only updates ``__dict__``) and then schedule wrongly.
"""

from __future__ import annotations

from typing import Any

from fastckpt.errors import KeyMismatchError

__all__ = ["scheduler_class_name", "scheduler_fits"]


def scheduler_class_name(scheduler: Any) -> str:
    """``module.QualName`` of the scheduler's class (the wrapped one for accelerate's ``AcceleratedScheduler``)."""
    inner = getattr(scheduler, "scheduler", None) if type(scheduler).__name__ == "AcceleratedScheduler" else None
    cls = type(inner if inner is not None else scheduler)
    return f"{cls.__module__}.{cls.__qualname__}"


def scheduler_fits(saved_class: Any, scheduler: Any, *, strict: bool, where: str) -> bool:
    """Whether the state saved by ``saved_class`` may be loaded into ``scheduler``; False: skip it (not ``strict``).

    Raises:
        KeyMismatchError: ``strict`` and the classes differ (names both).
    """
    live_class = scheduler_class_name(scheduler)
    if not isinstance(saved_class, str) or saved_class == live_class:
        return True
    if strict:
        raise KeyMismatchError(
            f"{where}: the state was saved by {saved_class} but the live scheduler is {live_class}; with "
            "strict=False this scheduler keeps its own state (reported in LoadResult.skipped). Nothing was changed."
        )
    return False

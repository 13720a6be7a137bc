"""When a :class:`~fastckpt.CheckpointManager` saves: every ``n`` steps, every so many seconds, continuously, or at
the interval Young and Daly's formula gives from the measured save cost and a mean time between failures.

- ``every_n_steps=n``: a save is due at ``step(s)`` when ``s % n == 0`` (the same on every process, no agreement
  needed).
- ``every_seconds=t``: due at the first step boundary at least ``t`` seconds after the previous save started.
- ``continuous=True``: due as soon as the previous save is durable (Orbax's continuous checkpointing).
- ``mtbf=t`` (seconds): ``every_seconds`` becomes ``sqrt(2 * cost * mtbf)`` (:func:`young_daly_interval`), where
  ``cost`` is the measured seconds a save blocks training (a running mean of the saves so far; the first save is
  made at the first step boundary to measure it).

The time-based kinds are decided by the main process and agreed through the
:class:`~fastckpt.manager.preemption.EventBoard` (a clock read differs across machines).

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import math
import time

from fastckpt.errors import OptionError, OptionTypeError

__all__ = ["Schedule", "young_daly_interval"]


def young_daly_interval(cost: float, mtbf: float) -> float:
    """The checkpoint interval (seconds) that minimises expected lost work, ``sqrt(2 * cost * mtbf)`` (Young
    1974, Daly 2006), for a save that costs ``cost`` seconds and a mean time between failures of ``mtbf``
    seconds.

    Raises:
        ValueError: a negative cost or a non-positive ``mtbf``.

    Example:
        >>> young_daly_interval(2.0, 3600.0)  # a 2 s save, a failure an hour
        120.0
    """
    if not cost >= 0 or not mtbf > 0:
        raise ValueError(f"need cost >= 0 and mtbf > 0 seconds, got cost={cost!r}, mtbf={mtbf!r}")
    return math.sqrt(2.0 * cost * mtbf)


def _positive(name: str, value: object, kind: type = float) -> None:
    if value is None:
        return
    what = "finite number of seconds" if kind is float else "int"
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise OptionTypeError(f"{name} must be a positive {what}, got {type(value).__name__} {value!r}")
    if not value > 0 or not math.isfinite(value):  # nan fails both; inf would never be due
        raise OptionError(f"{name} must be a positive {what}, got {value!r}")


class Schedule:
    """The save schedule of one manager (see the module docs).

    Raises:
        OptionError: a non-positive, infinite or nan option; ``mtbf`` together with ``every_seconds``.
        OptionTypeError: a bool or non-numeric option (``every_n_steps=True``, ``continuous="no"``).
    """

    def __init__(self, *, every_n_steps: int | None = None, every_seconds: float | None = None,
                 continuous: bool = False, mtbf: float | None = None) -> None:
        _positive("every_n_steps", every_n_steps, int)
        _positive("every_seconds", every_seconds)
        _positive("mtbf", mtbf)
        if mtbf is not None and every_seconds is not None:
            raise OptionError(f"pass mtbf= (the interval follows from the save cost) or every_seconds=, not both; got "
                              f"mtbf={mtbf!r}, every_seconds={every_seconds!r}")
        if not isinstance(continuous, bool):
            raise OptionTypeError(f"continuous must be True or False, got {type(continuous).__name__} {continuous!r}")
        self.every_n_steps = every_n_steps
        self.every_seconds = every_seconds
        self.continuous = bool(continuous)
        self.mtbf = mtbf
        self.last_save: float | None = None  # time.monotonic() at the start of the last save
        self.costs: list[float] = []  # seconds each save blocked training
        self.intervals: list[int] = []  # steps between consecutive saves
        self._last_step: int | None = None

    @property
    def timed(self) -> bool:
        """Whether saves are decided by the clock or by the durable tier (the main process decides them)."""
        return self.every_seconds is not None or self.continuous or self.mtbf is not None

    @property
    def cost(self) -> float | None:
        """The mean seconds a save blocked training so far (None before the first)."""
        return sum(self.costs) / len(self.costs) if self.costs else None

    @property
    def interval_seconds(self) -> float | None:
        """The seconds between time-based saves: ``every_seconds``, or Young/Daly's from the measured cost."""
        if self.mtbf is not None:
            return None if self.cost is None else young_daly_interval(self.cost, self.mtbf)
        return self.every_seconds

    def due_by_steps(self, step: int) -> bool:
        """``every_n_steps`` divides ``step``."""
        return self.every_n_steps is not None and step % self.every_n_steps == 0

    def due_by_time(self, *, durable_busy: bool, now: float | None = None) -> bool:
        """A time-based save is due now (the main process asks at each step boundary)."""
        if self.continuous and not durable_busy:
            return True
        interval = self.interval_seconds
        if self.mtbf is not None and interval is None:
            return True  # no save measured yet
        if interval is None:
            return False
        now = time.monotonic() if now is None else now
        return self.last_save is None or now - self.last_save >= interval

    def saved(self, step: int, started: float, seconds: float) -> None:
        """Record a save of ``step`` that started at ``started`` (monotonic) and blocked ``seconds``."""
        if self._last_step is not None and step > self._last_step:
            self.intervals.append(step - self._last_step)
        self._last_step = step
        self.last_save = started
        self.costs.append(seconds)
        del self.costs[:-20]  # a running mean of the recent saves

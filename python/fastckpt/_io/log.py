"""fastckpt's log lines: ``logging.getLogger("fastckpt")``.

INFO, one line per save and per load: the folder, the parts (files), the bytes, the seconds and the rate in GB/s
(10**9 bytes per second). DEBUG, one line per file written or opened. fastckpt adds no handler: configure logging
as usual (``logging.basicConfig(level=logging.INFO)``) to see them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

__all__ = ["logger", "log_save", "log_load", "log_file", "rate"]

logger = logging.getLogger("fastckpt")


def rate(nbytes: int, seconds: float) -> float:
    """GB/s (10**9 bytes per second); 0.0 for no time."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def log_file(action: str, path: Any, nbytes: int) -> None:
    """DEBUG: one file ``action`` (``"wrote"``, ``"opened"``) with its size in bytes."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s %s (%d bytes)", action, path, nbytes)


def log_save(target: Path, plan: Any, seconds: float, *, in_place: str | None = None) -> None:
    """INFO: a committed save of ``plan`` (a :class:`~fastckpt._io.files.SavePlan`) to ``target``."""
    if not logger.isEnabledFor(logging.INFO):
        return
    nbytes = plan.nbytes + sum(len(t) for t in plan.texts.values())
    if logger.isEnabledFor(logging.DEBUG):
        for part in plan.parts:
            log_file("wrote", target / part.name, sum(t.numel() * t.element_size() for t in part.tensors.values()))
        for name, text in plan.texts.items():
            log_file("wrote", target / name, len(text))
    how = f", committed in place ({in_place})" if in_place else ""
    logger.info("saved %s (%s): %d parts, %d bytes in %.3f s, %.2f GB/s%s", target, plan.mode,
                len(plan.parts) + len(plan.texts), nbytes, seconds, rate(nbytes, seconds), how)


def log_load(folder: Any, parts: int, nbytes: int, seconds: float, *, model_only: bool = False) -> None:
    """INFO: a load of ``parts`` files (``nbytes`` bytes) from ``folder``."""
    logger.info("loaded %s (%s): %d parts, %d bytes in %.3f s, %.2f GB/s", folder,
                "model_only" if model_only else "full", parts, nbytes, seconds, rate(nbytes, seconds))

"""The manager tests run many managers in one process: a case that caught ``Preempted`` leaves its signal handler
kept until exit (fastckpt.manager.preemption.keep_until_exit); it is released after each case."""

from __future__ import annotations

import pytest

from fastckpt.manager.preemption import release_kept


@pytest.fixture(autouse=True)
def _release_kept_handlers():
    yield
    release_kept()

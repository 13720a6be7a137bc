"""Counters for the suite's closing line (printed by ``pytest_terminal_summary`` in conftest.py):

    fastckpt faults: N faults injected, M malformed files tried, K fuzz inputs replayed, nothing lost

Fault tests call :func:`record` after they checked that nothing was lost (the previous checkpoint loads bit-exact),
so a count is only ever added by a test that got that far.
"""

from __future__ import annotations

from collections import Counter

#: kind -> count; kinds: "faults" (kills, injected errors, full disks...), "malformed" (hostile files fed to a
#: loader), "fuzz" (fuzz regression inputs and hypothesis examples replayed)
COUNTS: Counter[str] = Counter()

#: test modules whose failures mean something may have been lost
FAULT_MODULES = ("test_crash_kill", "test_concurrent_saves", "test_integrity", "test_hostile_files",
                 "test_resource_faults", "test_staging", "test_hostile_checkpoints")


def record(kind: str, n: int = 1) -> None:
    """Count ``n`` more of ``kind``."""
    if kind not in ("faults", "malformed", "fuzz"):
        raise ValueError(f"unknown fault kind {kind!r}")
    COUNTS[kind] += n


def summary_line(failed_fault_tests: int) -> str:
    """The closing line; ``failed_fault_tests`` is how many tests of :data:`FAULT_MODULES` failed."""
    verdict = "nothing lost" if failed_fault_tests == 0 else f"{failed_fault_tests} FAULT TEST(S) FAILED"
    return (f"fastckpt faults: {COUNTS['faults']} faults injected, {COUNTS['malformed']} malformed files tried, "
            f"{COUNTS['fuzz']} fuzz inputs replayed, {verdict}")

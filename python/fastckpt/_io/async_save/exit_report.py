"""A background save that failed and that nobody waited on is reported when the interpreter exits (case C30,
orbax#605): on stderr, and in the exit status.

A script that starts ``save_state(..., async_save=True)`` (or a tiered save, or an async save to ``s3://``) and
ends without ``wait()`` exits after the save, since its thread is not a daemon. When that save failed (a full disk,
its folder removed, the store gone), nothing was committed and the previous checkpoint is still the latest, but
the script would exit 0 with nothing said. So, once the interpreter has joined every non-daemon thread (the end of
``threading._shutdown``, before any ``atexit`` function runs), every failure no ``wait()`` or later save raised is
written to stderr with its traceback, the ``atexit`` functions run as they would have, and the process exits with
status 1 (``os._exit`` after flushing stdout and stderr: nothing else is left to run but module teardown).

Saves report their failures through sources registered with :func:`watch`: each returns, once every save it
knows of finished, ``[(what, exception)]`` for the failures not reported yet, marking them reported.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from collections.abc import Callable

__all__ = ["EXIT_STATUS", "report_failures", "watch"]

#: the exit status of a process whose background save failed unreported
EXIT_STATUS = 1

Source = Callable[[], list[tuple[str, BaseException]]]
_sources: list[Source] = []
_lock = threading.Lock()
_installed = False


def watch(source: Source) -> None:
    """Report ``source``'s unreported failures at exit (installs the exit hook once; a source is added once)."""
    global _installed
    with _lock:
        if source not in _sources:
            _sources.append(source)
        if _installed:
            return
        _installed = True
    real = threading._shutdown  # type: ignore[attr-defined]

    def shutdown_then_report() -> None:
        real()  # every non-daemon thread joined: the writers are done
        if report_failures(sys.stderr):
            _exit_after_atexit(EXIT_STATUS)

    threading._shutdown = shutdown_then_report  # type: ignore[attr-defined]


def report_failures(stream: object) -> int:
    """Write every unreported failure of the watched saves to ``stream``; returns how many."""
    with _lock:
        sources = list(_sources)
    failures = [failure for source in sources for failure in source()]
    for what, exc in failures:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        stream.write(f"fastckpt: {what} failed and no wait() raised it: nothing was committed there (the previous "  # type: ignore[attr-defined]
                     f"checkpoint, if any, is still the latest). Exit status {EXIT_STATUS}.\n{text}")
    if failures:
        stream.flush()  # type: ignore[attr-defined]
    return len(failures)


def _exit_after_atexit(status: int) -> None:
    """Run the ``atexit`` functions (none has run yet), flush stdout and stderr, and exit with ``status``."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:
                pass
        os._exit(status)

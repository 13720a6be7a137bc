"""The outcome of one background save, waited on with no lock the writer thread needs.

``concurrent.futures.Future.result()`` waits under the future's condition lock. A Ctrl-C is a ``KeyboardInterrupt``
raised in the main thread at whatever instruction it is running; landing right after ``Condition.__enter__`` took
that lock (the interpreter runs signal handlers after a C call returns), it leaves the lock held by the main thread
for good. The writer thread then blocks forever in ``set_result``, and the interpreter, which joins the (non-daemon)
writer before it exits, hangs: a real hang of the process after one Ctrl-C, more likely the busier the machine.

:class:`Outcome` is set once by the writer, which never blocks doing so; each waiter blocks on a lock of its own
that the writer releases, so an exception raised in a waiter at any instruction can leave nothing held that the
writer or another waiter needs.
"""

from __future__ import annotations

import _thread
from typing import Any

__all__ = ["Outcome"]


class Outcome:
    """A value or an exception, set once by :meth:`finish`; :meth:`wait` from any thread, interruptible."""

    def __init__(self) -> None:
        self._waiters: list[Any] = []
        self._finished = False
        self.value: Any = None
        self.error: BaseException | None = None

    def finish(self, value: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome and wake every waiter (writer thread; never blocks)."""
        self.value, self.error = value, error
        self._finished = True
        for waiter in list(self._waiters):  # each is locked until released here, exactly once
            waiter.release()

    def done(self) -> bool:
        """True once :meth:`finish` ran."""
        return self._finished

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished or ``timeout`` seconds passed (None: no limit); returns :meth:`done`."""
        if self._finished:
            return True
        waiter = _thread.allocate_lock()
        waiter.acquire()
        self._waiters.append(waiter)
        if not self._finished:  # finish() set the flag before it read the list: it releases this waiter
            waiter.acquire(True, -1 if timeout is None else max(timeout, 0.0))
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        return self._finished

    def result(self, timeout: float | None = None) -> Any:
        """The value, or raise the error; ``TimeoutError`` when not finished within ``timeout`` seconds."""
        if not self.wait(timeout):
            raise TimeoutError
        if self.error is not None:
            raise self.error
        return self.value

"""Asynchronous saves: the caller waits only for a snapshot; a background thread writes the checkpoint.

``fastckpt.save_state(..., async_save=True)`` builds the save plan, copies its tensors into a slot of a reused
host buffer pool (:mod:`fastckpt._io.async_save.snapshot`, :mod:`fastckpt._io.async_save.host_pool`) and returns an :class:`AsyncSave`
handle. One writer thread then writes the snapshot exactly as a synchronous save does (staging folder, all files
in one parallel pass, manifest last, atomic commit), so the checkpoint holds the values as of the call even while
training goes on updating the parameters in place, and a crash mid-write leaves the previous checkpoint intact.

- At most ``max_in_flight`` saves exist at once (default 1): a save that finds every pool slot taken waits for the
  oldest to finish writing before it copies anything.
- A failed background save raises its exception from :meth:`AsyncSave.wait`, or else from the next ``save_state``
  call (async or not), once.
- A synchronous save first waits for the async saves in flight, so saves are committed in call order.
- Automatic names (``output_dir=None``) skip the numbers that saves still in flight will commit.
- The writer thread is not a daemon: the interpreter waits for saves in flight before it exits, and a failure
  nothing raised is then reported on stderr and in the exit status (:mod:`fastckpt._io.async_save.exit_report`).

A synchronous save of CUDA tensors uses the same machinery with the caller waiting (``blocking=True``): the
device-to-host copies of later chunks then overlap the writing of earlier ones (see :func:`submit`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastckpt._io.async_save.cancel import CancelToken, arm_second_interrupt
from fastckpt._io.async_save.exit_report import watch
from fastckpt._io.async_save.host_pool import HostBufferPool
from fastckpt._io.async_save.outcome import Outcome
from fastckpt._io.async_save.snapshot import Snapshot, snapshot_plan
from fastckpt._io.files import SavePlan
from fastckpt._io.storage.base import Committed

__all__ = ["AsyncSave", "AsyncSaver", "WriteTo", "claim_at_call", "committed_path", "default_saver", "finish_pending", "release_buffers", "submit",
           "wait_for_saves_to"]

_NUMBERED = re.compile(r"^checkpoint_(\d+)$")


class AsyncSave:
    """The handle of one asynchronous save, returned by ``save_state(..., async_save=True)``.

    Attributes:
        path: the checkpoint folder it commits (absolute), or the ``s3://`` URL (a ``str``) it uploads to.
        blocking_seconds: how long the caller was blocked (seconds).
        snapshot_bytes: bytes copied at the call (the whole state with ``async_save="snapshot"``; for a streaming
            save only the buffers, small tensors and unowned parameters).
        buffer_ptr: address of the pool buffer holding the snapshot (the same across saves while it is reused).
        pool_allocations: allocations of that buffer so far (stays 1 while the state does not grow).
    """

    def __init__(self, path: Path | str, outcome: Outcome, snapshot: Snapshot | None, blocking_seconds: float, *,
                 stream: Any = None, token: CancelToken | None = None) -> None:
        self.path = path
        self._token = token
        self.blocking_seconds = blocking_seconds
        self.snapshot_bytes = snapshot.nbytes if snapshot is not None else stream.call_bytes
        self._snapshot_slot = snapshot.slot if snapshot is not None else None
        self._stream = stream
        self.pool_allocations = snapshot.slot.allocations if snapshot is not None else 0
        self._outcome = outcome
        self._reported = False

    @property
    def buffer_ptr(self) -> int:
        """Address of the pool buffer the save copied into (0 when a streaming save needed no copy)."""
        if self._stream is not None:
            return self._stream.buffer_ptr
        assert self._snapshot_slot is not None
        return self._snapshot_slot.data_ptr

    def done(self) -> bool:
        """True once the save is committed or has failed (never blocks)."""
        return self._outcome.done()

    def wait(self, timeout: float | None = None) -> Path | str:
        """Block until the checkpoint is committed (durable when saved with ``durable=True``).

        Args:
            timeout: seconds to wait; None waits as long as it takes.

        Returns:
            The committed checkpoint folder (for an ``s3://`` save, its URL as a ``str``).

        Raises:
            TimeoutError: not finished within ``timeout`` seconds (the save goes on).
            KeyboardInterrupt: Ctrl-C while waiting: the save goes on and is committed before the interpreter
                exits, unless a second Ctrl-C comes while it is in flight, which cancels it (nothing committed;
                see :mod:`fastckpt._io.async_save.cancel`).
            SaveCancelledError: the save was cancelled before its commit (:meth:`cancel`).
            Exception: whatever the background write raised (OSError for a full disk, ...), re-raised here; the
                previous checkpoint at ``path`` is then intact.
        """
        try:
            return self._outcome.result(timeout)
        except KeyboardInterrupt as exc:
            if not self._outcome.done() and self._token is not None:
                exc.add_note(arm_second_interrupt(self))
            raise
        except BaseException as exc:
            if self._outcome.done():
                self._reported = True
            if isinstance(exc, TimeoutError) and not self._outcome.done():
                raise TimeoutError(f"async save to {self.path} not finished within {timeout} s") from None
            raise

    def cancel(self) -> bool:
        """Cancel the save if its commit has not begun: the writer stops before the commit, nothing is committed
        and the previous checkpoint stays (``wait()`` then raises :class:`~fastckpt.errors.SaveCancelledError`).

        Returns:
            True if the save will commit nothing; False once its commit has begun (or on a process of a
            multi-process save other than the main one, which commits nothing itself).
        """
        cancelled = self._token is not None and self._token.cancel()
        if cancelled:
            self._reported = True  # asked for: not raised again by the next save
        return cancelled

    def exception(self) -> BaseException | None:
        """The background write's exception once it failed; None while running or after success."""
        return self._outcome.error if self._outcome.done() else None

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self.exception() else "committed")
        return f"AsyncSave({str(self.path)!r}, {state}, {self.snapshot_bytes:,} bytes)"


class AsyncSaver:
    """A host buffer pool plus one writer thread; ``save_state`` uses the process-wide :func:`default_saver`.

    Args:
        max_in_flight: saves that may be snapshotted and not yet written at once (pool slots), >= 1. Each slot
            holds one state's bytes of host memory, allocated on first use and reused afterwards.
        pin_memory: pin the pool (page-locked); None pins when CUDA is available.
    """

    def __init__(self, max_in_flight: int = 1, *, pin_memory: bool | None = None) -> None:
        self.pool = HostBufferPool(max_in_flight, pin_memory=pin_memory)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastckpt-async-save")
        self._lock = threading.Lock()
        self._pending: list[AsyncSave] = []
        self._idle: threading.Timer | None = None

    def raise_failed(self) -> None:
        """Re-raise the first failure of an earlier save that was not yet reported (each is raised once)."""
        with self._lock:
            failed = next((h for h in self._pending if h.done() and not h._reported and h.exception()), None)
            if failed is not None:
                failed._reported = True
            self._pending = [h for h in self._pending if not h.done() or (not h._reported and h.exception())]
        if failed is None:
            return
        exc = failed.exception()
        assert exc is not None
        exc.add_note(f"(raised by the earlier async save to {failed.path}, reported at the next save)")
        raise exc

    def unreported(self) -> list[tuple[str, BaseException]]:
        """``[(what, exception)]`` of the finished saves whose failure nothing raised yet, marked reported (for the
        report at exit, :mod:`fastckpt._io.async_save.exit_report`)."""
        with self._lock:
            failed = [h for h in self._pending if h.done() and not h._reported and h.exception() is not None]
            for h in failed:
                h._reported = True
        return [(f"the async save to {h.path}", h._outcome.error) for h in failed]  # type: ignore[misc]

    def wait_all(self) -> None:
        """Wait for every save in flight, then re-raise the first unreported failure."""
        with self._lock:
            pending = list(self._pending)
        for h in pending:
            h._outcome.wait()  # a failure is reported by raise_failed below
        self.raise_failed()

    def reserve(self, save: Any) -> None:
        """For a save to an automatic ``checkpoint_N`` name (``save.number`` set), move it above every number still
        being written (``save.renumber(n)``)."""
        target = save.target
        m = _NUMBERED.match(target.name) if isinstance(target, Path) and save.number is not None else None
        if m is None:
            return
        with self._lock:
            taken = [int(g.group(1)) for h in self._pending if not h.done() and isinstance(h.path, Path)
                     and h.path.parent == target.parent and (g := _NUMBERED.match(h.path.name))]
        n = max([int(m.group(1)), *(t + 1 for t in taken)])
        if n != int(m.group(1)):
            save.renumber(n)

    def start(self, target: Path, run: Callable[[], Path], *, blocking_seconds: float, stream: Any,
              token: CancelToken | None = None) -> AsyncSave:
        """Run ``run()`` on the writer thread for a save prepared by the caller (a streaming save,
        :mod:`fastckpt._io.async_save.stream`, which checks ``token`` before its commit); returns its handle."""
        self._cancel_idle()
        outcome = Outcome()
        self._executor.submit(self._then_idle(run, outcome))
        handle = AsyncSave(target, outcome, None, blocking_seconds, stream=stream, token=token)
        with self._lock:
            self._pending.append(handle)
        return handle

    def in_flight_to(self, folder: Path) -> list[AsyncSave]:
        """Saves in flight whose checkpoint is ``folder`` or lies inside it (an automatic-naming root)."""
        folder = Path(folder).absolute()
        with self._lock:
            return [h for h in self._pending if not h.done()
                    and (Path(h.path).absolute() == folder or folder in Path(h.path).absolute().parents)]

    def release_buffers(self) -> int:
        """Free the host buffers of every idle pool slot; returns the bytes freed."""
        return self.pool.release_buffers()

    def _then_idle(self, run: Callable[[], Path], outcome: Outcome) -> Callable[[], None]:
        """``run()`` on the writer thread, its result or exception into ``outcome`` (never the executor's future,
        which the caller must not wait on: see :mod:`fastckpt._io.async_save.outcome`)."""
        def wrapped() -> None:
            value: Any = None
            error: BaseException | None = None
            try:
                value = run()
            except BaseException as exc:
                error = exc
            try:
                self._arm_idle()
            finally:
                outcome.finish(value, error)
        return wrapped

    def _arm_idle(self) -> None:
        with self._lock:
            self._cancel_idle_locked()
            timer = threading.Timer(IDLE_RELEASE_SECONDS, self._release_if_idle)
            timer.daemon = True
            self._idle = timer
            timer.start()

    def _cancel_idle(self) -> None:
        with self._lock:
            self._cancel_idle_locked()

    def _cancel_idle_locked(self) -> None:
        timer = getattr(self, "_idle", None)
        if timer is not None:
            timer.cancel()
            self._idle = None

    def _release_if_idle(self) -> None:
        if self.pool.in_use() == 0:
            self.pool.release_buffers()

    def submit(self, plan: SavePlan, save: Any, *, options: dict[str, Any] | None = None, blocking: bool = False,
               after: Callable[[], Any] | None = None) -> AsyncSave:
        """Snapshot ``plan`` into the pool, then ``save.write(snapshot_plan, **options)`` and ``save.commit()`` on
        the writer thread.

        Args:
            plan: the save plan (live tensors).
            save: the :class:`~fastckpt._io.storage.base.StagedSave` to write and commit (``Storage.begin``'s, or
                :class:`WriteTo` over a write function); ``save.target`` names it (the handle's ``path``).
            options: passed to ``save.write`` (``durable``, ``threads``), with ``before_commit=`` the cancel check
                and ``ready=`` the snapshot's chunk gate when ``blocking`` and device copies exist.
            blocking: the caller will wait for the result at once (a synchronous save of CUDA tensors): the writer
                then starts before the device copies are done and waits per chunk (``ready``), overlapping them.
                Otherwise every device copy is waited for first (the writer never needs the GIL while the
                caller trains).
            after: run on the writer thread after a successful commit (rotation of old checkpoints).

        Returns:
            The handle; the slot is given back to the pool when the write ends, successfully or not.

        Raises:
            DestinationNotWritableError / NotADirectoryError / ValueError: what the synchronous save refuses before
                its first byte (``save.claim()``, :func:`claim_at_call`): raised here, nothing left behind.
            Exception: an unreported failure of an earlier save (checked once a pool slot is free, before this
                save copies anything; this save is then not made).
            ValueError / DtypeError: a tensor the format cannot hold (raised before anything is copied).
        """
        start = time.perf_counter()
        claim_at_call(save)
        try:
            snapshot = snapshot_plan(plan, self.pool, on_slot=self.raise_failed)
        except BaseException:
            save.abort()
            raise
        blocked = time.perf_counter() - start
        token = CancelToken(save.target)

        def run() -> Path | str:
            try:
                kwargs = dict(options or {}, before_commit=token.before_commit())
                if blocking and snapshot.copies:
                    kwargs["ready"] = snapshot.ready
                else:
                    snapshot.wait_copies()
                save.write(snapshot.plan, **kwargs)
                committed = save.commit()
                if after is not None:
                    after()
                return committed_path(save, committed)
            except BaseException:
                save.abort()  # releases the claim when the commit never ran (idempotent)
                raise
            finally:
                self.pool.release(snapshot.slot)

        self._cancel_idle()
        outcome = Outcome()
        try:
            self._executor.submit(self._then_idle(run, outcome))
        except BaseException:
            self.pool.release(snapshot.slot)
            save.abort()
            raise
        handle = AsyncSave(save.target, outcome, snapshot, blocked, token=token)
        with self._lock:
            self._pending.append(handle)
        return handle


class WriteTo:
    """A :class:`~fastckpt._io.storage.base.StagedSave` over a write function, for callers that commit their own
    way (``fastckpt.save``, the accelerate and manager saves): :meth:`commit` calls ``write(plan, target,
    **options)``. With ``claim`` (e.g. :func:`~fastckpt._io.storage.local.commit.claim_target`), :meth:`claim`
    claims the target at an async save's call and :meth:`commit` passes the claim on as ``write(...,
    claim=...)``; :meth:`abort` releases it (``.release()``)."""

    number = None

    def __init__(self, target: Path | str, write: Callable[..., Any],
                 claim: Callable[[Any], Any] | None = None) -> None:
        self.target, self.location, self._write = target, str(target), write
        self._plan: tuple[Any, dict[str, Any]] | None = None
        self._claim_with, self._claim = claim, None

    def claim(self) -> None:
        """Claim the target now (see the class docs); idempotent, a no-op without ``claim``."""
        if self._claim_with is not None and self._claim is None:
            self._claim = self._claim_with(self.target)

    def write(self, plan: Any, **options: Any) -> None:
        self._plan = (plan, options)

    def commit(self) -> Committed:
        assert self._plan is not None
        plan, options = self._plan
        claim, self._claim = self._claim, None
        result = self._write(plan, self.target, **options, **({} if claim is None else {"claim": claim}))
        return Committed(str(result if isinstance(result, (Path, str)) else self.target), None)

    def abort(self) -> None:
        self._plan = None
        if self._claim is not None:
            self._claim.release()
            self._claim = None


def claim_at_call(save: Any) -> None:
    """Claim an async save's destination at its call, as the synchronous save does before its first byte
    (``save.claim()``: a local folder's parent folders and staging folder, :func:`~fastckpt._io.storage.local.
    commit.claim_target`), so a destination that takes no files fails the call with the synchronous save's error
    and nothing is started; a staged save without ``claim`` (``s3://``: checked by the upload) claims nothing.
    ``save.abort()`` releases the claim."""
    claim = getattr(save, "claim", None)
    if claim is not None:
        claim()


def committed_path(save: Any, committed: Committed) -> Path | str:
    """What ``AsyncSave.wait()`` returns: the folder (a local save's ``target``) or the committed URL."""
    return save.target if isinstance(save.target, Path) else committed.location


_DEFAULT: AsyncSaver | None = None
#: Seconds without a save in flight after which the default saver frees its host buffers.
IDLE_RELEASE_SECONDS = 60.0
_DEFAULT_LOCK = threading.Lock()


def default_saver() -> AsyncSaver:
    """The process-wide saver (one pool slot: at most one save in flight), created on first use."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = AsyncSaver()
            watch(_DEFAULT.unreported)  # a failure nobody waited on is reported at exit
        return _DEFAULT


def finish_pending(*, wait: bool) -> None:
    """Call at the start of every save: re-raise an unreported failure of an earlier async save; with ``wait``
    (a synchronous or streaming save), first wait for every async save in flight so saves commit in call order.
    A streaming save in flight is always waited for (its optimizer steps may need the pool slot)."""
    if _DEFAULT is None:
        return
    with _DEFAULT._lock:
        streaming = any(h._stream is not None and not h.done() for h in _DEFAULT._pending)
    if wait or streaming:
        _DEFAULT.wait_all()
    else:
        _DEFAULT.raise_failed()


def release_buffers() -> int:
    """Free the host (pinned with CUDA) buffers async saves keep for reuse; returns the bytes freed.

    Buffers of a save in flight are kept. They are also freed by themselves after ``IDLE_RELEASE_SECONDS``
    (60 s) without a save in flight; the next save allocates them again.

    Example:
        >>> fastckpt.save_state(model, optimizer, output_dir="ckpt", async_save=True).wait()
        >>> fastckpt.release_buffers()
    """
    return 0 if _DEFAULT is None else _DEFAULT.release_buffers()


def wait_for_saves_to(folder: Path) -> None:
    """Wait for the async saves in flight whose checkpoint is ``folder`` or lies inside it (before a load reads
    it), re-raising a failure of theirs."""
    if _DEFAULT is None:
        return
    for handle in _DEFAULT.in_flight_to(folder):
        handle.wait()


def submit(plan: SavePlan, save: Any, *, options: dict[str, Any] | None = None, blocking: bool = False,
           auto_named: bool = False, after: Callable[[], Any] | None = None,
           write: Callable[..., Any] | None = None) -> AsyncSave:
    """:meth:`AsyncSaver.submit` on the default saver; ``auto_named`` skips numbers of saves in flight. ``write``:
    ``save`` is a target path and ``write(plan, target, **options)`` commits it (:class:`WriteTo`)."""
    saver = default_saver()
    if write is not None:
        save = WriteTo(save, write)
    if auto_named:
        saver.reserve(save)
    return saver.submit(plan, save, options=options, blocking=blocking, after=after)

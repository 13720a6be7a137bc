"""The ``async_save`` modes as writers: one is chosen once from ``async_save=`` (and what the storage serves), and
the save calls its one verb, :meth:`SaveWriter.write`, which writes the plan into the staged save and commits it,
now or on the background writer thread. Every mode commits exactly the state at the call or raises (and commits
nothing), within the limit stated for ``"stream"``.

- ``False`` (:class:`SyncWriter`): written and committed before the call returns; CUDA tensors are staged through
  the host buffer pool by the writer thread while the caller waits (:mod:`fastckpt._io.async_save.writer`).
- ``True`` (the default async mode, :class:`StreamWriter` with the call's proof): on the CPU, a streaming save
  (:mod:`fastckpt._io.async_save.stream`) whose call also pins every streamed tensor
  (:mod:`fastckpt._io.async_save.call_hashes`): write-protects its pages where the kernel allows
  (:mod:`fastckpt._io.async_save.write_guard`), else hashes it; any change after the call, tracked by torch or not
  (``p.data``, ``.numpy()`` views, other threads, syscalls), fails the save with
  :class:`~fastckpt.errors.ConcurrentModificationError`. With CUDA tensors, a snapshot: the device-to-host
  copies are only enqueued on a side stream, and the caller's stream waits for them on the device, so every
  later kernel on it (``p.data.mul_`` included) runs after the copies (the host is not blocked).
- ``"stream"`` (:class:`StreamWriter` without it): the streaming save without the hashes (the call copies nothing
  it need not copy). Its one limit: writes that bypass torch's version counters (``p.data``, ``.numpy()`` views,
  raw pointers), made after the call and before the tensor is written, are not detected and end up in the
  checkpoint.
- ``"snapshot"`` (:class:`SnapshotWriter`): the whole state is copied into the host buffer pool at the call
  (:mod:`fastckpt._io.async_save.writer`).

Over ``s3://`` (a storage whose ``snapshot_only`` says why) every async mode is a snapshot: the upload (minutes, on
a slow link) then reads only the copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from fastckpt._io.async_save.snapshot import has_device_tensors
from fastckpt._io.async_save.stream import submit_stream
from fastckpt._io.async_save.writer import WriteTo, committed_path, submit
from fastckpt._io.files import SavePlan
from fastckpt._io.sizes import parse_budget
from fastckpt.errors import OptionError

__all__ = ["MODES", "SaveWriter", "SnapshotWriter", "StreamWriter", "SyncWriter", "check_mode", "start_async",
           "writer_for"]

#: The values ``async_save`` takes.
MODES = (False, True, "stream", "snapshot")


def check_mode(async_save: Any) -> None:
    """Raise ValueError unless ``async_save`` is one of :data:`MODES`."""
    if not any(async_save is m or (isinstance(m, str) and async_save == m) for m in MODES):
        raise OptionError(f"async_save must be False, True, 'stream' or 'snapshot', got {async_save!r}")


class SaveWriter(Protocol):
    """How one save's files get written and committed (a mode of ``async_save``)."""

    #: the save first waits for the async saves in flight, so saves commit in call order (see
    #: :func:`~fastckpt._io.async_save.writer.finish_pending`)
    in_order: bool

    def write(self, plan: SavePlan, save: Any, *, options: dict[str, Any] | None = None,
              after: Callable[[], Any] | None = None) -> Any:
        """Write ``plan`` into ``save`` and commit it, then run ``after()`` (rotation).

        Args:
            plan: the save plan (live tensors).
            save: the staged save (``Storage.begin``'s, or :class:`~fastckpt._io.async_save.writer.WriteTo`);
                ``save.number`` set: an automatic ``checkpoint_N`` name, moved above the numbers of saves in flight.
            options: passed to ``save.write`` (``durable``, ``threads``).
            after: run after a successful commit (on the writer thread for async saves).

        Returns:
            The committed folder or URL, or the :class:`~fastckpt._io.async_save.writer.AsyncSave` handle of an
            async save.
        """
        ...


def _check_fits(plan: SavePlan, budget: int | None, message: Callable[[int, int], str]) -> None:
    """Refuse a ``host_memory_budget`` below the bytes a snapshot copies at the call."""
    need = sum(t.numel() * t.element_size() for part in plan.parts for t in part.tensors.values())
    if budget is not None and budget < need:
        raise ValueError(message(budget, need))


class SyncWriter:
    """``async_save=False``: write and commit before returning. Tensors on a device are staged through the host
    buffer pool by the writer thread while the caller waits; with ``overlap`` it writes chunk k while chunk k+1 is
    still being copied (else every copy is made first, as an upload from the copy needs)."""

    def __init__(self, *, overlap: bool = True) -> None:
        self.in_order = self._overlap = overlap

    def write(self, plan: SavePlan, save: Any, *, options: dict[str, Any] | None = None,
              after: Callable[[], Any] | None = None) -> Any:
        if has_device_tensors(plan):
            return submit(plan, save, options=options, blocking=self._overlap, auto_named=save.number is not None,
                          after=after).wait()
        save.write(plan, **dict(options or {}))
        result = committed_path(save, save.commit())
        if after is not None:
            after()
        return result


class SnapshotWriter:
    """``async_save="snapshot"`` (and every async mode where only a snapshot serves): copy the whole state into the
    host buffer pool at the call, write and commit it on the writer thread. ``budget`` and ``why`` (the reason every
    mode is a snapshot, e.g. ``"over s3://"``): a ``host_memory_budget`` below the state's bytes is refused."""

    in_order = False

    def __init__(self, budget: int | str | None = None, why: str | None = None) -> None:
        self._budget, self._why = budget, why

    def write(self, plan: SavePlan, save: Any, *, options: dict[str, Any] | None = None,
              after: Callable[[], Any] | None = None) -> Any:
        if self._why is not None:
            _check_fits(plan, parse_budget(self._budget), lambda limit, need: (
                f"host_memory_budget of {limit:,} bytes is below the {need:,} bytes an async save {self._why} copies "
                "at the call (every async mode is a snapshot there); raise the budget, or save with "
                "async_save=False"))
        return submit(plan, save, options=options, blocking=False, auto_named=save.number is not None, after=after)


class StreamWriter:
    """``async_save=True`` (``proof``) or ``"stream"``: write straight from the live tensors, guarding the steps of
    ``optimizers`` (:mod:`fastckpt._io.async_save.stream`); ``budget`` caps the host bytes it copies. With
    ``proof``, a plan with CUDA tensors is a snapshot instead (enqueued copies the caller's stream waits for)."""

    in_order = True

    def __init__(self, optimizers: Sequence[Any], budget: int | str | None, *, proof: bool) -> None:
        self._optimizers, self._budget, self._proof = list(optimizers), budget, proof

    def write(self, plan: SavePlan, save: Any, *, options: dict[str, Any] | None = None,
              after: Callable[[], Any] | None = None) -> Any:
        budget = parse_budget(self._budget)
        if self._proof and has_device_tensors(plan):
            _check_fits(plan, budget, lambda limit, need: (
                f"host_memory_budget of {limit:,} bytes is below the {need:,} bytes async_save=True copies from "
                "CUDA at the call; raise the budget, or pass async_save='stream' (writes that bypass torch's "
                "version counters are then not detected)"))
            return SnapshotWriter().write(plan, save, options=options, after=after)
        return submit_stream(plan, self._optimizers, save, options=options, budget=budget,
                             auto_named=save.number is not None, after=after, hash_at_call=self._proof)


def writer_for(async_save: bool | str, *, optimizers: Sequence[Any] = (), budget: int | str | None = None,
               snapshot_only: str | None = None) -> SaveWriter:
    """The writer of the ``async_save`` mode (one of :data:`MODES`, checked by :func:`check_mode`).

    Args:
        async_save: ``False``, ``True``, ``"stream"`` or ``"snapshot"``.
        optimizers: the optimizers whose steps a streaming save guards.
        budget: ``host_memory_budget`` (bytes, ``"4GB"``, None): streaming saves, and snapshots that must fit it.
        snapshot_only: the storage's reason why every async mode is a snapshot (``Storage.snapshot_only``), or
            None; a synchronous save then copies every device tensor before writing.
    """
    if not async_save:
        return SyncWriter(overlap=snapshot_only is None)
    if snapshot_only is not None:
        return SnapshotWriter(budget, snapshot_only)
    if async_save == "snapshot":
        return SnapshotWriter()
    return StreamWriter(optimizers, budget, proof=async_save is True)


def start_async(plan: SavePlan, optimizers: list[Any], target: Any, mode: bool | str, *,
                write: Callable[..., Any], budget: int | str | None = None,
                claim: Callable[[Any], Any] | None = None) -> Any:
    """The async save of ``plan`` in ``mode`` (``True``, ``"stream"`` or ``"snapshot"``) to ``target`` (an absolute
    folder) that ``write(plan, target, **options)`` commits, for callers that commit their own way (``fastckpt.save``,
    the accelerate saves); returns its :class:`~fastckpt._io.async_save.writer.AsyncSave`. ``claim(target)``: claims
    the target at the call (:class:`~fastckpt._io.async_save.writer.WriteTo`; ``write`` then gets ``claim=``).

    Raises:
        DestinationNotWritableError: what ``claim`` raises (a folder that takes no files), before anything is copied.
        ValueError: a budget ``True`` cannot keep on CUDA; what the chosen writer raises before copying.
    """
    return writer_for(mode, optimizers=optimizers, budget=budget).write(plan, WriteTo(target, write, claim))

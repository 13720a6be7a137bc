"""Streaming async saves: the call copies only what the next forward pass may change; only the step waits.

Parameters and optimizer state do not change until the next ``optimizer.step()`` (CheckFreq; torchtitan's
zero-overhead checkpointing), so a streaming save (``async_save=True`` on the CPU, ``async_save="stream"``; see
:mod:`fastckpt._io.async_save.modes`) does not copy them at the call:

- *At the call* it copies the tensors that may change before a step: module buffers (BatchNorm statistics are
  updated by the next forward pass), tensors under :data:`SMALL_BYTES`, parameters no passed optimizer owns, and
  everything that is not a parameter or state tensor of a passed optimizer (RNG states; the JSON state is text by
  then). It records the version counter (``tensor._version``) of every other tensor and registers a step pre-hook
  on every optimizer passed (``Optimizer.register_step_pre_hook``; removed when the save is done).
- *CPU*: the Rust writer streams straight from the live tensors (no copy of the state at all) and reports each
  tensor's progress (``fastckpt._core.WriteProgress``). At an optimizer's step the hook *claims* that optimizer's
  tensors: the writer starts no new read of them and the hook waits for the reads running; it copies the tensors
  not yet written into the host buffer pool (only those), hands the copies to the writer, which writes the rest
  from them, and the step goes on. With a ``host_memory_budget`` smaller than what is left to copy, the hook
  copies what fits (the tensors the writer reaches last) and waits for the writer to write the others.
- *CUDA*: the call-time tensors are cloned on the device (on the caller's stream: private copies the next forward
  cannot change); then every tensor is copied on the device's side stream, which first waits for the caller's
  stream, into the pinned pool. The caller's stream never waits for these copies: the hook makes the current
  stream wait for an event after the copies of its optimizer's tensors (no host synchronisation), and the writer
  writes chunk k while chunk k+1 is still being copied (see :mod:`fastckpt._io.async_save.snapshot`). A
  ``host_memory_budget`` below the streamed bytes is refused on CUDA (a ring of pinned buffers is not built).

Safety, never a torn checkpoint: when a tensor becomes safe (at its optimizer's step, after the copy; else once
every file is written, before the commit) its version counter is compared with the one recorded at the call. A
change means it was modified in place outside ``optimizer.step()`` (an EMA update, manual clipping,
``load_state_dict``): the save fails with :class:`~fastckpt.errors.ConcurrentModificationError` naming the tensor,
nothing is committed and the previous checkpoint stays. (The check is conservative: a tensor changed after it was
written but before its step also fails the save. An in-place op running on another thread at the very moment the
last chunk of its tensor is written may finish its version bump after the check; do not change saved tensors from
other threads while a save runs.) Writes no version counter sees (``p.data``, ``.numpy()`` views) are caught only
with ``hash_at_call`` (``async_save=True``): the write guards or content hashes taken at the call must prove the
bytes written are the call's (:mod:`fastckpt._io.async_save.call_hashes`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastckpt._io.async_save.call_hashes import CallProof, check_written
from fastckpt._io.async_save.cancel import CancelToken
from fastckpt._io.async_save.host_pool import HostBufferPool, Slot, aligned
from fastckpt._io.async_save.snapshot import _check
from fastckpt._io.files import SavePlan
from fastckpt.errors import ConcurrentModificationError

__all__ = ["SMALL_BYTES", "StreamingSave", "submit_stream"]

#: Tensors smaller than this (bytes) are copied at the call (Adam's ``step`` counters and the like).
SMALL_BYTES = 64 << 10
_STREAMED_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                    torch.int16, torch.int8, torch.uint8, torch.bool}


def _torch_optimizer(opt: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer whose ``step`` runs (seen through accelerate's AcceleratedOptimizer)."""
    inner = getattr(opt, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def _owned_storages(optimizers: list[Any]) -> dict[int, set[int]]:
    """``{storage address: {optimizer index}}`` for every parameter and state tensor of ``optimizers``."""
    owners: dict[int, set[int]] = {}
    for j, opt in enumerate(optimizers):
        tensors = [p for g in opt.param_groups for p in g["params"]]
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.numel():
                owners.setdefault(t.untyped_storage().data_ptr(), set()).add(j)
    return owners


@dataclass(eq=False)
class _Deferred:
    """A tensor written (or copied) after the call: ``id`` in the writer's numbering, its owners' indexes."""

    id: int
    name: str
    tensor: torch.Tensor
    version: int
    owners: set[int]
    nbytes: int
    convert_to: str | None = None
    safe: bool = False


class StreamingSave:
    """One streaming async save: classifies the plan's tensors, copies the call-time ones, guards the steps.

    Args:
        plan: the save plan over live tensors.
        optimizers: the optimizers passed to the save (their steps are guarded).
        target: the checkpoint folder (for messages).
        pool: the host buffer pool copies go to (pinned with CUDA).
        budget: host bytes the save may hold in the pool; None: as needed (at most the state's size).
        hash_at_call: hash every streamed tensor at the call and commit only bytes that hash the same
            (``async_save=True``, :mod:`fastckpt._io.async_save.call_hashes`); False: ``async_save="stream"``.

    Raises:
        ValueError / DtypeError: a tensor the format cannot hold (before anything is copied).
        ValueError: CUDA tensors with a budget below their size (not supported: use a larger budget or
            ``async_save="snapshot"``).
    """

    def __init__(self, plan: SavePlan, optimizers: list[Any], target: Path, pool: HostBufferPool,
                 budget: int | None, *, hash_at_call: bool = False) -> None:
        self.target = target
        self._pool = pool
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._slot: Slot | None = None
        self._used = 0
        self._hooks: list[Any] = []
        self._events: dict[int, list[tuple[Any, Any]]] = {}  # optimizer -> [(device, event)] (CUDA)
        torch_opts = [_torch_optimizer(o) for o in optimizers]
        owners = _owned_storages([o for o in torch_opts if o is not None])
        parts, sizes, self.deferred = [], [], []
        self._device_copies: list[_Deferred] = []  # call-time copies of CUDA tensors, on the device
        self.call_bytes = 0
        with torch.no_grad():
            for part in plan.parts:
                tensors = {}
                for name, t in part.tensors.items():
                    _check(name, t)  # raises now for what the writer could not write
                    nbytes = t.numel() * t.element_size()
                    mine = owners.get(t.untyped_storage().data_ptr()) if t.numel() else None
                    if mine and nbytes >= SMALL_BYTES and t.dtype in _STREAMED_DTYPES and not t.is_inference():
                        self.deferred.append(_Deferred(len(sizes), f"{part.name}:{name}", t, t._version, mine,
                                                       nbytes, part.dtype))
                        tensors[name] = t
                    elif t.numel() and t.device.type == "cuda":  # a device clone, copied to the host below
                        copy = t.detach().clone()
                        self._device_copies.append(_Deferred(len(sizes), f"{part.name}:{name}", copy,
                                                             copy._version, set(), nbytes))
                        tensors[name] = copy
                        self.call_bytes += nbytes
                    else:
                        tensors[name] = t.detach().to("cpu", copy=True) if t.numel() else t
                        self.call_bytes += nbytes
                    sizes.append(nbytes)
                parts.append(dataclasses.replace(part, tensors=tensors))
        self.plan = dataclasses.replace(plan, parts=parts)
        self.proof = CallProof(self.deferred, target) if hash_at_call else None
        self.streamed_bytes = sum(d.nbytes for d in self.deferred)
        self.budget = self.streamed_bytes if budget is None else min(budget, self.streamed_bytes)
        self.on_cuda = bool(self._device_copies) or any(d.tensor.device.type == "cuda" for d in self.deferred)
        self.progress: Any = None
        self.snapshot: Any = None
        self._ptr = 0
        if self.on_cuda:
            from fastckpt._io.async_save.cuda import start_copies

            if self.budget < self.streamed_bytes:
                raise ValueError(
                    f"host_memory_budget of {self.budget:,} bytes is below the {self.streamed_bytes:,} bytes of "
                    "parameters and optimizer state to copy; streaming CUDA saves through a smaller ring is not "
                    "supported: raise the budget or pass async_save='snapshot'"
                )
            self.plan, self.snapshot, self._events = start_copies(self.plan, self._device_copies + self.deferred,
                                                                  self._pool)
            self._ptr = self.snapshot.slot.data_ptr
        else:
            from fastckpt import _core

            self.progress = _core.WriteProgress(sizes)
        for j, opt in enumerate(torch_opts):
            if opt is not None and any(j in d.owners for d in self.deferred):
                self._hooks.append(opt.register_step_pre_hook(self._hook_for(j)))

    # -- the step pre-hooks ------------------------------------------------------------------------------------

    def _hook_for(self, j: int) -> Callable[..., None]:
        def hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            self.make_safe(j)
        return hook

    def make_safe(self, j: int) -> None:
        """Make every tensor of optimizer ``j`` safe before its step changes it (never raises: a failure is kept
        and raised by the save's ``wait()``)."""
        with self._lock:
            mine = [d for d in self.deferred if j in d.owners and not d.safe]
            if not mine or self._error is not None:
                return
            try:
                if self.on_cuda:
                    for device, event in self._events.get(j, []):
                        torch.cuda.current_stream(device).wait_event(event)
                else:
                    self._take_over(mine)
                if self.proof is not None:
                    self.proof.settle(mine)
                self._check(mine)
            except BaseException as exc:  # kept for wait(); training goes on
                self._fail(exc)

    def _take_over(self, mine: list[_Deferred]) -> None:
        """CPU: claim what the writer has not written, copy what fits the budget, wait for the rest."""
        claim = [d for d in mine if not self.progress.is_written(d.id)]
        if not claim:
            return
        room = self.budget - self._used
        chosen, rest = [], []
        for d in reversed(claim):  # the writer reaches the last tensors last: copy those, let it write the first
            if aligned(d.nbytes) <= room:
                chosen.append(d)
                room -= aligned(d.nbytes)
            else:
                rest.append(d)
        by_id = {d.id: d for d in chosen}
        if chosen and self._slot is None:  # allocated once per pool, reused by later saves
            self._slot = self._pool.acquire(self.budget)
            self._ptr = self._slot.data_ptr
        with torch.no_grad():
            for i in self.progress.claim([d.id for d in chosen]):
                d = by_id[i]
                assert self._slot is not None and self._slot.buffer is not None
                view = self._slot.buffer[self._used : self._used + d.nbytes]
                view.view(d.tensor.dtype).view(d.tensor.shape).copy_(d.tensor)
                if self.proof is not None:  # a guarded tensor's copy takes the call's end bytes
                    self.proof.patch_copy(d, view.numpy())
                self._used += aligned(d.nbytes)
                self.progress.provide(i, view.numpy())
        if rest:
            self.progress.wait_written([d.id for d in rest])

    def _check(self, tensors: list[_Deferred]) -> None:
        for d in tensors:
            now = d.tensor._version
            if now != d.version:
                raise ConcurrentModificationError(
                    f"async save to {self.target}: tensor {d.name!r} was changed in place after save_state returned "
                    f"and before it was written or copied (its version counter went from {d.version} to {now}): "
                    "an in-place change outside optimizer.step() (an EMA update, manual clipping, load_state_dict) "
                    "cannot be saved consistently while the save runs. Call handle.wait() before changing it, or "
                    "pass async_save='snapshot' to copy the whole state at the call. Nothing was committed; the "
                    f"previous checkpoint at {self.target} (if any) is intact."
                )
            d.safe = True

    def _check_written(self, tensors: list[_Deferred], checksums: dict[str, Any]) -> None:
        from fastckpt import _core
        from fastckpt._io.storage.local.integrity import crc_hex

        for d in tensors:
            file, _, name = d.name.partition(":")
            recorded = checksums.get(file, {}).get("tensors", {}).get(name)
            if recorded is None:
                continue
            live = d.tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            now = crc_hex(_core.crc32c(live))
            if now != recorded:
                raise ConcurrentModificationError(
                    f"async save to {self.target}: tensor {d.name!r} was being changed in place while it was written "
                    f"(crc32c of the bytes written {recorded}, of the tensor now {now}): an in-place change outside "
                    "optimizer.step() cannot be saved consistently while the save runs. Call handle.wait() before "
                    "changing it, or pass async_save='snapshot'. Nothing was committed; the previous checkpoint at "
                    f"{self.target} (if any) is intact."
                )

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        if self.progress is not None:
            self.progress.abort(str(exc))

    # -- the writer thread -------------------------------------------------------------------------------------

    def before_commit(self, checksums: dict[str, Any] | None = None) -> None:
        """Writer thread, once every file is written: check the tensors no step made safe; raise the first
        failure (then nothing is committed).

        A tensor's version counter moves only once an in-place op has finished, and torch runs ops without the GIL,
        so an op still running while the writer read the tensor is not seen by the counter alone. So each such
        tensor, read from live memory, is also summed again here (crc32c) and compared with the crc32c of the
        bytes written (``checksums``: the manifest's fields per file); steps wait meanwhile (the lock).
        """
        with self._lock:
            if self._error is None:
                try:
                    unsafe = [d for d in self.deferred if not d.safe]
                    if self.proof is not None:
                        self.proof.settle(unsafe)
                    self._check(unsafe)
                    if checksums is not None and self.proof is not None:
                        check_written(self.target, self.proof.hashes, checksums)
                    if checksums is not None:  # a guarded tensor has no gap between hashing and writing
                        guarded = {} if self.proof is None else self.proof.guarded
                        self._check_written([d for d in unsafe if d.id not in guarded], checksums)
                except ConcurrentModificationError as exc:
                    self._error = exc
            for d in self.deferred:
                d.safe = True  # later steps go on at once
            if self._error is not None:
                raise self._error

    def raise_failure(self, exc: BaseException) -> None:
        """Writer thread: the write raised ``exc``; raise the save's own failure instead when it caused it.

        The progress is aborted first, so a step waiting for tensors the writer will now never write goes on.
        """
        if self.progress is not None:
            self.progress.abort(f"the write failed: {exc}")
        if self._error is not None and exc is not self._error:
            raise self._error from exc
        raise exc

    def close(self) -> None:
        """Remove the hooks and give the pool slot back (the write has ended, successfully or not)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.proof is not None:
            self.proof.close()
        if self.snapshot is not None:
            self._pool.release(self.snapshot.slot)
        if self._slot is not None:
            self._pool.release(self._slot)
            self._slot = None

    @property
    def buffer_ptr(self) -> int:
        """Address of the pool buffer the save copied into (0 when nothing needed a copy)."""
        return self._ptr

    def write_kwargs(self) -> dict[str, Any]:
        """What the writer needs: the progress (CPU) or the chunk gate of the device copies (CUDA)."""
        if self.on_cuda:
            return {"ready": self.snapshot.ready}
        return {"progress": self.progress}


def submit_stream(plan: SavePlan, optimizers: list[Any], save: Any, *, options: dict[str, Any] | None = None,
                  budget: int | None = None, auto_named: bool = False,
                  after: Callable[[], Any] | None = None, hash_at_call: bool = False) -> Any:
    """Start a streaming async save of ``plan`` on the default saver's writer thread; returns its ``AsyncSave``.

    Args:
        plan: the save plan (live tensors).
        optimizers: the optimizers whose steps are guarded (see the module docs).
        save: the staged save to write and commit (as :meth:`fastckpt._io.async_save.writer.AsyncSaver.submit`):
            ``save.write(plan, **options, before_commit=..., progress=... | ready=...)``, then ``save.commit()``.
        options: passed to ``save.write`` (``durable``, ``threads``).
        budget: ``host_memory_budget`` in bytes (parsed by the writer,
            :class:`~fastckpt._io.async_save.modes.StreamWriter`), or None for as needed.
        auto_named: skip the numbers of saves in flight (``checkpoint_N``).
        after: run on the writer thread after a successful commit (rotation).
        hash_at_call: hash the streamed tensors at the call and refuse to commit other bytes
            (:mod:`fastckpt._io.async_save.call_hashes`).

    Raises:
        DestinationNotWritableError / NotADirectoryError / ValueError: what the synchronous save refuses before its
            first byte (``save.claim()``): raised at the call, nothing left behind.
        ValueError / DtypeError: a tensor the format cannot hold (before anything is copied).
    """
    import time

    from fastckpt._io.async_save.writer import claim_at_call, committed_path, default_saver

    saver = default_saver()
    if auto_named:
        saver.reserve(save)
    start = time.perf_counter()
    claim_at_call(save)
    try:
        stream = StreamingSave(plan, optimizers, save.target, saver.pool, budget, hash_at_call=hash_at_call)
    except BaseException:
        save.abort()
        raise
    blocked = time.perf_counter() - start

    token = CancelToken(save.target)

    def run() -> Path | str:
        try:
            try:
                save.write(stream.plan, **dict(options or {}), before_commit=token.before_commit(stream.before_commit),
                           **stream.write_kwargs())
                committed = save.commit()
            except BaseException as exc:
                save.abort()  # releases the claim when the commit never ran (idempotent)
                stream.raise_failure(exc)
            if after is not None:
                after()
            return committed_path(save, committed)
        finally:
            stream.close()

    try:
        return saver.start(save.target, run, blocking_seconds=blocked, stream=stream, token=token)
    except BaseException:
        stream.close()
        save.abort()
        raise

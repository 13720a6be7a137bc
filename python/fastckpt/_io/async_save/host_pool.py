"""Reused host memory for snapshots: the buffer pool behind async saves and CUDA staging.

A :class:`HostBufferPool` owns ``slots`` flat uint8 buffers. A save takes a free slot (waiting while every slot
is in use: that wait is what bounds the number of saves in flight), copies the state into it, and gives it back
when its files are written. A slot's buffer is allocated once, the first time a state needs it, and grows only
when a later state is larger; it is never re-allocated, re-pinned or re-faulted per save:

- with CUDA available it is *pinned* (page-locked, ``pin_memory=True``), so device-to-host copies run at full
  speed and asynchronously on a side stream;
- otherwise it is ordinary memory, pre-faulted on allocation (one byte written per 4 KiB page), so the first
  snapshot does not pay the kernel's first-touch cost inside the caller's blocking time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "HostBufferPool", "Slot", "aligned"]

#: Byte alignment of every tensor placed in a slot (a cache line; also satisfies every dtype's alignment).
ALIGN = 64
_PAGE = 4096


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class Slot:
    """One reusable buffer of a pool.

    Attributes:
        index: the slot's number in its pool.
        buffer: a 1-D uint8 CPU tensor (pinned when the pool pins); ``None`` until first used.
        allocations: how many times this slot's buffer was allocated (1 after first use; +1 per growth).
    """

    index: int
    buffer: torch.Tensor | None = None
    allocations: int = 0

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds (0 before first use)."""
        return 0 if self.buffer is None else self.buffer.numel()

    @property
    def data_ptr(self) -> int:
        """Address of the buffer's first byte (0 before first use): the same across saves while it is reused."""
        return 0 if self.buffer is None else self.buffer.data_ptr()


def _capacity(slot: Slot) -> int:
    return slot.capacity


class HostBufferPool:
    """``slots`` host buffers handed out one save at a time.

    Args:
        slots: how many snapshots may exist at once (saves in flight), >= 1.
        pin_memory: pin the buffers (page-locked); None: pin when ``torch.cuda.is_available()``.

    Raises:
        ValueError: ``slots`` < 1.
    """

    def __init__(self, slots: int = 1, *, pin_memory: bool | None = None) -> None:
        if slots < 1:
            raise ValueError(f"a host buffer pool needs at least 1 slot, got {slots}")
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._slots = [Slot(i) for i in range(slots)]
        self._free = list(self._slots)
        self._cond = threading.Condition()

    @property
    def slots(self) -> list[Slot]:
        """Every slot, free or in use."""
        return list(self._slots)

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds now, all slots together."""
        return sum(s.capacity for s in self._slots)

    def in_use(self) -> int:
        """Slots handed out and not yet released."""
        with self._cond:
            return len(self._slots) - len(self._free)

    def acquire(self, nbytes: int, timeout: float | None = None) -> Slot:
        """Take a free slot whose buffer holds at least ``nbytes`` bytes, waiting while every slot is in use.

        The buffer is allocated (pinned or pre-faulted) only when the slot has none yet or a smaller one.

        Args:
            nbytes: bytes the snapshot needs (>= 0).
            timeout: seconds to wait for a free slot; None waits as long as it takes.

        Returns:
            The slot; give it back with :meth:`release`.

        Raises:
            TimeoutError: no slot became free within ``timeout`` seconds.
            RuntimeError / MemoryError: the allocation failed (names the bytes asked for).
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise TimeoutError(f"no free host buffer slot within {timeout} s ({len(self._slots)} in use)")
            # The smallest slot that is large enough; else the largest, grown (so growth happens rarely).
            fits = [s for s in self._free if s.capacity >= nbytes]
            slot = min(fits, key=_capacity) if fits else max(self._free, key=_capacity)
            self._free.remove(slot)
        try:
            if slot.capacity < nbytes:
                self._grow(slot, nbytes)
        except BaseException:
            self.release(slot)
            raise
        return slot

    def release(self, slot: Slot) -> None:
        """Give ``slot`` back (its buffer is kept for the next save)."""
        with self._cond:
            if slot not in self._free:
                self._free.append(slot)
            self._cond.notify()

    def release_buffers(self) -> int:
        """Free the buffers of the free slots (the next :meth:`acquire` allocates again); returns the bytes freed."""
        freed = 0
        with self._cond:
            for slot in self._free:
                freed += slot.capacity
                slot.buffer = None
        return freed

    def _grow(self, slot: Slot, nbytes: int) -> None:
        slot.buffer = None  # free the old buffer before allocating the larger one
        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        except RuntimeError as exc:
            kind = "pinned" if self.pin_memory else "host"
            raise RuntimeError(f"cannot allocate {nbytes:,} bytes of {kind} memory for a snapshot buffer: {exc}") \
                from exc
        if not self.pin_memory and nbytes:
            buffer[::_PAGE].fill_(0)  # first touch now, not inside a save's blocking time
        slot.buffer = buffer
        slot.allocations += 1

"""Write guards: learn whether a tensor's memory was written after the call, for the price of a page-table update.

``async_save=True`` must commit the state as of the call, yet a streaming save reads the parameters and optimizer
state from the live tensors after ``save_state`` has returned, and writes through ``p.data``, ``.numpy()`` views,
other threads or syscalls bypass torch's version counters. Hashing every byte at the call proves the content but
costs a pass over the state (:mod:`fastckpt._io.async_save.call_hashes`); a write guard costs only the kernel's
page-table walk:

- At the call, :meth:`WriteGuard.guard` registers the whole pages inside a tensor's bytes with a userfaultfd in
  *asynchronous* write-protect mode (``UFFD_FEATURE_WP_ASYNC``, Linux 6.7+, with ``UFFD_FEATURE_WP_UNPOPULATED``
  so pages never touched are protected too) and write-protects them. A later write to such a page, from user code
  or from the kernel (``read()`` into it, a copy from another process), is resolved by the kernel inline: it
  clears the page's protection and goes on. No handler thread runs, so no write can ever wait on fastckpt.
  The bytes outside those pages (less than a page at each end) are copied at the call (:attr:`Guarded.head`,
  :attr:`Guarded.tail`).
- Later, :meth:`WriteGuard.release` asks the kernel (``PAGEMAP_SCAN`` on ``/proc/self/pagemap``,
  ``PAGE_IS_WRITTEN``) whether any of those pages lost its protection, i.e. was written, then unregisters them.
  No written page means the memory between the ends held the call's bytes all along, so the content hash of
  ``head + live memory + tail`` (``_core.hash_pieces``), taken before the release, is the hash of the tensor as of
  the call: the writer's hash of the bytes it wrote must equal it.

The call's cost is then a few system calls per guarded tensor, about 0.1 ms each, which for the hundreds of
tensors of a model and its optimizer state came to most of the call. :meth:`WriteGuard.guard_many` therefore
registers and write-protects tensors whose pages lie at most :data:`MERGE_GAP` apart with one call each per such
*region* (a model's and an optimizer's tensors sit in a few runs of adjacent allocations: GPT-2 small's 444 state
tensors in 4 regions); the pages between them are protected too, which means nothing: a write there is resolved
by the kernel like any other, and only each tensor's own pages are asked about. A released tensor's pages are
unprotected (so later writes to them cost nothing) and a region is unregistered once all its tensors are released.
A region the kernel refuses (a gap that is not mapped, memory of another kind, another save's guard) is guarded
tensor by tensor instead.

The kernel's walk costs per page table entry: about a tenth of a copy of the bytes with 4 KiB pages, next to nothing
with 2 MiB ones. So once a save has released its guards, :func:`collapse_later` asks the kernel, on a background
thread, to back the whole 2 MiB blocks of each guarded tensor with huge pages (``MADV_COLLAPSE``, Linux 6.1+:
the same bytes, moved by the kernel while the process runs on); later saves of the same tensors then guard them
for almost nothing. A block is asked for once per process; a refusal (no huge page free, THP disabled) is
ignored, and that block simply stays at 4 KiB pages.

Where the kernel or the sandbox refuses (no userfaultfd, an unprivileged process under
``vm.unprivileged_userfaultfd=0``, seccomp, an older kernel, memory a userfaultfd cannot register, a tensor sharing
pages with one already guarded, another save's guard), :meth:`WriteGuard.open` returns None or
:meth:`WriteGuard.guard` returns None, and that tensor is hashed at the call instead.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import platform
import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ENABLED", "Guarded", "WriteGuard", "collapse_later"]

#: Set to False to hash every streamed tensor at the call instead (tests of that path; kernels that misbehave).
ENABLED = True
#: :meth:`WriteGuard.guard_many` guards tensors whose whole pages lie at most this many bytes apart with one
#: registration and one write-protect call (0: one of each per tensor).
MERGE_GAP = 2 << 20

_PAGE = os.sysconf("SC_PAGE_SIZE")
_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(platform.machine())
_UFFD_API = 0xAA
_FEATURES = (1 << 13) | (1 << 15)  # UFFD_FEATURE_WP_UNPOPULATED | UFFD_FEATURE_WP_ASYNC
_REGISTER_MODE_WP = 1 << 1  # UFFDIO_REGISTER_MODE_WP
_WRITEPROTECT_MODE_WP = 1 << 0  # UFFDIO_WRITEPROTECT_MODE_WP
_PAGE_IS_WRITTEN = 1 << 1


def _ioc(direction: int, kind: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | nr


_UFFDIO_API = _ioc(3, 0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _ioc(3, 0xAA, 0x00, 32)
_UFFDIO_UNREGISTER = _ioc(2, 0xAA, 0x01, 16)
_UFFDIO_WRITEPROTECT = _ioc(3, 0xAA, 0x06, 24)
_PAGEMAP_SCAN = _ioc(3, ord("f"), 16, 96)
_HUGE = 2 << 20
_MADV_COLLAPSE = 25

_libc: Any = None
_refused: str | None = None  # why userfaultfd is unusable in this process, once known


def _lib() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        _libc.ioctl.restype = ctypes.c_int
    return _libc


def _ioctl(fd: int, request: int, arg: ctypes.Array) -> int:
    result = _lib().ioctl(fd, request, ctypes.addressof(arg))
    if result < 0:
        raise OSError(ctypes.get_errno(), f"ioctl {request:#x}")
    return result


def _u64(*values: int) -> ctypes.Array:
    return (ctypes.c_uint64 * len(values))(*values)


@dataclass(eq=False)
class Guarded:
    """One guarded tensor: its whole pages ``[start, start + length)`` and its bytes outside them, as at the call.

    Attributes:
        start: address of the first guarded page.
        length: bytes guarded (a multiple of the page size, > 0).
        head: the tensor's bytes before ``start`` (a uint8 numpy copy, less than a page).
        tail: the tensor's bytes after ``start + length`` (a uint8 numpy copy, less than a page).
        released: the pages are no longer guarded.
    """

    start: int
    length: int
    head: Any
    tail: Any
    released: bool = False
    region: _Region | None = None

    def pieces(self, tensor: torch.Tensor) -> list[Any]:
        """``[head, the live guarded bytes, tail]``: the tensor's bytes as of the call while nothing was written
        (hash them with ``_core.hash_pieces`` before :meth:`WriteGuard.release`)."""
        live = tensor.detach().reshape(-1).view(torch.uint8).numpy()
        return [self.head, live[len(self.head) : len(self.head) + self.length], self.tail]

    def patch(self, copy: Any) -> None:
        """Put the call's end bytes into ``copy`` (a uint8 numpy copy of the tensor made while still guarded)."""
        copy[: len(self.head)] = self.head
        copy[len(copy) - len(self.tail) :] = self.tail


@dataclass(eq=False)
class _Region:
    """Address range ``[start, start + length)`` registered and write-protected for several guarded tensors at
    once; ``left`` of them are not yet released."""

    start: int
    length: int
    left: int


class WriteGuard:
    """A userfaultfd in asynchronous write-protect mode over the tensors of one save; see the module docs.

    Use :meth:`open`; :meth:`close` it when the save ends (it releases every tensor still guarded).
    """

    def __init__(self, fd: int, pagemap: int) -> None:
        self._fd = fd
        self._pagemap = pagemap
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._guarded: list[Guarded] = []

    @classmethod
    def open(cls) -> WriteGuard | None:
        """A new guard, or None where the kernel or the sandbox refuses (remembered for the process)."""
        global _refused
        if not ENABLED or _refused is not None:
            return None
        if _SYS_USERFAULTFD is None:
            _refused = f"no userfaultfd syscall number known for {platform.machine()}"
            return None
        fd = _lib().syscall(_SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            _refused = f"userfaultfd: {os.strerror(ctypes.get_errno())}"
            return None
        try:
            _ioctl(fd, _UFFDIO_API, _u64(_UFFD_API, _FEATURES, 0))
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            os.close(fd)
            _refused = f"userfaultfd asynchronous write-protect or PAGEMAP_SCAN unavailable: {exc}"
            return None
        return cls(fd, pagemap)

    def guard(self, tensor: torch.Tensor) -> Guarded | None:
        """Write-protect the whole pages of a contiguous CPU ``tensor``; None when it cannot be guarded (it has no
        whole page, shares one with a tensor already guarded, or the kernel refuses its memory)."""
        return self.guard_many([tensor])[0]

    def guard_many(self, tensors: list[torch.Tensor]) -> list[Guarded | None]:
        """:meth:`guard` each of ``tensors``, with one registration and one write-protect call per run of
        tensors whose pages lie at most :data:`MERGE_GAP` apart (see the module docs); a tensor sharing a page
        with another one (the one at the lower address is guarded) or with a tensor already guarded is not."""
        out: list[Guarded | None] = [None] * len(tensors)
        spans = sorted(s for k, t in enumerate(tensors) if (s := self._span(t, k)) is not None)
        kept: list[tuple[int, int, int]] = []
        for start, end, k in spans:
            if (kept and kept[-1][1] > start) or not self._free(start, end):
                continue
            kept.append((start, end, k))
        runs: list[list[tuple[int, int, int]]] = []
        for span in kept:
            if runs and MERGE_GAP > 0 and span[0] - runs[-1][-1][1] <= MERGE_GAP:
                runs[-1].append(span)
            else:
                runs.append([span])
        for run in runs:
            start, end = run[0][0], run[-1][1]
            if len(run) > 1 and self._protect(start, end):
                region = _Region(start, end - start, len(run))
                for s, e, k in run:
                    out[k] = self._record(tensors[k], s, e, region)
                continue
            for s, e, k in run:
                if self._protect(s, e):
                    out[k] = self._record(tensors[k], s, e, None)
        return out

    def _span(self, tensor: torch.Tensor, k: int) -> tuple[int, int, int] | None:
        """``(start, end, k)``: the whole pages of a guardable tensor, or None."""
        if self._fd < 0 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        start = -(-address // _PAGE) * _PAGE
        end = (address + nbytes) // _PAGE * _PAGE
        return (start, end, k) if end > start else None

    def _free(self, start: int, end: int) -> bool:
        """No tensor guarded so far has a page in ``[start, end)``."""
        i = bisect.bisect_left(self._starts, start)
        return not ((i < len(self._starts) and self._starts[i] < end) or (i > 0 and self._ends[i - 1] > start))

    def _protect(self, start: int, end: int) -> bool:
        """Register ``[start, end)`` and write-protect it; False (and nothing left registered) if refused."""
        try:
            _ioctl(self._fd, _UFFDIO_REGISTER, _u64(start, end - start, _REGISTER_MODE_WP, 0))
        except OSError:
            return False
        try:
            _ioctl(self._fd, _UFFDIO_WRITEPROTECT, _u64(start, end - start, _WRITEPROTECT_MODE_WP))
        except OSError:
            self._unregister(start, end - start)
            return False
        return True

    def _record(self, tensor: torch.Tensor, start: int, end: int, region: _Region | None) -> Guarded:
        address = tensor.data_ptr()
        data = tensor.detach().reshape(-1).view(torch.uint8).numpy()
        g = Guarded(start, end - start, data[: start - address].copy(), data[end - address :].copy(), region=region)
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._ends.insert(i, end)
        self._guarded.append(g)
        return g

    def written(self, g: Guarded) -> int | None:
        """The offset in the guarded range of the first page written since :meth:`guard`, or None."""
        found = _u64(0, 0, 0)
        arg = _u64(96, 0, g.start, g.start + g.length, 0, ctypes.addressof(found), 1, 0, 0, _PAGE_IS_WRITTEN, 0,
                   _PAGE_IS_WRITTEN)
        return found[0] - g.start if _ioctl(self._pagemap, _PAGEMAP_SCAN, arg) > 0 else None

    def release(self, g: Guarded) -> int | None:
        """Stop guarding ``g``; returns :meth:`written` as it was just before (None: nothing was written)."""
        if g.released:
            return None
        first = self.written(g)
        g.released = True
        if g.region is None:
            self._unregister(g.start, g.length)
            return first
        try:  # its pages stop being protected now; the region's registration goes with its last tensor
            _ioctl(self._fd, _UFFDIO_WRITEPROTECT, _u64(g.start, g.length, 0))
        except OSError:
            pass  # unmapped meanwhile
        g.region.left -= 1
        if g.region.left == 0:
            self._unregister(g.region.start, g.region.length)
        return first

    def close(self) -> None:
        """Release every tensor still guarded and close the userfaultfd, then :func:`collapse_later` the guarded
        memory; idempotent."""
        if self._fd < 0:
            return
        for g in self._guarded:
            if not g.released:
                g.released = True
                if g.region is None:
                    self._unregister(g.start, g.length)
                elif g.region.left > 0:
                    g.region.left = 0
                    self._unregister(g.region.start, g.region.length)
        os.close(self._fd)
        os.close(self._pagemap)
        self._fd = -1
        collapse_later([(g.start, g.length) for g in self._guarded])

    def _unregister(self, start: int, length: int) -> None:
        try:  # also drops the protection of the pages not written
            _ioctl(self._fd, _UFFDIO_UNREGISTER, _u64(start, length))
        except OSError:
            pass  # the memory was unmapped meanwhile: nothing is left to release

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


_collapse_lock = threading.Lock()
_collapsed: set[int] = set()  # 2 MiB blocks asked for (collapsed or refused), process-wide
_pending: list[tuple[int, int]] = []
_collapser: threading.Thread | None = None


def collapse_later(ranges: list[tuple[int, int]]) -> None:
    """Ask the kernel, on a background thread, to back the whole 2 MiB blocks inside each ``(address, length)``
    with huge pages (see the module docs); blocks asked for before are skipped. Never raises."""
    global _collapser
    blocks = [b for a, n in ranges for b in range(-(-a // _HUGE) * _HUGE, (a + n) // _HUGE * _HUGE, _HUGE)]
    with _collapse_lock:
        fresh = [b for b in blocks if b not in _collapsed]
        if not fresh:
            return
        _collapsed.update(fresh)
        _pending.extend((b, _HUGE) for b in fresh)
        if _collapser is None:
            _collapser = threading.Thread(target=_collapse, name="fastckpt-collapse", daemon=True)
            _collapser.start()


def _collapse() -> None:
    global _collapser
    madvise = _lib().madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    while True:
        with _collapse_lock:
            if not _pending:
                _collapser = None
                return
            address, length = _pending.pop(0)
        madvise(address, length, _MADV_COLLAPSE)  # ctypes releases the GIL; a refusal leaves 4 KiB pages

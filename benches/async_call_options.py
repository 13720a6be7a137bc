"""What each way of proving "the bytes written are the bytes at the call" costs *at the call* (issue 26 item 3),
against a memcpy of the same state, alternated, medians of per-round ratios. A measurement of options, not of
fastckpt's API (``benches/async_call_cost.py`` measures that):

- ``hash at call``: xxh3-128 of every streamed tensor (``_core.hash_tensors``): what ``async_save=True`` does now;
- ``uffd write-protect``: ``userfaultfd`` with ``UFFDIO_REGISTER_MODE_WP`` over each tensor's whole pages, then
  ``UFFDIO_WRITEPROTECT``: any later write (``.data``, numpy, another thread, a syscall writing into it) faults to
  a handler first, which can record the tensor as changed or copy the page before letting the write go; the
  call pays the page-table updates, not a pass over the bytes (the two partial edge pages of each tensor are
  copied instead, a few KiB);
- ``fork``: a copy-on-write snapshot of the whole process (the call pays the page-table copy; every page the
  training writes afterwards, while the child writes the checkpoint, pays a copy-on-write fault);
- ``soft-dirty`` (``/proc/self/clear_refs`` 4 + ``/proc/self/pagemap`` bit 55): reported as unavailable where the
  kernel lacks ``CONFIG_MEM_SOFT_DIRTY`` (as on the development VM).

Usage::

    python benches/async_call_options.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_SYS_USERFAULTFD = 323  # x86_64
_UFFD_API = 0xAA


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (0xAA << 8) | nr


def _ior(nr: int, size: int) -> int:
    return (2 << 30) | (size << 16) | (0xAA << 8) | nr


UFFDIO_API, UFFDIO_REGISTER, UFFDIO_UNREGISTER, UFFDIO_WRITEPROTECT = (
    _iowr(0x3F, 24), _iowr(0x00, 32), _ior(0x01, 16), _iowr(0x06, 24))
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]


def _ioctl(fd: int, request: int, arg: ctypes.Array) -> None:
    if _libc.ioctl(fd, request, ctypes.addressof(arg)) != 0:
        raise OSError(ctypes.get_errno(), f"ioctl {request:#x}")


def _interior(t: torch.Tensor) -> tuple[int, int]:
    a, n = t.data_ptr(), t.numel() * t.element_size()
    start = (a + PAGE - 1) // PAGE * PAGE
    end = (a + n) // PAGE * PAGE
    return start, max(0, end - start)


class Uffd:
    """A userfaultfd over the tensors' whole pages (no fault handler: nothing may write them while protected)."""

    def __init__(self) -> None:
        self.fd = _libc.syscall(_SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "userfaultfd")
        api = (ctypes.c_uint64 * 3)(_UFFD_API, 0, 0)
        _ioctl(self.fd, UFFDIO_API, api)
        self.ranges: list[tuple[int, int]] = []

    def protect(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            start, n = _interior(t)
            if not n:
                continue
            _ioctl(self.fd, UFFDIO_REGISTER, (ctypes.c_uint64 * 4)(start, n, 2, 0))  # MODE_WP
            _ioctl(self.fd, UFFDIO_WRITEPROTECT, (ctypes.c_uint64 * 3)(start, n, 1))  # WP on
            edges = t.detach().reshape(-1).view(torch.uint8)
            head = start - t.data_ptr()
            tail = t.data_ptr() + len(edges) - (start + n)
            bytes(edges[:head].numpy()), bytes(edges[len(edges) - tail:].numpy())  # copied at the call
            self.ranges.append((start, n))

    def release(self) -> None:
        for start, n in self.ranges:
            _ioctl(self.fd, UFFDIO_WRITEPROTECT, (ctypes.c_uint64 * 3)(start, n, 0))
            _ioctl(self.fd, UFFDIO_UNREGISTER, (ctypes.c_uint64 * 2)(start, n))
        self.ranges.clear()

    def close(self) -> None:
        os.close(self.fd)


def _soft_dirty_available() -> bool:
    t = torch.ones(PAGE // 4 * 4)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("4")
    except OSError:
        return False
    t.add_(1)
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        entry = int.from_bytes(os.pread(fd, 8, (t.data_ptr() // PAGE + 1) * 8), "little")
    finally:
        os.close(fd)
    return bool(entry >> 55 & 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from fastckpt import _core
    from fastckpt._format.tensors import tensor_source

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 2048)).square().mean().backward()
    opt.step()
    tensors = [p.detach() for p in model.parameters()] + [v for s in opt.state.values() for v in s.values()
                                                          if v.numel() > 1]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    scratch = [torch.empty_like(t) for t in tensors]
    for d, s in zip(scratch, tensors):
        d.copy_(s)

    def memcpy() -> None:
        for d, s in zip(scratch, tensors):
            d.copy_(s)

    def hash_at_call() -> None:
        _core.hash_tensors([tensor_source(f"t{i}", t, None) for i, t in enumerate(tensors)])

    contenders = {"memcpy": memcpy, "hash at call (xxh3-128)": hash_at_call}
    notes = []
    try:
        uffd = Uffd()
        uffd.protect(tensors[:1])
        uffd.release()
        contenders["uffd write-protect"] = lambda: uffd.protect(tensors)
    except OSError as exc:
        notes.append(f"userfaultfd unavailable: {exc}")
        uffd = None

    def fork() -> None:
        pid = _libc.fork()
        if pid == 0:
            _libc._exit(0)
        os.waitpid(pid, 0)

    contenders["fork (copy-on-write snapshot)"] = fork
    names = list(contenders)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            contenders[n]()
            seconds[n].append(time.perf_counter() - start)
            if n == "uffd write-protect" and uffd is not None:
                uffd.release()
    if uffd is not None:
        uffd.close()
    print(f"state: {nbytes / 1e6:.0f} MB in {len(tensors)} tensors; {args.rounds} rounds; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; soft-dirty bits "
          f"{'available' if _soft_dirty_available() else 'unavailable (no CONFIG_MEM_SOFT_DIRTY)'}")
    print("| option | call s (median) | x memcpy (median of per-round ratios) |")
    print("|---|---|---|")
    for n in names:
        ratio = statistics.median(a / b for a, b in zip(seconds[n], seconds["memcpy"]))
        print(f"| {n} | {statistics.median(seconds[n]):.4f} | {ratio:.3f}x |")
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    sys.exit(main())

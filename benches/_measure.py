"""Measuring tools of the benchmark suite: timers that split "returned" from "durable", peak extra resident
memory, page-cache control (cold and warm), the raw sequential-I/O baseline and the machine's description.

Everything here is about *how* to measure; what is measured lives in :mod:`benches._contenders`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator

import torch

__all__ = [
    "Timing", "timed", "PeakRss", "fsync_tree", "drop_caches", "warm_cache", "dir_bytes", "raw_write",
    "raw_read", "machine_description", "RAW_CHUNK", "resident_bytes",
]

#: Bytes per write / read call of the raw baseline: 64 MiB, large enough that the call overhead vanishes.
RAW_CHUNK = 64 << 20


@dataclasses.dataclass
class Timing:
    """One timed call.

    Attributes:
        returned: seconds until the call returned to the caller (for an async save: the blocking time).
        done: seconds until the work was complete: saves durable on disk (after fsync, or after ``wait()``),
            loads with every byte in memory. Equal to ``returned`` for calls that finish before returning.
        peak_rss: peak extra resident memory during the call, in bytes (VmHWM after minus VmRSS before).
    """

    returned: float
    done: float
    peak_rss: int = 0


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


class PeakRss:
    """Peak extra resident memory of this process over a ``with`` block, in bytes.

    Resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``) on entry and reads ``VmHWM`` on exit,
    so nothing is sampled and nothing is missed. ``extra`` is 0 where the kernel lacks the interface.
    """

    def __enter__(self) -> PeakRss:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._ok = True
        except OSError:
            self._ok = False
        self._before = _status_kib("VmRSS:")
        self.extra = 0
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ok:
            self.extra = max(0, _status_kib("VmHWM:") - self._before) * 1024


def timed(call: Callable[[], Callable[[], object] | None], finish: Callable[[], object] | None = None) -> Timing:
    """Time ``call()``; then ``finish()`` (e.g. fsync, or ``handle.wait()``) for the ``done`` time.

    ``call`` may return a callable, which is used as ``finish`` (an async save returns its ``wait``).
    """
    with PeakRss() as rss:
        start = time.perf_counter()
        more = call()
        returned = time.perf_counter() - start
        for f in (more, finish):
            if callable(f):
                f()
        done = time.perf_counter() - start
    return Timing(returned, done, rss.extra)


def _files(path: pathlib.Path) -> Iterator[pathlib.Path]:
    if path.is_file():
        yield path
        return
    yield from (p for p in sorted(path.rglob("*")) if p.is_file())


def fsync_tree(path: pathlib.Path) -> None:
    """fsync every file under ``path``, every folder, and ``path``'s parent: what a durable save guarantees
    (a peer's checkpoint is durable only after this)."""
    entries = [*_files(path)]
    if path.is_dir():
        entries += [d for d in sorted(path.rglob("*")) if d.is_dir()] + [path]
    entries.append(path.parent)
    for p in entries:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def dir_bytes(path: pathlib.Path) -> int:
    """Bytes of the files under ``path`` (or of the file ``path``)."""
    return sum(p.stat().st_size for p in _files(path))


def drop_caches(paths: list[pathlib.Path], *, whole: bool = False) -> str:
    """Make the next read of ``paths`` come from the disk. Returns how.

    ``"fadvise"`` (the default): ``sync``, then ``POSIX_FADV_DONTNEED`` on every file under ``paths``, checked
    with ``mincore`` (:func:`resident_bytes`: at most 1 % may stay resident, else RuntimeError): a cold
    checkpoint in a process whose code is warm, as for a job that resumes. ``whole=True`` (root only, else it falls
    back to fadvise): ``echo 3 > /proc/sys/vm/drop_caches``, which also evicts the libraries' code pages, so the
    first calls after it page code back in from the disk (a cost no checkpoint format controls).
    """
    os.sync()
    if whole:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
            return "drop_caches"
        except OSError:
            pass
    for _attempt in range(2):
        for path in paths:
            for p in _files(path):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        resident, total = resident_bytes(paths)
        if resident <= total // 100:
            return "fadvise"
        import gc

        gc.collect()  # a mapping still alive (a lazily loaded tensor) pins its pages: free it and try again
    raise RuntimeError(f"{resident:,} of {total:,} bytes of {[str(p) for p in paths]} stay in the page cache after "
                       "POSIX_FADV_DONTNEED (mapped by a live object?): the load would not be cold")


def resident_bytes(paths: list[pathlib.Path]) -> tuple[int, int]:
    """(bytes of the files under ``paths`` in the page cache, their total bytes), by ``mincore`` over a fresh
    read-only mapping of each file: the check that a cold load really starts cold."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    resident = total = 0
    for path in paths:
        for p in _files(path):
            size = p.stat().st_size
            total += size
            if not size:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    raise OSError(ctypes.get_errno(), f"mmap of {p}")
                try:
                    vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
                    if libc.mincore(addr, size, vec) != 0:
                        raise OSError(ctypes.get_errno(), f"mincore of {p}")
                    raw = bytes(vec)
                    resident += (len(raw) - raw.count(0)) * page
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
    return min(resident, total), total


def warm_cache(paths: list[pathlib.Path]) -> None:
    """Read every file under ``paths`` once, so the next read is served from the page cache."""
    scratch = bytearray(RAW_CHUNK)
    for path in paths:
        for p in _files(path):
            with open(p, "rb", buffering=0) as f:
                while f.readinto(scratch):
                    pass


def raw_write(tensors: list[torch.Tensor], path: pathlib.Path) -> Timing:
    """The physical limit of writing: the bytes of ``tensors`` (contiguous CPU tensors) written to one new file
    with plain sequential ``write`` calls of :data:`RAW_CHUNK` bytes by one thread, then fsync of the file and
    its folder. ``returned``: after the last write; ``done``: after the fsyncs."""
    views = [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()]

    def write() -> None:
        with open(path, "wb", buffering=0) as f:
            for v in views:
                for at in range(0, len(v), RAW_CHUNK):
                    f.write(v[at : at + RAW_CHUNK])

    def sync() -> None:
        fsync_tree(path)

    return timed(lambda: write(), sync)


def round_order(items: list, r: int) -> list:
    """The order of round ``r`` (from 0): rotated by one every two rounds and reversed every other round, so that
    every two contenders run in both orders. A load that follows another reading the same file (or one just
    written) may find it in a cache below the page cache (a VM host's); a fixed order would hand that to the same
    contender every round."""
    k = (r // 2) % max(1, len(items))
    order = list(items[k:]) + list(items[:k])
    return order[::-1] if r % 2 else order


def raw_read(paths: pathlib.Path | list[pathlib.Path], into: torch.Tensor) -> Timing:
    """The physical limit of reading: each of ``paths`` (a file, or the files of a checkpoint folder, in name
    order) read sequentially by one thread with ``readinto`` calls of :data:`RAW_CHUNK` bytes into ``into`` (a
    pre-faulted uint8 CPU tensor of at least RAW_CHUNK bytes, filled round and round when the files are larger).

    The load rows read the checkpoint's own files against this, not a copy of the bytes elsewhere on the disk: on
    a VM disk two files of the same size read at rates up to 3x apart (where each lies, what a cache below the
    guest holds), so only the same files make ``x raw`` a measure of the reader."""
    files = [f for p in (paths if isinstance(paths, list) else [paths]) for f in _files(pathlib.Path(p))]
    view = memoryview(into.numpy())
    slots = len(view) // RAW_CHUNK

    def read() -> None:
        k = 0
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(view[k * RAW_CHUNK : (k + 1) * RAW_CHUNK]):
                    k = (k + 1) % slots

    return timed(lambda: read())


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _disk_of(path: pathlib.Path) -> str:
    try:
        out = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True, timeout=10)
        source, fstype = out.stdout.strip().splitlines()[-1].split()
        return f"{fstype} on {source}"
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return "unknown file system"


def machine_description(bench_dir: pathlib.Path) -> str:
    """One line: CPUs, memory, disk and file system, free space, kernel, Python, torch, GPU."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    free_gb = shutil.disk_usage(bench_dir).free / 1e9
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} x {_cpu_model()}, {mem_gib:.1f} GiB RAM, {_disk_of(bench_dir)} ({free_gb:.0f} GB free), "
        f"Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}, {gpu}"
    )

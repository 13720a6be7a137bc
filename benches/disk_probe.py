"""The device's own rates, the physical limits the loads and saves are measured against: O_DIRECT sequential reads
at queue depths 1-32 (the parallel read rate is the best of them) and the O_DIRECT write rate (64 MiB writes, then
fsync), on the disk under ``--dir``.

With ``fio`` on the PATH (``apt-get install fio``) it runs fio (libaio, 4 MiB blocks, ``--direct=1``); without it,
an equivalent probe in Python: ``threads`` = queue depth, each ``os.preadv`` of 4 MiB into its own page-aligned
buffer of an ``O_DIRECT`` file descriptor (the GIL is released during the read), offsets handed out in file order.

Usage::

    python benches/disk_probe.py [--dir /tmp/fastckpt-bench] [--size-mb 1024] [--seconds 2]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pathlib
import shutil
import subprocess
import threading
import time

__all__ = ["probe", "DEPTHS"]

DEPTHS = (1, 2, 4, 8, 16, 32)
BLOCK = 4 << 20


def _make_file(path: pathlib.Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    chunk = os.urandom(64 << 20)
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _fio(args: list[str]) -> dict:
    out = subprocess.run(["fio", "--output-format=json", *args], capture_output=True, text=True, check=True,
                         timeout=300)
    return json.loads(out.stdout)["jobs"][0]


def _fio_read(path: pathlib.Path, depth: int, seconds: float) -> float:
    job = _fio(["--name=probe", f"--filename={path}", "--rw=read", f"--bs={BLOCK}", "--direct=1",
                "--ioengine=libaio", f"--iodepth={depth}", f"--runtime={seconds}", "--time_based"])
    return job["read"]["bw_bytes"] / 1e9


def _fio_write(path: pathlib.Path, size: int) -> float:
    job = _fio(["--name=probe", f"--filename={path}", "--rw=write", f"--bs={64 << 20}", "--direct=1",
                "--ioengine=psync", f"--size={size}", "--end_fsync=1"])
    return job["write"]["bw_bytes"] / 1e9


def _py_read(path: pathlib.Path, depth: int, seconds: float) -> float:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    lock = threading.Lock()
    state = {"next": 0, "bytes": 0}
    stop = time.perf_counter() + seconds

    def worker() -> None:
        buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
        while time.perf_counter() < stop:
            with lock:
                at = state["next"]
                state["next"] = (at + BLOCK) % size
            n = os.preadv(fd, [buf], at)
            with lock:
                state["bytes"] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.close(fd)
    return state["bytes"] / (time.perf_counter() - start) / 1e9


def _py_write(path: pathlib.Path, size: int) -> float:
    buf = mmap.mmap(-1, 64 << 20)
    buf.write(os.urandom(1 << 20) * 64)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for at in range(0, size, len(buf)):
            os.pwritev(fd, [buf], at)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size / (time.perf_counter() - start) / 1e9


def probe(folder: pathlib.Path, *, size: int = 1 << 30, seconds: float = 2.0) -> dict:
    """``{"tool": "fio" | "python", "read": {depth: GB/s}, "parallel_read": best GB/s, "write": GB/s}`` of the
    disk holding ``folder`` (O_DIRECT: the page cache plays no part)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "disk-probe.bin"
    use_fio = shutil.which("fio") is not None
    try:
        _make_file(path, size)
        read = {d: (_fio_read if use_fio else _py_read)(path, d, seconds) for d in DEPTHS}
        write = (_fio_write if use_fio else _py_write)(folder / "disk-probe-write.bin", size)
    finally:
        for p in (path, folder / "disk-probe-write.bin"):
            p.unlink(missing_ok=True)
    return {"tool": "fio" if use_fio else "python", "read": read, "parallel_read": max(read.values()), "write": write}


def describe(result: dict) -> str:
    """One line: read GB/s per queue depth, the best, and the write rate."""
    depths = ", ".join(f"QD{d} {v:.2f}" for d, v in result["read"].items())
    return (f"disk ({result['tool']}, O_DIRECT, 4 MiB reads): {depths} GB/s; parallel read rate "
            f"{result['parallel_read']:.2f} GB/s; O_DIRECT write (64 MiB, fsync) {result['write']:.2f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.environ.get("FASTCKPT_BENCH_DIR", "/tmp/fastckpt-bench"))
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--python", action="store_true", help="use the Python probe even when fio is installed")
    args = ap.parse_args()
    if args.python:
        os.environ["PATH"] = ""
    print(describe(probe(pathlib.Path(args.dir), size=args.size_mb << 20, seconds=args.seconds)))


if __name__ == "__main__":
    main()

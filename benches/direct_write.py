"""The device's own durable write rate, and fastckpt's saves against it.

The buffered single-thread baseline of benches/_measure.py (``raw_write``) goes through the page cache, which is
slower than the device on some machines and flatters every contender. This one writes straight to the device:
``O_DIRECT``, 64 MiB aligned writes from one page-aligned buffer, then ``fsync``; nothing is cached, so the rate is
the disk's. Then, alternated each round, fastckpt's full save and model-only save of GPT-2 small (durable), each as
a ratio to the O_DIRECT rate of the same round (bytes per second over bytes per second; target >= 0.9x).

Usage::

    python benches/direct_write.py --rounds 3 [--dir /path/on/the/disk/to/test]
"""

from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Bytes per O_DIRECT write: 64 MiB, a multiple of every logical block size.
CHUNK = 64 << 20

__all__ = ["CHUNK", "direct_write"]


def direct_write(path: pathlib.Path, nbytes: int) -> float:
    """Write ``nbytes`` (rounded up to a 64 MiB multiple) to ``path`` with O_DIRECT and fsync; returns seconds.

    Raises:
        OSError: the file system refuses O_DIRECT (tmpfs, some overlay file systems): EINVAL.
    """
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (CHUNK >> 20))
    view = memoryview(buf)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        start = time.perf_counter()
        written = 0
        while written < nbytes:
            n = os.write(fd, view)
            if n != CHUNK:
                raise OSError(f"short O_DIRECT write of {n} bytes to {path}")
            written += n
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        view.release()
        buf.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=os.environ.get("BENCH_DIR"))
    args = parser.parse_args()
    import torch

    import fastckpt
    from benches._measure import machine_description, round_order
    from fastckpt.demo.gpt2 import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS["small"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    root = pathlib.Path(tempfile.mkdtemp(prefix="fastckpt-direct-", dir=args.dir))
    rows: dict[str, list[float]] = {"O_DIRECT 64 MiB writes + fsync": [], "fastckpt save_state full": [],
                                    "fastckpt save_state model_only": []}
    sizes: dict[str, int] = {}
    rates_by_round: list[dict[str, float]] = []

    def folder_bytes(p: pathlib.Path) -> int:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

    try:
        fastckpt.save_state(model, opt, output_dir=root / "warm")  # first-use costs, untimed
        shutil.rmtree(root / "warm")
        full_bytes = None
        for r in range(args.rounds):
            rates: dict[str, float] = {}
            for name in round_order(list(rows), r):
                out = root / "out"
                if name.startswith("O_DIRECT"):
                    n = full_bytes or 1 << 30
                    out.mkdir()
                    seconds = direct_write(out / "direct.bin", n)
                    n = -(-n // CHUNK) * CHUNK
                else:
                    start = time.perf_counter()
                    fastckpt.save_state(model, opt, output_dir=out, model_only=name.endswith("model_only"))
                    seconds = time.perf_counter() - start
                    n = folder_bytes(out)
                    if name.endswith("full"):
                        full_bytes = n
                sizes[name] = n
                rates[name] = n / seconds
                shutil.rmtree(out)
            for name in rows:
                rows[name].append(rates[name] / rates["O_DIRECT 64 MiB writes + fsync"])
            rates_by_round.append(rates)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"Machine: {machine_description(ROOT / 'benches')}. {args.rounds} rounds, alternated; medians.\n")
    print("| contender | GB | GB/s | x O_DIRECT |\n|---|---:|---:|---:|")
    for name, ratios in rows.items():
        gbps = statistics.median(r[name] for r in rates_by_round) / 1e9
        print(f"| {name} | {sizes[name] / 1e9:.2f} | {gbps:.2f} | {statistics.median(ratios):.2f}x |")


if __name__ == "__main__":
    main()

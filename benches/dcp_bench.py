"""Aggregate durable write and cold read throughput of torch.distributed.checkpoint storage plugins, 1/2/4 ranks.

Usage::

    python benches/dcp_bench.py                      # ranks 1,2,4; ~1 GB state; 3 rounds; prints the table
    python benches/dcp_bench.py --ranks 2 --gb 0.5 --rounds 2 --dir /tmp/dcp-bench

Each world size is one ``torchrun`` (gloo, CPU) that runs every round in it. The state is ``--gb`` GB of fp32
DTensors sharded along dim 0 over the ranks (each rank holds 1/N). Per round the contenders run in a rotated order
(alternated), each timed from a barrier before ``dcp.save`` to a barrier after it and after an fsync of every file
and folder (what a durable save means; fastckpt and ``FileSystemWriter(sync_files=True)`` fsync their files
already, the HF writer does not); then the page cache of the folder is dropped (``posix_fadvise``) and ``dcp.load``
into zeroed DTensors is timed the same way and checked bit-exact. Throughput = state bytes / wall seconds (all ranks
together). Reported: the median GB/s per contender and the median over rounds of fastckpt's per-round ratio to each.
Peak extra RSS per rank (``VmHWM``) is reported for the write.

Contenders: ``fastckpt.dcp.StorageWriter/StorageReader``, ``FileSystemWriter(thread_count=1)`` and ``(4)`` with
``FileSystemReader``, ``HuggingFaceStorageWriter(save_distributed=True)`` with ``HuggingFaceStorageReader``, and
``raw``: the disk's limit in the same run (each rank writes its shard's bytes to its own file with sequential 64 MiB
writes + fsync, and reads it back sequentially).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONTENDERS = ["fastckpt", "fs_t1", "fs_t4", "hf", "raw"]
TARGETS = {"fs_t4": 1.5, "hf": 2.5}


def _writer_reader(name: str, path: pathlib.Path):
    import torch.distributed.checkpoint as dcp

    import fastckpt.dcp

    if name == "fastckpt":
        return fastckpt.dcp.StorageWriter(path), fastckpt.dcp.StorageReader(path)
    if name.startswith("fs_t"):
        return (dcp.FileSystemWriter(str(path), thread_count=int(name[4:]), sync_files=True),
                dcp.FileSystemReader(str(path)))
    return dcp.HuggingFaceStorageWriter(str(path), save_distributed=True), dcp.HuggingFaceStorageReader(str(path))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    sys.path.insert(0, str(ROOT))
    from benches._measure import PeakRss, drop_caches, fsync_tree, raw_read, raw_write

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    n_tensors, cols = 16, 4096
    rows = int(args.gb * 1e9 / 4 / cols / n_tensors) // world * world
    g = torch.Generator().manual_seed(rank)
    local = {f"layer{i}.weight": torch.randn(rows // world, cols, generator=g) for i in range(n_tensors)}

    def dtensors(tensors):
        return {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False, shape=(rows, cols),
                                      stride=(cols, 1)) for k, v in tensors.items()}

    state = dtensors(local)
    nbytes = rows * cols * 4 * n_tensors
    base = pathlib.Path(args.dir)
    results: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    warm = {k: DTensor.from_local(torch.ones(world, 8), mesh, [Shard(0)], run_check=False, shape=(world * world, 8),
                                  stride=(8, 1)) for k in ("a", "b")}
    for name in CONTENDERS:  # first calls (imports, plan caches) stay out of the timings
        writer, reader = _writer_reader(name, base / f"warm-{name}-{world}")
        dcp.save(warm, storage_writer=writer)
        dcp.load(warm, storage_reader=reader)
    for r in range(args.rounds):
        order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[: r % len(CONTENDERS)]
        for name in order:
            path = base / f"{name}-{world}"
            if name == "raw":  # the disk's limit: each rank's bytes to its own file, sequential writes, fsync
                path.mkdir(exist_ok=True)
            else:
                writer, reader = _writer_reader(name, path)
            dist.barrier()
            with PeakRss() as rss:
                t0 = time.perf_counter()
                if name == "raw":
                    raw_write(list(local.values()), path / f"{rank}.bin")
                else:
                    dcp.save(state, storage_writer=writer)
                    if rank == 0:
                        fsync_tree(path)
                dist.barrier()
                write_s = time.perf_counter() - t0
            if rank == 0:
                drop_caches([path])
            target = dtensors({k: torch.zeros_like(v) for k, v in local.items()})
            dist.barrier()
            t0 = time.perf_counter()
            if name == "raw":
                raw_read(path / f"{rank}.bin", torch.empty(64 << 20, dtype=torch.uint8).fill_(0))
            else:
                dcp.load(target, storage_reader=reader)
            dist.barrier()
            read_s = time.perf_counter() - t0
            exact = name == "raw" or all(torch.equal(target[k].to_local(), local[k]) for k in local)
            peaks = [None] * world
            dist.all_gather_object(peaks, rss.extra)
            results[name].append({"write_gbs": nbytes / write_s / 1e9, "read_gbs": nbytes / read_s / 1e9,
                                  "exact": exact, "peak_rss": max(peaks)})
            del target
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    if rank == 0:
        (base / f"results-{world}.json").write_text(json.dumps({"bytes": nbytes, "results": results}))
    dist.barrier()
    dist.destroy_process_group()


def _median_ratio(res: dict, name: str, key: str) -> float:
    return statistics.median(a[key] / b[key] for a, b in zip(res["fastckpt"], res[name]))


def table(all_results: dict[int, dict]) -> str:
    lines = ["| ranks | contender | write GB/s | read GB/s | fastckpt write x | fastckpt read x | peak extra RSS "
             "per rank | exact |", "|---:|---|---:|---:|---:|---:|---:|---|"]
    for world, data in sorted(all_results.items()):
        res = data["results"]
        for name in CONTENDERS:
            w = statistics.median(x["write_gbs"] for x in res[name])
            rd = statistics.median(x["read_gbs"] for x in res[name])
            peak = max(x["peak_rss"] for x in res[name]) / 2**20
            ratios = ("", "") if name == "fastckpt" else (f"{_median_ratio(res, name, 'write_gbs'):.2f}",
                                                          f"{_median_ratio(res, name, 'read_gbs'):.2f}")
            exact = "yes" if all(x["exact"] for x in res[name]) else "NO"
            lines.append(f"| {world} | {name} | {w:.2f} | {rd:.2f} | {ratios[0]} | {ratios[1]} | {peak:.0f} MiB "
                         f"| {exact} |")
    return "\n".join(lines)


def verdict(all_results: dict[int, dict]) -> str:
    out = []
    for world in (2, 4):
        if world not in all_results:
            continue
        res = all_results[world]["results"]
        for name, target in TARGETS.items():
            got = _median_ratio(res, name, "write_gbs")
            out.append(f"- {world} ranks, write vs {name}: {got:.2f}x (target {target}x): "
                       f"{'met' if got >= target else 'NOT met'}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/fastckpt-dcp-bench")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    base = pathlib.Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    all_results = {}
    start = time.perf_counter()
    for world in map(int, args.ranks.split(",")):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(world), __file__, "--worker", "--gb", str(args.gb), "--rounds", str(args.rounds),
                        "--dir", args.dir], env=env, check=True, stdout=subprocess.DEVNULL)
        all_results[world] = json.loads((base / f"results-{world}.json").read_text())
    shutil.rmtree(base, ignore_errors=True)
    gb = all_results[next(iter(all_results))]["bytes"] / 1e9
    print(f"DCP storage plugins: {gb:.2f} GB fp32 DTensor state, {args.rounds} rounds, "
          f"{time.perf_counter() - start:.0f} s\n")
    print(table(all_results))
    print()
    print(verdict(all_results))


if __name__ == "__main__":
    main()

"""Write and read throughput of torch.distributed.checkpoint storage plugins to an S3 API server (moto, local).

Usage::

    python benches/s3_bench.py                   # 256 MiB state, 3 rounds; prints the table
    python benches/s3_bench.py --mb 512 --rounds 5 --write-results

One moto server runs in its own process (``python -m moto.server``) on a free localhost port; every contender talks
to it through the standard AWS environment (``AWS_ENDPOINT_URL``). The state is ``--mb`` MiB of fp32 tensors (16
tensors). Per round the contenders run in a rotated order (alternated), each in a fresh process: ``dcp.save`` of the
state to a new prefix is timed (wall seconds, to the committed checkpoint), then ``dcp.load`` into zeroed tensors
(checked bit-exact), and the process's peak RSS (``VmHWM``, which includes torch and the state itself) is read at
the end; the prefix is deleted after the round. Reported: median seconds and MB/s per contender, and the median over
rounds of fastckpt's per-round speed-up against each (``x`` > 1: fastckpt faster).

Contenders: ``fastckpt.dcp.StorageWriter/StorageReader`` (s3:// through the Rust object_store client, uploading
straight from tensor memory: 16 MiB parts, 16 requests in flight), DCP's ``FsspecWriter/FsspecReader`` with s3fs,
and s3torchconnector's ``S3StorageWriter/S3StorageReader`` (the AWS CRT client), each at its default
``thread_count=1`` and at ``thread_count=8`` (the rank's data split into 8 files written by 8 threads).
``--contenders`` picks some; ``FASTCKPT_BENCH_OPTIONS=part_size=...,concurrency=...`` sets fastckpt's
``storage_options`` (for profiling).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONTENDERS = ["fastckpt", "fsspec_t1", "fsspec_t8", "s3torch_t1", "s3torch_t8"]
BUCKET = "bench"


def _state(mb: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    rows = mb * (1 << 20) // 4 // 16 // 1024
    return {f"w{i}": torch.randn(rows, 1024, generator=g) for i in range(16)}


def _options() -> dict[str, str]:
    """fastckpt's ``storage_options`` from ``FASTCKPT_BENCH_OPTIONS`` (``key=value,key=value``; for profiling)."""
    text = os.environ.get("FASTCKPT_BENCH_OPTIONS", "")
    return dict(item.split("=", 1) for item in text.split(",") if item)


def _pair(name: str, url: str):
    import fastckpt.dcp

    if name == "fastckpt":
        options = _options() or None
        return (fastckpt.dcp.StorageWriter(url, storage_options=options),
                fastckpt.dcp.StorageReader(url, storage_options=options))
    threads = int(name.rsplit("_t", 1)[1])
    if name.startswith("s3torch"):
        # S3StorageWriter/Reader take no endpoint: their S3Client is replaced by one for the local server
        # (S3Client(endpoint=...), path-style addressing as moto needs on localhost)
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        region, endpoint = os.environ["AWS_REGION"], os.environ["AWS_ENDPOINT_URL"]
        config = S3ClientConfig(force_path_style=True)
        writer = S3StorageWriter(region, url, s3client_config=config, thread_count=threads)
        reader = S3StorageReader(region, url, s3client_config=config)
        for plugin in (writer, reader):
            plugin.fs._client = S3Client(region, endpoint=endpoint, s3client_config=config)
        return writer, reader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter(url, thread_count=threads, sync_files=False), FsspecReader(url)


def _peak_rss_mb() -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(name: str, mb: int, prefix: str) -> dict:
    """Run one contender once in this process: save, load, check; the timings."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    state = _state(mb)
    url = f"s3://{BUCKET}/{prefix}"
    writer, reader = _pair(name, url)
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=writer, no_dist=True)
    write_s = time.perf_counter() - t0
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=reader, no_dist=True)
    read_s = time.perf_counter() - t0
    exact = all(torch.equal(target[k], state[k]) for k in state)
    return {"write_s": write_s, "read_s": read_s, "exact": exact, "rss_mb": _peak_rss_mb()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server() -> tuple[subprocess.Popen, dict[str, str]]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
               AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ALLOW_HTTP="true")
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
    for _ in range(200):
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except Exception:
            time.sleep(0.05)
    return proc, env


def _delete(env: dict[str, str], prefix: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for o in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=o["Key"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated, fastckpt first")
    parser.add_argument("--one", nargs=2, metavar=("NAME", "PREFIX"), help=argparse.SUPPRESS)
    parser.add_argument("--write-results", action="store_true", help="append the table to benches/RESULTS.md")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.mb, args.one[1])))
        return
    contenders = args.contenders.split(",")
    assert contenders[0] == "fastckpt" and set(contenders) <= set(CONTENDERS), contenders
    server, env = _server()
    results: dict[str, list[dict]] = {c: [] for c in contenders}
    try:
        for r in range(args.rounds):
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            for name in order:
                prefix = f"{name}-r{r}"
                out = subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--one", name, prefix],
                                     env=env, capture_output=True, text=True, check=True)
                res = json.loads(out.stdout.strip().splitlines()[-1])
                assert res["exact"], f"{name} round {r}: the loaded state differs"
                results[name].append(res)
                _delete(env, prefix)
    finally:
        server.terminate()
        server.wait()
    table = _table(results, args.mb, args.rounds)
    print(table)
    if args.write_results:
        with open(ROOT / "benches" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write("\n" + table + "\n")


def _table(results: dict[str, list[dict]], mb: int, rounds: int) -> str:
    mbytes = mb * (1 << 20) / 1e6
    lines = [f"### s3:// (moto on localhost), {mb} MiB fp32 state (16 tensors), {rounds} rounds, alternated",
             "", "| contender | write s | write MB/s | read s | read MB/s | fastckpt x (write) | fastckpt x (read) "
             "| peak RSS MB |", "|---|---|---|---|---|---|---|---|"]
    fc = results["fastckpt"]
    for name, res in results.items():
        w = statistics.median(x["write_s"] for x in res)
        rd = statistics.median(x["read_s"] for x in res)
        xw = statistics.median(o["write_s"] / f["write_s"] for o, f in zip(res, fc))
        xr = statistics.median(o["read_s"] / f["read_s"] for o, f in zip(res, fc))
        rss = statistics.median(x["rss_mb"] for x in res)
        lines.append(f"| {name} | {w:.2f} | {mbytes / w:.0f} | {rd:.2f} | {mbytes / rd:.0f} | {xw:.2f} | {xr:.2f} "
                     f"| {rss:.0f} |")
    lines.append("")
    lines.append("Medians over rounds; `fastckpt x` is the median of per-round ratios (contender seconds / fastckpt "
                 "seconds). Peak RSS includes torch and the state itself (the same for every contender). The "
                 "server is moto (Python), so absolute numbers are bounded by it, not by a real store.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""What a multi-process save / load costs beyond its bytes: collective rounds, store traffic, coordinator planning.

Usage::

    python benches/planning_bench.py                      # worlds 1,2,4,8; 5 rounds; prints the table
    python benches/planning_bench.py --worlds 2,4 --rounds 3

The state is tiny on purpose (16 ``Linear(64, 64)`` under FSDP2 + AdamW, ~0.8 MB with the moments), so what is
timed is the planning and synchronisation, not the I/O (accelerate#4099: resumes that took 62 min at 16 ranks and
5 h at 2816 ranks in DCP's planning collectives over gloo). Each world size is one ``torchrun`` (gloo, CPU); per
round the contenders run alternated (fastckpt ``save_state`` / ``load_state``, ``dcp.save`` / ``dcp.load`` with
``FileSystemWriter`` / ``FileSystemReader`` on the same state dicts), each timed from a barrier to a barrier.

Counted on every rank during each call, by wrapping the calls (nothing is sampled):

- ``collectives``: torch.distributed collective calls (``gather_object``, ``scatter_object_list``,
  ``broadcast_object_list``, ``all_gather_object``, ``barrier``, ``all_reduce``, ...): DCP's planning rounds;
- ``planning rounds``: DCP's planning rounds (a gather of the ranks' plans + a scatter of the global plan: 2 of
  the collectives); fastckpt's resave of an unchanged state makes none (:mod:`fastckpt._plan.dcp_resave`);
- ``collective KB sent``: the pickled size of what the rank hands to those object collectives (its plan in a
  gather, the plans the coordinator scatters, ...);
- ``store ops`` / ``store KB``: requests to the process group's key-value store (fastckpt's own steps, see
  :mod:`fastckpt._io.group.distributed`) and the bytes set + read through it;
- ``plan ms``: the coordinator's planning work (``create_global_plan`` of DCP's planners, the storage writer's
  ``prepare_global_plan`` and ``finish``), on rank 0; ``global plan ms``: the ``create_global_plan`` part (what a
  cached plan skips; ``finish`` merges each save's write results and runs every time).

Reported per world size: median wall ms per call, and rank 0's counts (medians over rounds); the last rows give
the count per rank of the largest world, which must not grow with the world size for the non-coordinator ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = ("fastckpt_save_first", "fastckpt_save", "dcp_save", "fastckpt_load", "dcp_load")
_COLLECTIVES = ("gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object", "barrier",
                "all_reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter", "all_to_all")


class Counts:
    """What one rank did during one call (see the module docs)."""

    def __init__(self) -> None:
        self.c: Counter[str] = Counter()
        self.plan_s = 0.0
        self.depth = 0

    def reset(self) -> None:
        self.c = Counter()
        self.plan_s = 0.0


COUNTS = Counts()


def _size(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj))
    except Exception:
        return 0


#: the argument holding what a rank sends, per object collective (positional index, keyword)
_PAYLOAD = {"gather_object": (0, "obj"), "all_gather_object": (1, "obj"),
            "scatter_object_list": (1, "scatter_object_input_list"), "broadcast_object_list": (0, "object_list")}


def _payload(name: str, args: tuple, kwargs: dict) -> Any:
    if name not in _PAYLOAD:
        return None
    index, key = _PAYLOAD[name]
    return args[index] if len(args) > index else kwargs.get(key)


def _wrap_collectives() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*args: Any, __fn: Any = fn, __name: str = name, **kwargs: Any) -> Any:
            if COUNTS.depth:  # a collective inside another (gather_object sends sizes, then data): one round
                return __fn(*args, **kwargs)
            COUNTS.c["collectives"] += 1
            COUNTS.c[f"coll:{__name}"] += 1
            payload = _payload(__name, args, kwargs)
            if payload is not None:
                COUNTS.c["collective_bytes"] += _size(payload)
            COUNTS.depth += 1
            try:
                return __fn(*args, **kwargs)
            finally:
                COUNTS.depth -= 1

        setattr(dist, name, counted)
        if hasattr(c10d, name):
            setattr(c10d, name, counted)


class _StoreProxy:
    """The default store, counting requests and bytes."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            COUNTS.c["store_ops"] += 1
            if name in ("set", "compare_set") and len(args) > 1:
                COUNTS.c["store_bytes"] += len(args[-1])
            if name == "multi_set" and len(args) > 1:
                COUNTS.c["store_bytes"] += sum(len(v) for v in args[1])
            out = attr(*args, **kwargs)
            if name == "get":
                COUNTS.c["store_bytes"] += len(out)
            if name == "multi_get":
                COUNTS.c["store_bytes"] += sum(len(v) for v in out)
            return out

        return call


def _wrap_store() -> None:
    import torch.distributed.distributed_c10d as c10d

    original = c10d._get_default_store
    cache: dict[int, _StoreProxy] = {}

    def proxy() -> Any:
        store = original()
        return cache.setdefault(id(store), _StoreProxy(store))

    c10d._get_default_store = proxy


def _wrap_planning_rounds() -> None:
    """Count DCP's planning rounds (``_DistWrapper.reduce_scatter("plan", ...)``: a gather of every rank's plan and
    a scatter of the global plan; each is 2 of the collectives above)."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    real = _DistWrapper.reduce_scatter

    def counted(self: Any, step: str, *args: Any, **kwargs: Any) -> Any:
        if step == "plan":
            COUNTS.c["planning_rounds"] += 1
        return real(self, step, *args, **kwargs)

    _DistWrapper.reduce_scatter = counted


def _wrap_planning() -> None:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    import fastckpt.dcp

    def timed(cls: Any, name: str) -> None:
        fn = getattr(cls, name)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                COUNTS.plan_s += time.perf_counter() - start
                if name == "create_global_plan":
                    COUNTS.c["global_plan_ms"] += (time.perf_counter() - start) * 1e3

        setattr(cls, name, wrapper)

    for cls, name in ((DefaultSavePlanner, "create_global_plan"), (DefaultLoadPlanner, "create_global_plan"),
                      (fastckpt.dcp.StorageWriter, "prepare_global_plan"), (fastckpt.dcp.StorageWriter, "finish"),
                      (FileSystemWriter, "prepare_global_plan"), (FileSystemWriter, "finish")):
        timed(cls, name)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import fastckpt

    dist.init_process_group("gloo")
    _wrap_collectives()
    _wrap_store()
    _wrap_planning()
    _wrap_planning_rounds()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(16)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    base = pathlib.Path(args.dir)

    def fastckpt_save(r: int) -> None:
        fastckpt.save_state(model, opt, output_dir=base / f"fc{r}", durable=False)

    def fastckpt_save_first(r: int) -> None:  # as the first save of a state: fastckpt.dcp's plan caches emptied
        from torch.distributed.checkpoint.planner import SavePlanner

        for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_final_save_plan,
                      SavePlanner._cached_all_plans, SavePlanner._cached_global_plan, SavePlanner._cached_metadata):
            for key in [k for k in cache if k.startswith("fastckpt.dcp:")]:
                del cache[key]
        fastckpt.save_state(model, opt, output_dir=base / f"fc_first{r}", durable=False)

    def fastckpt_load(r: int) -> None:
        fastckpt.load_state(model, opt, input_dir=base / f"fc{r}")

    def dcp_save(r: int) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(str(base / f"dcp{r}"),
                                                                                   sync_files=False))

    def dcp_load(r: int) -> None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(base / f"dcp{r}")))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    calls = {"fastckpt_save_first": fastckpt_save_first, "fastckpt_save": fastckpt_save, "dcp_save": dcp_save, "fastckpt_load": fastckpt_load,
             "dcp_load": dcp_load}
    out: dict[str, list[dict[str, Any]]] = {op: [] for op in OPS}
    for r in range(args.rounds + 1):  # round 0 warms up (imports, first-use groups); not reported
        order = ["fastckpt_save_first", "fastckpt_save", "dcp_save"] if r % 2 == 0 else \
            ["dcp_save", "fastckpt_save_first", "fastckpt_save"]
        order += ["fastckpt_load", "dcp_load"] if r % 2 == 0 else ["dcp_load", "fastckpt_load"]
        for op in order:
            dist.barrier()
            COUNTS.reset()
            start = time.perf_counter()
            calls[op](r)
            elapsed = time.perf_counter() - start
            counted = dict(COUNTS.c)
            plan_s = COUNTS.plan_s
            dist.barrier()
            if r:
                out[op].append({"ms": elapsed * 1e3, "plan_ms": plan_s * 1e3, **counted})
    (pathlib.Path(args.out) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


RATIOS = (("fastckpt_save", "dcp_save"), ("fastckpt_save", "fastckpt_save_first"), ("fastckpt_load", "dcp_load"))


def _round_ratio(res: list[dict[str, list[dict[str, Any]]]], a: str, b: str) -> float:
    rounds = range(len(res[0][a]))
    return statistics.median(max(r[a][i]["ms"] for r in res) / max(r[b][i]["ms"] for r in res) for i in rounds)


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(row.get(key, 0) for row in rows)


def run_world(world: int, rounds: int) -> list[dict[str, list[dict[str, Any]]]]:
    with tempfile.TemporaryDirectory(prefix="fastckpt-plan-") as tmp:
        out = pathlib.Path(tmp) / "out"
        out.mkdir()
        data = pathlib.Path(tmp) / "data"
        data.mkdir()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "python"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               __file__, "--worker", "--dir", str(data), "--out", str(out), "--rounds", str(rounds)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"world {world} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
        shutil.rmtree(data, ignore_errors=True)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write every measurement to this file")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    everything: dict[int, list] = {}
    print(f"tiny FSDP2 state (16 x Linear(64, 64) + AdamW), gloo on {os.cpu_count()} cores; medians of "
          f"{args.rounds} alternated rounds; counts are rank 0's (coordinator) per call")
    print("| op | world | wall ms | collectives | planning rounds | collective KB sent | store ops | store KB "
          "| coordinator plan ms | of it global plan ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w in worlds:
        res = run_world(w, args.rounds)
        everything[w] = res
        for op in OPS:
            rows = res[0][op]
            wall = statistics.median(max(r[op][i]["ms"] for r in res) for i in range(len(rows)))
            print(f"| {op} | {w} | {wall:.0f} | {_median(rows, 'collectives'):.0f} | "
                  f"{_median(rows, 'planning_rounds'):.0f} | "
                  f"{_median(rows, 'collective_bytes') / 1e3:.1f} | {_median(rows, 'store_ops'):.0f} | {_median(rows, 'store_bytes') / 1e3:.1f} | "
                  f"{_median(rows, 'plan_ms'):.1f} | {_median(rows, 'global_plan_ms'):.1f} |")
    print("\nmedians of per-round ratios (wall of the slowest rank, same round):")
    for w in worlds:
        cells = [f"{a}/{b} {_round_ratio(everything[w], a, b):.2f}" for a, b in RATIOS]
        print(f"  world {w}: " + "; ".join(cells))
    last = everything[worlds[-1]]
    print(f"\ncollectives by kind at world {worlds[-1]}, rank 0:")
    for op in OPS:
        kinds = Counter()
        for row in last[0][op][:1]:
            kinds.update({k[5:]: v for k, v in row.items() if k.startswith("coll:")})
        print(f"  {op}: {dict(kinds)}")
    print(f"\nper rank at world {worlds[-1]} (collectives / store ops per call; medians):")
    for op in OPS:
        cells = [f"{_median(r[op], 'collectives'):.0f}/{_median(r[op], 'store_ops'):.0f}" for r in last]
        print(f"  {op}: " + " ".join(cells))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(everything))


if __name__ == "__main__":
    main()

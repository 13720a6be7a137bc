"""One process of the multi-process CheckpointManager test (``torchrun --nproc-per-node W``, gloo, CPU, data
parallel); each rank runs every scenario and writes ``OUT/rank{r}.json`` for
tests/integrations/test_recovery_multiprocess.py. Each rank's memory tier is its own folder
(``OUT/{scenario}/mem{r}``), so a deleted folder emulates a lost node.

The gradients are averaged by one ``all_reduce`` per parameter, not by DDP: with DDP the 4-process resume differed
from the uninterrupted run in the last bits of the weights (the 2-process one did not). The likely cause is DDP's
bucket rebuild after a process's first iteration (by the order gradients became ready), which changes the
all-reduce's summation order; with 2 processes the sum of two values does not depend on the order.

- reference: TOTAL steps uninterrupted; the fingerprint (tests/helpers/recovery_loop.py) every resume must equal.
- preempt: rank W-1 sends itself SIGTERM during step K; every rank must save the same step durably and raise
  Preempted; then a restart restores it (from each rank's memory tier) and finishes bit-exactly.
- lost_node: replicas=1; after step 7 (saves at 3 and 6) every process "dies" (its manager dropped), rank 1's memory
  tier is deleted and the durable step 6 removed, the durable step 3 damaged; the restart restores step 6, rank 1
  from a peer's replica, without reading the durable tier (no warning about its damaged step 3).
- damaged_memory: replicas=1; a flipped byte in rank 0's memory tier: rank 0 warns (TierSkippedWarning) and restores
  from the peer holding its replica, the others from their memory tiers.
- durable_only: every memory tier deleted: every rank restores from the local durable tier.
- continuous: ``continuous=True``: the main process proposes each save through the store when the previous one is
  durable; every rank must save at the same steps.
- fsdp_memory / fsdp_damaged / fsdp_lost: FSDP2 states in the memory tier (tests/helpers/mp_fsdp_manager.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fastckpt
from helpers.mp_fsdp_manager import fsdp_scenarios
from helpers.recovery_loop import Counter, DataOrder, fingerprint, seed_globals, train_step

OUT = Path(sys.argv[1])
TOTAL, EVERY, K = 10, 3, 4
checks: dict[str, object] = {}


def build(rank: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 1))
    for p in model.parameters():  # every rank starts from rank 0's weights, as DDP would
        dist.broadcast(p.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched, DataOrder(seed=7 + rank), Counter()


def manager(name: str, state, rank: int, **kw):
    mgr = fastckpt.CheckpointManager(OUT / name / "proj", *state[:3], every_n_steps=EVERY,
                                     memory=OUT / name / f"mem{rank}", timeout=60, **kw)
    mgr.register_for_checkpointing(state[3], state[4], per_rank=True)  # each rank's own data order and counter
    return mgr


def train(name: str, rank: int, *, until: int = TOTAL, signal_at: int | None = None, **kw):
    """Restore, train to ``until``; returns (manager, start, fingerprint | Preempted, warnings)."""
    state = build(rank)
    seed_globals(1 + rank)
    mgr = manager(name, state, rank, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = mgr.restore()
    try:
        for step in range(start, until):
            train_step(*state, sync=average_gradients)
            if step + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            mgr.step(step + 1)
    except fastckpt.Preempted as exc:
        return mgr, start, exc, [str(w.message) for w in caught]
    return mgr, start, fingerprint(*state), [str(w.message) for w in caught]


def average_gradients(model: nn.Module) -> None:
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))


def scenarios(rank: int, world: int) -> None:
    mgr, _, ref, _ = train("reference", rank)
    mgr.close()

    # preempt: only the last rank sees the signal
    mgr, start, exc, _ = train("preempt", rank, signal_at=K if rank == world - 1 else None)
    checks["preempt_step"] = getattr(exc, "step", None)
    checks["preempt_code"] = getattr(exc, "code", None)
    dist.barrier()
    durable = OUT / "preempt" / "proj" / "checkpoints" / f"checkpoint_{K + 1}"
    checks["preempt_durable_files"] = sorted(p.name for p in durable.iterdir()) if durable.is_dir() else None
    mgr, start, got, _ = train("preempt", rank)
    checks["preempt_restart"] = [start, mgr.restored_from]
    checks["preempt_equal"] = same(got, ref)
    checks["preempt_diff"] = [k for k in ref if k not in got or not torch.equal(got[k], ref[k])]
    mgr.close()

    # lost node
    mgr, _, _, _ = train("lost_node", rank, until=7, replicas=1)
    mgr.wait()  # the replicas of step 6 are in place; then every process "dies"
    mgr.signals.uninstall()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(OUT / "lost_node" / "mem1")
        shutil.rmtree(OUT / "lost_node" / "proj" / "checkpoints" / "checkpoint_6")
        flip(OUT / "lost_node" / "proj" / "checkpoints" / "checkpoint_3" / "model.safetensors")
    dist.barrier()
    mgr, start, got, caught = train("lost_node", rank, replicas=1)
    checks["lost_restart"] = [start, mgr.restored_from]
    checks["lost_warnings"] = caught
    checks["lost_equal"] = same(got, ref)
    mgr.close()

    # damaged memory tier of rank 0
    mgr, _, _, _ = train("damaged", rank, until=7, replicas=1)
    mgr.wait()
    mgr.signals.uninstall()
    dist.barrier()
    if rank == 0:
        flip(OUT / "damaged" / "mem0" / "checkpoints" / "checkpoint_6" / "model.safetensors")
    dist.barrier()
    mgr, start, got, caught = train("damaged", rank, replicas=1)
    checks["damaged_restart"] = [start, mgr.restored_from]
    checks["damaged_warnings"] = caught
    checks["damaged_equal"] = same(got, ref)
    mgr.close()

    # every memory tier gone: the durable tier
    mgr, _, _, _ = train("durable_only", rank, until=7)
    mgr.wait()
    mgr.signals.uninstall()
    dist.barrier()
    shutil.rmtree(OUT / "durable_only" / f"mem{rank}")
    dist.barrier()
    mgr, start, got, caught = train("durable_only", rank)
    checks["durable_restart"] = [start, mgr.restored_from]
    checks["durable_equal"] = same(got, ref)
    mgr.close()


def continuous(rank: int) -> None:
    state = build(rank)
    seed_globals(1 + rank)
    mgr = fastckpt.CheckpointManager(OUT / "continuous" / "proj", *state[:3], continuous=True,
                                     memory=OUT / "continuous" / f"mem{rank}", timeout=60)
    saved = []
    for step in range(8):
        train_step(*state, sync=average_gradients)
        if mgr.step(step + 1):
            saved.append(step + 1)
        mgr.wait()  # rank 0: the durable copy ends within the step, so the next save is proposed at once
    mgr.close()
    checks["continuous_saved"] = saved


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        scenarios(rank, world)
        continuous(rank)
        fsdp_scenarios(OUT, rank, world, checks)
        checks["crash"] = None
    except BaseException:
        checks["crash"] = traceback.format_exc()[-4000:]
    (OUT / f"rank{rank}.json").write_text(json.dumps(checks, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

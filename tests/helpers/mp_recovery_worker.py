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
- random_preempt: 5 SIGTERMs in one job, each to a random rank at a random moment (at a step boundary, inside the
  gradient all-reduce, inside a save, inside the restore) and step, drawn from ``FASTCKPT_TEST_SEED`` (the same on
  every rank; only the chosen rank sends itself the signal, from the loop: no sleeps); every rank must save the
  same step durably and raise Preempted, and the job, restarted after each, ends equal to its uninterrupted run.
- durable_failed: rank 0's background durable copies of steps 6 and 9 fail; every rank raises DurableSaveError, at
  the same step for step 6 (agreed through the store) and at close() for step 9; the durable tier keeps step 3.
- continuous: ``continuous=True``: the main process proposes each save through the store when the previous one is
  durable; every rank must save at the same steps.
- fsdp_memory / fsdp_damaged / fsdp_lost: FSDP2 states in the memory tier (tests/helpers/mp_fsdp_manager.py).
"""

from __future__ import annotations

import json
import os
import random
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


def signal_then_average(model: nn.Module) -> None:
    """SIGTERM to this process inside the step, just before the gradient all-reduce."""
    os.kill(os.getpid(), signal.SIGTERM)
    average_gradients(model)


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
    memory_full(rank, world, ref)


def memory_full(rank: int, world: int, ref: dict) -> None:
    """``/dev/shm`` full (ENOSPC injected into the memory snapshot's files): the last rank's at step 3, rank 0's at
    step 6 (rank 0 then writes step 6 durably in step()); nobody raises or hangs; after a crash at step 7 the
    restart restores step 6 (rank 0 from the durable tier, the others from memory) and ends bit-exact."""
    from fastckpt._io.storage.local import commit

    real = commit.write_text
    full_at = {world - 1: 3, 0: 6}.get(rank)
    mem = str(OUT / "memory_full" / f"mem{rank}")

    def write_text(path, data, durable):
        if full_at is not None and str(path).startswith(mem) and f".checkpoint_{full_at}.fastckpt-staging" in str(path):
            raise OSError(28, "No space left on device (injected)", str(path))
        return real(path, data, durable)

    commit.write_text = write_text
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr, _, _, _ = train("memory_full", rank, until=7)
            mgr.wait()
    finally:
        commit.write_text = real
    checks["memory_full_warned"] = [str(w.message) for w in caught if w.category is fastckpt.MemoryTierFullWarning]
    checks["memory_full_leftovers"] = sorted(p.name for p in Path(mem, "checkpoints").iterdir())
    mgr.signals.uninstall()  # the process "dies" at step 7
    dist.barrier()
    mgr, start, got, _ = train("memory_full", rank)
    checks["memory_full_restart"] = [start, mgr.restored_from]
    checks["memory_full_equal"] = same(got, ref)
    mgr.close()


class Trap:
    """A per-rank registered object that sends SIGTERM to this process from inside a save or a restore."""

    def __init__(self) -> None:
        self.on_save: int | None = None
        self.on_restore = False
        self.step = 0

    def state_dict(self) -> dict:
        if self.on_save is not None and self.step == self.on_save:
            self.on_save = None
            os.kill(os.getpid(), signal.SIGTERM)
        return {}

    def load_state_dict(self, state: dict) -> None:
        if self.on_restore:
            self.on_restore = False
            os.kill(os.getpid(), signal.SIGTERM)


RANDOM_TOTAL, RANDOM_ROUNDS = 104, 20  # a round moves at most EVERY + 2 steps: 20 fit


def random_preemptions(rank: int, world: int) -> None:
    rng = random.Random(int(os.environ.get("FASTCKPT_TEST_SEED", "25")))  # the same draws on every rank
    mgr, _, ref, _ = train("random_ref", rank, until=RANDOM_TOTAL)
    mgr.close()
    rounds, final = [], None
    kinds = ["boundary", "all_reduce", "save", "restore"]
    later = kinds[:]  # every moment once after the first (nothing to restore), then random ones
    rng.shuffle(later)
    moments = [rng.choice(["boundary", "all_reduce"])] + later + [rng.choice(kinds) for _ in range(RANDOM_ROUNDS - 5)]
    for r in range(RANDOM_ROUNDS + 1):
        state, trap = build(rank), Trap()
        seed_globals(1 + rank)
        mgr = manager("random", state, rank)
        mgr.register_for_checkpointing(trap, per_rank=True)
        moment = who = at = None
        if r < RANDOM_ROUNDS:
            moment = moments[r]
            who = rng.randrange(world)
        trap.on_restore = moment == "restore" and rank == who
        start = mgr.restore()
        if moment in ("boundary", "all_reduce"):
            at = rng.randrange(start + 1, start + 3)
        elif moment == "save":  # inside the next due save (its gather of the per-rank states)
            at = next(s for s in range(start + 1, RANDOM_TOTAL) if s % EVERY == 0)
            trap.on_save = at if rank == who else None
        else:
            at = start
        signalled = rank == who and moment in ("boundary", "all_reduce")
        try:
            for step in range(start, RANDOM_TOTAL):
                mid = signalled and moment == "all_reduce" and step + 1 == at
                train_step(*state, sync=signal_then_average if mid else average_gradients)
                trap.step = step + 1
                if signalled and moment == "boundary" and step + 1 == at:
                    os.kill(os.getpid(), signal.SIGTERM)
                mgr.step(step + 1)
        except fastckpt.Preempted as exc:
            durable = exc.path / "fastckpt.json"
            rounds.append([moment, who, at, start, exc.step, mgr.restored_from, durable.is_file()])
            dist.barrier()  # every rank raised before the next "restart" reads the tiers
            continue
        mgr.close()
        final = fingerprint(*state)
        rounds.append([None, None, None, start, None, mgr.restored_from, None])
        break
    checks["random_rounds"] = rounds
    checks["random_equal"] = final is not None and same(final, ref)


def durable_failure(rank: int) -> None:
    import fastckpt.manager.durable as durable_mod

    real = durable_mod.copy_committed

    def failing(src, target, **kw):
        if target.name in ("checkpoint_6", "checkpoint_9"):
            raise OSError(28, "No space left on device (injected)", str(target))
        return real(src, target, **kw)

    state = build(rank)
    seed_globals(1 + rank)
    mgr = manager("durable_failed", state, rank)
    if rank == 0:
        durable_mod.copy_committed = failing
    raised = []
    try:
        for step in range(9):
            train_step(*state, sync=average_gradients)
            try:
                mgr.step(step + 1)
            except fastckpt.DurableSaveError as exc:
                raised.append([step + 1, type(exc).__name__, "checkpoint_6" in str(exc), exc.__cause__ is not None])
            if step + 1 == 6 and rank == 0:  # the copy of step 6 has failed before step 7's boundary
                mgr.durable.idle()
        try:
            mgr.close()
        except fastckpt.DurableSaveError as exc:
            raised.append(["close", type(exc).__name__, "checkpoint_9" in str(exc), exc.__cause__ is not None])
    finally:
        durable_mod.copy_committed = real
    checks["durable_failed_raised"] = raised
    dist.barrier()
    checks["durable_failed_latest"] = fastckpt.latest_checkpoint(OUT / "durable_failed" / "proj").name


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
        random_preemptions(rank, world)
        durable_failure(rank)
        continuous(rank)
        fsdp_scenarios(OUT, rank, world, checks)
        checks["crash"] = None
    except BaseException:
        checks["crash"] = traceback.format_exc()[-4000:]
    (OUT / f"rank{rank}.json").write_text(json.dumps(checks, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

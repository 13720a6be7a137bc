"""The FSDP2 scenario of the multi-process CheckpointManager test (run by tests/helpers/mp_recovery_worker.py inside
its torchrun launch; checked by tests/integrations/test_recovery_multiprocess.py).

FSDP2 (``fully_shard`` per block, then the root; gloo, CPU) + AdamW + StepLR (tests/helpers/fsdp_models.py: W-rank
training is bit-identical to one plain process). Each rank's memory tier is its own folder.

- memory: saves at steps 2 and 4 (``every_n_steps=2``); every process "dies" after step 4 (its manager dropped);
  a fresh model, optimizer and scheduler restore step 4 from each rank's memory tier: every local shard and every
  optimizer state equals the live one at the save (``torch.equal``); trained on to step 6, the full state equals
  the one-process reference of 6 steps.
- lost: ``replicas=1``; rank 1's memory tier deleted (a replaced machine) and the durable step 4 removed: rank 1
  restores its local shards from the peer holding its replica, the others from their memory tiers; bit-exact.
- damaged: a flipped byte in rank 0's memory-tier model file: rank 0 warns (TierSkippedWarning naming the memory
  tier), and every rank restores step 4 from the durable tier (a normal sharded checkpoint, one collective load);
  trained on to step 6, equal to the reference.
- reborn: the project folder deleted after step 4 and a fresh run started at the same path with the same memory
  folders: every rank skips its old snapshot (TierSkippedWarning naming both incarnation ids) and starts at 0;
  trained to step 6, equal to the reference.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import fastckpt
from helpers.fsdp_models import build, full_state, optimizer_for, reference, same, shard, train_step

SAVE_EVERY, STOP, TOTAL = 2, 4, 6


def local_state(model, opt) -> dict[str, torch.Tensor]:
    """This rank's local shards of every model tensor and optimizer state tensor (clones)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"model.{k}": local(v) for k, v in get_model_state_dict(model).items()}
    for fqn, state in get_optimizer_state_dict(model, opt)["state"].items():
        out.update({f"optim.{fqn}.{n}": local(v) for n, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def _run(out: Path, name: str, rank: int, world: int, until: int):
    model = shard(build("tiny"))
    opt, sched = optimizer_for(model)
    mgr = fastckpt.CheckpointManager(out / name / "proj", model, opt, sched, every_n_steps=SAVE_EVERY,
                                     memory=out / name / f"mem{rank}", timeout=60,
                                     replicas=1 if name == "fsdp_lost" else 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = mgr.restore()
    restored = local_state(model, opt) if start else None
    for step in range(start, until):
        train_step(model, opt, sched, step, rank=rank, world=world)
        mgr.step(step + 1)
    return mgr, model, opt, start, restored, [f"{w.category.__name__}: {w.message}" for w in caught]


def fsdp_scenarios(out: Path, rank: int, world: int, checks: dict) -> None:
    ref = full_state(*reference("tiny", TOTAL)[:2])
    for name in ("fsdp_memory", "fsdp_damaged", "fsdp_lost", "fsdp_reborn"):
        mgr, model, opt, _, _, _ = _run(out, name, rank, world, STOP)
        saved = local_state(model, opt)
        mgr.wait()  # the replicas are in place
        mgr.signals.uninstall()  # the process "dies": the memory tier stays
        dist.barrier()
        if name == "fsdp_lost" and rank == 0:  # rank 1's machine replaced, the durable step 4 gone too
            shutil.rmtree(out / name / "mem1")
            shutil.rmtree(out / name / "proj" / "checkpoints" / f"checkpoint_{STOP}")
        if name == "fsdp_reborn" and rank == 0:  # rm -rf the project; a fresh run at the same path and memory
            shutil.rmtree(out / name / "proj")
        if name == "fsdp_damaged" and rank == 0:
            path = out / name / "mem0" / "checkpoints" / f"checkpoint_{STOP}" / "model.local_rank0.safetensors"
            data = bytearray(path.read_bytes())
            data[-3] ^= 0x10
            path.write_bytes(bytes(data))
        dist.barrier()
        mgr, model, opt, start, restored, caught = _run(out, name, rank, world, TOTAL)
        checks[f"{name}_restart"] = [start, mgr.restored_from]
        checks[f"{name}_local_equal"] = restored is not None and same(restored, saved)
        checks[f"{name}_equal"] = same(full_state(model, opt), ref)
        checks[f"{name}_warnings"] = caught
        checks[f"{name}_files"] = sorted(p.name for p in (out / name / f"mem{rank}" / "checkpoints" /
                                                           f"checkpoint_{TOTAL}").iterdir())
        durable = out / name / "proj" / "checkpoints" / f"checkpoint_{TOTAL}" / "fastckpt.json"
        checks[f"{name}_durable_sharded"] = "sharded" in json.loads(durable.read_text())
        mgr.close()

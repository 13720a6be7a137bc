"""One process of the FSDP2 crash test (tests/integrations/test_fsdp_crash.py starts two of them itself, not
through torchrun, which would kill the survivor as soon as a worker dies).

Usage: ``RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python mp_fsdp_crash.py OUT``

Both ranks train the tiny model one step and save ``OUT/ckpt`` (the state the test expects to survive), train a
second step and save into ``OUT/ckpt`` again; rank 1 is SIGKILLed as its DCP shard write starts. Rank 0 writes
``OUT/crash_rank0.json`` with the error it raised (it must raise within the ``timeout`` of 5 s) and exits 3.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastckpt  # noqa: E402
import fastckpt.dcp  # noqa: E402
from helpers.fsdp_models import build, optimizer_for, shard, train_step  # noqa: E402

OUT = Path(sys.argv[1])


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(build("tiny", 0))
    opt, sched = optimizer_for(model)
    train_step(model, opt, sched, 0, rank=rank, world=world)
    fastckpt.save_state(model, opt, sched, output_dir=OUT / "ckpt", step=1, timeout=5)
    train_step(model, opt, sched, 1, rank=rank, world=world)
    if rank == 1:
        def die(self, plan, planner):
            os.kill(os.getpid(), signal.SIGKILL)

        fastckpt.dcp.StorageWriter.write_data = die
    try:
        fastckpt.save_state(model, opt, sched, output_dir=OUT / "ckpt", step=2, timeout=5)
    except Exception as exc:
        (OUT / f"crash_rank{rank}.json").write_text(json.dumps({
            "error": type(exc).__name__, "message": str(exc)[:1000],
            "checkpoint_error": isinstance(exc, fastckpt.CheckpointError)}))
        os._exit(3)
    (OUT / f"crash_rank{rank}.json").write_text(json.dumps({"error": None}))
    os._exit(0)


if __name__ == "__main__":
    main()

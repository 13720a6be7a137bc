"""One process of the three-process participation test (``torchrun --nproc-per-node 3``, gloo, CPU); each rank
writes ``OUT/rank{r}.json`` for tests/integrations/test_participation.py.

- late_join: ranks 0 and 1 call ``fastckpt.accelerate.save_state`` together; rank 2 calls only once rank 0 has
  decided the round (``"all"``, after the grace: one place still free), and still takes part in the one commit.
- main_only: rank 0 alone (the diffusers pattern) among three processes.
- all: the three together.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator

import fastckpt.accelerate

OUT = Path(sys.argv[1])
checks: dict[str, object] = {}


def main() -> None:
    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    rank = acc.process_index
    try:
        model, opt = acc.prepare(torch.nn.Linear(4, 2), torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1))
        store = dist.distributed_c10d._get_default_store()
        if rank == 2:  # wait (on the store, not a sleep) until rank 0 has decided round 1 without this process
            while not store.check(["fastckpt/participation/1/decision"]):
                time.sleep(0.01)
            checks["late_join_decision"] = store.get("fastckpt/participation/1/decision").decode()
        checks["late_join"] = str(fastckpt.accelerate.save_state(acc, OUT / "late_join", timeout=120))
        if rank == 0:
            checks["main_only"] = str(fastckpt.accelerate.save_state(acc, OUT / "main_only", timeout=120))
        dist.barrier()
        checks["all"] = str(fastckpt.accelerate.save_state(acc, OUT / "all", timeout=120))
        checks["crash"] = None
    except Exception:
        checks["crash"] = traceback.format_exc()[-3000:]
    (OUT / f"rank{rank}.json").write_text(json.dumps(checks, indent=1))


if __name__ == "__main__":
    main()

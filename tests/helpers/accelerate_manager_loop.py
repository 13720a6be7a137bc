"""tests/helpers/recovery_loop.py's training loop through an ``accelerate.Accelerator`` (CPU, one process) and
``fastckpt.accelerate.checkpoint_manager``, for tests/integrations/test_accelerate_manager.py:

    python tests/helpers/accelerate_manager_loop.py PROJECT MEMORY TOTAL EVERY [--wait]

model, AdamW and StepLR go through ``accelerator.prepare``; the data order and the counter through
``accelerator.register_for_checkpointing``; the manager (``memory=MEMORY``, ``every_n_steps=EVERY``) gets them all
from the Accelerator. Prints ``restored {step} {tier}``, ``step {n}`` after each ``mgr.step(n)`` (with ``--wait``
it then reads one line from stdin: the test's handshake), and at the end writes the fingerprint to
``PROJECT/final.safetensors`` and prints ``done``; a preemption prints ``preempted {step}`` and exits 0.
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from recovery_loop import build, fingerprint, seed_globals, train_step
from safetensors.torch import save_file

import fastckpt
import fastckpt.accelerate


def main(argv: list[str]) -> int:
    project, memory, total, every = argv[0], argv[1], int(argv[2]), int(argv[3])
    wait = "--wait" in argv
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    model, opt, sched, data, counter = build()
    model, opt, sched = accelerator.prepare(model, opt, sched)
    accelerator.register_for_checkpointing(data, counter)
    seed_globals()
    mgr = fastckpt.accelerate.checkpoint_manager(accelerator, project, every_n_steps=every, memory=memory)
    start = mgr.restore()
    print(f"restored {start} {mgr.restored_from}", flush=True)
    try:
        for step in range(start, total):
            train_step(model, opt, sched, data, counter)
            mgr.step(step + 1)
            print(f"step {step + 1}", flush=True)
            if wait:
                sys.stdin.readline()
    except fastckpt.Preempted as exc:
        print(f"preempted {exc.step}", flush=True)
        raise
    mgr.close()
    save_file(fingerprint(accelerator.unwrap_model(model), opt, sched, data, counter), f"{project}/final.safetensors")
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

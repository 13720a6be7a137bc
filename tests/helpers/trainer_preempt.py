"""A ``fastckpt.transformers.Trainer`` run (tests/helpers/trainer_runs.py) in a child process, for the preemption
tests of tests/integrations/test_transformers_preemption.py:

    python tests/helpers/trainer_preempt.py OUT [--wait] [--resume]

prints ``step {n}`` at each ``on_step_end`` and with ``--wait`` then reads one line from stdin before going on (the
test's handshake: it sends the signal there, so the signal lands at a known step without sleeps). At the end it
writes the logged losses, the final weights and the optimizer state to ``OUT/result.safetensors`` and prints
``done``; a preemption prints ``preempted {step} {code}`` and exits with ``fastckpt.Preempted``'s code.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import save_file
from transformers import TrainerCallback

import fastckpt
from helpers.trainer_runs import losses, run


class Handshake(TrainerCallback):
    def __init__(self, wait: bool) -> None:
        self.wait = wait

    def on_step_end(self, args, state, control, **kwargs):
        print(f"step {state.global_step}", flush=True)
        if self.wait:
            sys.stdin.readline()


def result(trainer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone().contiguous() for k, v in trainer.model.state_dict().items()
           if not k.endswith("lm_head.weight")}  # tied to wte
    for i, st in trainer.optimizer.state_dict()["state"].items():
        for name, t in st.items():
            out[f"opt.{i}.{name}"] = torch.as_tensor(t).clone()
    out["losses"] = torch.tensor(losses(trainer), dtype=torch.float64)
    return out


def main(argv: list[str]) -> int:
    out = argv[0]
    torch.set_num_threads(1)
    try:
        trainer = run("fastckpt", out, callbacks=(Handshake("--wait" in argv),),
                      resume=True if "--resume" in argv else None, seed=3 if "--resume" in argv else 0)
    except fastckpt.Preempted as exc:
        print(f"preempted {exc.step} {exc.code}", flush=True)
        raise
    save_file(result(trainer), f"{out}/result.safetensors", metadata={"steps": json.dumps(trainer.state.global_step)})
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

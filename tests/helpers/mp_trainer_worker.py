"""One process of the two-process ``fastckpt.transformers.Trainer`` test (``torchrun --nproc-per-node 2``, gloo, CPU,
DDP); every scenario runs in this one launch. Each rank writes ``OUT/rank{r}.json`` (logged losses per scenario,
errors) and ``OUT/{scenario}_rank{r}.safetensors`` (final weights) for
tests/integrations/test_transformers_multiprocess.py.

Each rank reseeds its torch RNG with ``1000 + rank`` when training begins, so the two processes draw different
dropout masks and a resume is exact only if every rank gets its own RNG states back.

- full: an uninterrupted run (checkpoints at 4, 8, 10), the reference.
- resumed: stopped after the checkpoint of step 4, then a new Trainer resumes (``resume_from_checkpoint=True``).
- stock: the stock Trainer stops after step 4 (``rng_state_{rank}.pth``...), fastckpt's Trainer resumes it.
- async: ``fastckpt_async_save=True``, uninterrupted.
- preempted: rank 1 alone gets SIGUSR1 during step 5 (sent to itself at ``on_step_end``); both ranks agree on the
  next step boundary, save ``checkpoint-6`` and raise ``fastckpt.Preempted``; a new Trainer resumes from it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

import safetensors.torch as st
import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastckpt  # noqa: E402
from helpers.trainer_runs import losses, run, weights  # noqa: E402

OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
checks: dict[str, object] = {}


class RankSeed(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        torch.manual_seed(1000 + args.process_index)


class SignalOnRank1(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5 and args.process_index == 1:
            os.kill(os.getpid(), signal.SIGUSR1)


def go(kind: str, out: Path, callbacks: tuple = (), **kw):
    return run(kind, out, use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=2,
               callbacks=(RankSeed(), *callbacks), **kw)


def record(name: str, trainer, after: int = 0) -> None:
    checks[f"{name}_losses"] = losses(trainer, after)
    checks[f"{name}_world"] = trainer.args.world_size
    st.save_file(weights(trainer), OUT / f"{name}_rank{RANK}.safetensors")


def resumed() -> None:
    go("fastckpt", OUT / "resumed", stop_at=4)
    record("resumed", go("fastckpt", OUT / "resumed", resume=True, seed=3), 4)


def stock() -> None:
    go("stock", OUT / "stock", stop_at=4)
    checks["stock_files"] = sorted(p.name for p in (OUT / "stock" / "checkpoint-4").iterdir())
    record("stock", go("fastckpt", OUT / "stock", resume=True, seed=3), 4)


def preempted() -> None:
    try:
        go("fastckpt", OUT / "preempted", callbacks=(SignalOnRank1(),))
        checks["preempted_step"] = None
    except fastckpt.Preempted as exc:
        checks["preempted_step"] = [exc.step, exc.code, exc.signum]
    checks["preempted_files"] = sorted(p.name for p in (OUT / "preempted").iterdir())
    record("preempted", go("fastckpt", OUT / "preempted", resume=True, seed=3), 6)


def main() -> None:
    torch.set_num_threads(1)
    for name, fn in (("full", lambda: record("full", go("fastckpt", OUT / "full"))), ("resumed", resumed),
                     ("stock", stock),
                     ("async", lambda: record("async", go("fastckpt", OUT / "async",
                                                          trainer_kwargs={"fastckpt_async_save": True}))),
                     ("preempted", preempted)):
        try:
            fn()
            checks[f"scenario_{name}"] = None
        except Exception:
            checks[f"scenario_{name}"] = traceback.format_exc()[-3000:]
    (OUT / f"rank{RANK}.json").write_text(json.dumps(checks, indent=1, default=str))


if __name__ == "__main__":
    main()

"""A Lightning fit (tests/integrations/lightning_fit.py's TinyModule, StatefulDataLoader, 20 steps) with
``fastckpt.lightning.PreemptionCheckpoint`` in a child process, for tests/integrations/test_lightning_preemption.py:

    python tests/helpers/lightning_preempt.py ROOT TAG [--wait] [--resume]

prints ``step {n}`` at each ``on_train_batch_end`` and with ``--wait`` then reads one line from stdin (the test's
handshake: it sends the signal there, so the signal lands at a known step without sleeps). ``--resume``: fit from
``ROOT/ckpts/last.ckpt``. At the end it writes the losses logged in this process (``(global_step, loss)``), the
final weights, optimizer and scheduler state to ``ROOT/result_{TAG}.safetensors`` and prints ``done``; a
preemption prints ``preempted {step} {code}`` and exits with ``fastckpt.Preempted``'s code.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))

import lightning_fit as lf  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import fastckpt  # noqa: E402
import fastckpt.lightning  # noqa: E402


class Handshake(pl.Callback):
    def __init__(self, wait: bool) -> None:
        self.wait = wait

    def on_train_batch_end(self, trainer, *args, **kwargs):
        print(f"step {trainer.global_step}", flush=True)
        if self.wait:
            sys.stdin.readline()


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    root, tag = Path(argv[0]), argv[1]
    torch.set_num_threads(1)
    ckpt = root / "ckpts" / "last.ckpt"
    callbacks = [Handshake("--wait" in argv), fastckpt.lightning.PreemptionCheckpoint(root / "ckpts")]
    try:
        t, model = lf.fit(20, root / tag, ckpt_path=str(ckpt) if "--resume" in argv else None, callbacks=callbacks)
    except fastckpt.Preempted as exc:
        print(f"preempted {exc.step} {exc.code}", flush=True)
        raise
    final = lf.final_state(t, model)
    out = {f"model.{k}": v.contiguous() for k, v in final["weights"].items()}
    for i, st in final["optimizer"]["state"].items():
        out.update({f"opt.{i}.{k}": torch.as_tensor(v).clone() for k, v in st.items()})
    out["lr"] = torch.tensor(t.lr_scheduler_configs[0].scheduler.get_last_lr(), dtype=torch.float64)
    out["losses"] = torch.tensor(model.losses, dtype=torch.float64)
    out["global_step"] = torch.tensor([t.global_step])
    save_file(out, root / f"result_{tag}.safetensors")
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

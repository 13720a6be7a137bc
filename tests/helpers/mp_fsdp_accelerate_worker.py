"""One process of the accelerate FSDP2 test (``torchrun --nproc-per-node 2``, gloo, CPU); each rank writes
``OUT/acc_rank{r}.json`` for tests/integrations/test_fsdp_accelerate.py.

accelerate ignores the FSDP plugin on CPU; its FSDP2 code path runs when ``distributed_type`` is FSDP on both
``AcceleratorState`` and ``PartialState`` (set here before ``prepare``, which then calls ``fully_shard``).

- main_only: a MULTI_CPU Accelerator, ``fastckpt.accelerate.save_state`` on the main process only: it raises
  CollectiveTimeoutError within 2 s instead of hanging; when rank 1 calls it late it raises too.
- sharded: SHARDED_STATE_DICT save after 2 steps -> load into fresh prepared objects: equal, step restored.
- full: FULL_STATE_DICT save (single-file layout written by the main process) -> load: equal.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402

import fastckpt  # noqa: E402
import fastckpt.accelerate  # noqa: E402
from helpers.fsdp_models import VOCAB, batch, build, full_state, optimizer_for, same  # noqa: E402

OUT = Path(sys.argv[1])
checks: dict[str, object] = {}


def error_of(fn) -> dict[str, str | None]:
    try:
        fn()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:800]}
    return {"error": None, "message": ""}


def fsdp_accelerator(state_dict_type: str):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type,
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"])
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    AcceleratorState().distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    AcceleratorState().fsdp_plugin = plugin
    return acc


def prepared(acc, seed: int, steps: int):
    model = build("tiny", seed)
    opt, sched = optimizer_for(model)
    model, opt, sched = acc.prepare(model, opt, sched)
    for s in range(steps):
        ids = batch(s)
        loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        acc.backward(loss * (acc.num_processes if acc.process_index == 0 else 0))
        opt.step()
        sched.step()
        acc.step += 1
    return model, opt, sched


def scenario_main_only(rank: int) -> None:
    acc = Accelerator(cpu=True)
    model, opt, sched = prepared(acc, 0, 0)
    target = OUT / "main_only"
    if rank == 0:
        checks["main_only"] = error_of(lambda: fastckpt.accelerate.save_state(acc, target, timeout=2))
    dist.barrier()
    if rank == 1:
        checks["main_only"] = error_of(lambda: fastckpt.accelerate.save_state(acc, target, timeout=2))
    checks["main_only_nothing_written"] = not target.exists()
    checks["main_only_then_saved"] = (fastckpt.accelerate.save_state(acc, target) / "fastckpt.json").is_file()


def scenario(kind: str, rank: int) -> None:
    sdt = {"sharded": "SHARDED_STATE_DICT", "full": "FULL_STATE_DICT"}[kind]
    acc = fsdp_accelerator(sdt)
    model, opt, sched = prepared(acc, 0, 2)
    checks[f"{kind}_distributed_type"] = str(acc.distributed_type)
    checks[f"{kind}_is_dtensor"] = type(next(model.parameters())).__name__
    saved = full_state(model, opt.optimizer)
    saved_sched = sched.state_dict()
    path = fastckpt.accelerate.save_state(acc, OUT / kind)
    checks[f"{kind}_path"] = str(path)
    if rank == 0 and kind == "full":
        import safetensors.torch as st

        stored = st.load_file(path / "model.safetensors")
        checks["full_model_file"] = same({f"model.{k}": v for k, v in stored.items()},
                                         {k: v for k, v in saved.items() if k.startswith("model.")})
    acc2 = fsdp_accelerator(sdt)
    model2, opt2, sched2 = prepared(acc2, 5, 0)
    result = fastckpt.accelerate.load_state(acc2, OUT / kind)
    got = full_state(model2, opt2.optimizer)
    checks[f"{kind}_loaded"] = same(got, saved) or sorted(set(got) ^ set(saved))[:5]
    checks[f"{kind}_sched"] = sched2.state_dict() == saved_sched
    checks[f"{kind}_step"] = acc2.step
    checks[f"{kind}_result"] = [result.missing_keys, result.unexpected_keys]


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name, fn in (("main_only", lambda: scenario_main_only(rank)), ("sharded", lambda: scenario("sharded", rank)),
                     ("full", lambda: scenario("full", rank))):
        try:
            fn()
            checks[f"scenario_{name}"] = None
        except Exception:
            checks[f"scenario_{name}"] = traceback.format_exc()[-3000:]
    (OUT / f"acc_rank{rank}.json").write_text(json.dumps(checks, indent=1, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

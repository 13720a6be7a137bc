"""One process of the accelerate FSDP2 test (``torchrun --nproc-per-node 2``, gloo, CPU); each rank writes
``OUT/acc_rank{r}.json`` for tests/integrations/test_fsdp_accelerate.py.

accelerate ignores the FSDP plugin on CPU; its FSDP2 code path runs when ``distributed_type`` is FSDP on both
``AcceleratorState`` and ``PartialState`` (set here before ``prepare``, which then calls ``fully_shard``).

- diffusers: a MULTI_CPU (DDP) loop that saves with ``if accelerator.is_main_process: save_state(...)``: the main
  process saves alone (its files, ``random_states_0``); both processes train on and load it (rank 1 warns that its
  RNG states were not saved); a save on every process afterwards is the usual all-ranks commit; a save that
  rank 1 calls after the main process saved alone (and started its next save) raises CheckpointError at once.
- sharded_main_only: an FSDP2 model saved on the main process only: CheckpointError there, at once.
- sharded: SHARDED_STATE_DICT save after 2 steps -> load into fresh prepared objects: equal, step restored.
- full: FULL_STATE_DICT save (single-file layout written by the main process) -> load: equal.
- auto_model_only: SHARDED_STATE_DICT with automatic naming and total_limit=1: model-only snapshots go to
  ``model_only/`` and rotate there; ``iteration`` counts the full checkpoints only.
"""

from __future__ import annotations

import json
import random
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
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


def seed_rngs(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def draws() -> list:
    return [random.random(), float(np.random.rand()), torch.rand(2).tolist()]


def ddp_prepared(acc, seed: int, steps: int):
    """A replicated (DDP) model with dropout, trained ``steps`` steps on per-rank data (diffusers-style loop)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    g = torch.Generator().manual_seed(500 + acc.process_index)
    for _ in range(steps):
        opt.zero_grad()
        acc.backward(torch.nn.functional.mse_loss(model(torch.randn(6, 4, generator=g)), torch.randn(6, 3, generator=g)))
        opt.step()
        sched.step()
    return model, opt, sched


def ddp_state(acc, model, opt, sched):
    return ({k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
            sched.state_dict())


def ddp_same(a, b) -> bool:
    (ma, oa, sa), (mb, ob, sb) = a, b
    return (ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
            and oa.keys() == ob.keys() and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])
            and sa == sb)


def scenario_diffusers(rank: int) -> None:
    """``if accelerator.is_main_process: save_state(...)`` inside a DDP loop, then a load on both processes."""
    acc = Accelerator(cpu=True)
    seed_rngs(100 + rank)
    model, opt, sched = ddp_prepared(acc, 0, 2)
    saved = ddp_state(acc, model, opt, sched)
    target = OUT / "diffusers"
    if acc.is_main_process:  # the diffusers examples' pattern, as written there
        checks["diffusers_save"] = error_of(lambda: fastckpt.accelerate.save_state(acc, target, timeout=60))
        checks["diffusers_draws_at_save"] = draws()
    ddp_prepared_step = ddp_state(acc, model, opt, sched)  # the other process went on: one more DDP step works
    opt.zero_grad()
    acc.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    checks["diffusers_group_usable"] = not ddp_same(ddp_state(acc, model, opt, sched), ddp_prepared_step)
    acc2 = Accelerator(cpu=True)
    model2, opt2, sched2 = ddp_prepared(acc2, 5, 1)
    seed_rngs(7)
    kept = draws()
    seed_rngs(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fastckpt.accelerate.load_state(acc2, target, timeout=60)
    checks["diffusers_warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    checks["diffusers_loaded"] = ddp_same(ddp_state(acc2, model2, opt2, sched2), saved)
    checks["diffusers_draws_after_load"] = draws()
    checks["diffusers_kept_draws"] = kept
    # every process calls: the one atomic commit of both processes' files, as before
    checks["diffusers_all_path"] = str(fastckpt.accelerate.save_state(acc2, OUT / "diffusers_all", timeout=60))
    # the main process saves alone again, then starts its next save; process 1 calls the first one late: it is
    # never paired with process 0's next save (an error at once), and the next save pairs up again
    if rank == 0:
        checks["late_main"] = error_of(lambda: fastckpt.accelerate.save_state(acc2, OUT / "late", timeout=60))
    dist.barrier()
    if rank == 1:
        checks["late_other"] = error_of(lambda: fastckpt.accelerate.save_state(acc2, OUT / "late", timeout=2))
    checks["after_late_saved"] = str(fastckpt.accelerate.save_state(acc2, OUT / "after_late", timeout=60))


def scenario_sharded_main_only(rank: int) -> None:
    """An FSDP2 (sharded) model saved on the main process only: a clear error there, not a timeout."""
    acc = fsdp_accelerator("SHARDED_STATE_DICT")
    prepared(acc, 0, 0)
    target = OUT / "sharded_main_only"
    if rank == 0:
        checks["sharded_main_only"] = error_of(lambda: fastckpt.accelerate.save_state(acc, target, timeout=300))
    dist.barrier()
    checks["sharded_main_only_nothing_written"] = not target.exists()
    checks["sharded_then_saved"] = (fastckpt.accelerate.save_state(acc, target) / "fastckpt.json").is_file()


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


def scenario_auto_model_only(rank: int) -> None:
    """SHARDED_STATE_DICT with automatic naming (total_limit=1): model-only snapshots are numbered and rotated apart
    (``model_only/``) and leave ``iteration`` to the full checkpoints, as the replicated path does."""
    from accelerate.utils import ProjectConfiguration

    project = OUT / "auto"
    acc = fsdp_accelerator("SHARDED_STATE_DICT")
    acc.project_configuration = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True,
                                                     total_limit=1)
    prepared(acc, 0, 1)
    names = [fastckpt.accelerate.save_state(acc).relative_to(project).as_posix()]
    for _ in range(2):
        names.append(fastckpt.accelerate.save_state(acc, model_only=True).relative_to(project).as_posix())
    checks["auto_iteration_after_snapshots"] = acc.project_configuration.iteration
    names.append(fastckpt.accelerate.save_state(acc).relative_to(project).as_posix())
    checks["auto_names"] = names
    dist.barrier()
    checks["auto_left"] = sorted(f"{kind}/{p.name}" for kind in ("checkpoints", "model_only")
                                 for p in (project / kind).iterdir() if not p.name.startswith("."))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name, fn in (("diffusers", lambda: scenario_diffusers(rank)), ("sharded", lambda: scenario("sharded", rank)),
                     ("sharded_main_only", lambda: scenario_sharded_main_only(rank)),
                     ("full", lambda: scenario("full", rank)),
                     ("auto_model_only", lambda: scenario_auto_model_only(rank))):
        try:
            fn()
            checks[f"scenario_{name}"] = None
        except Exception:
            checks[f"scenario_{name}"] = traceback.format_exc()[-3000:]
    (OUT / f"acc_rank{rank}.json").write_text(json.dumps(checks, indent=1, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One process of the two-process accelerate test (``torchrun --nproc-per-node 2``, gloo, CPU).

Usage: ``torchrun --standalone --nproc-per-node 2 tests/helpers/mp_accelerate_worker.py OUT_DIR``. Each rank writes
``OUT_DIR/rank{r}.json``: ``{check name: value}``; tests/test_multiprocess.py asserts on them and on the files.

A: fastckpt.accelerate save (automatic naming, total_limit) -> load into fresh objects (latest), per-rank RNG.
B: compat="accelerate" save -> stock ``Accelerator.load_state`` in two processes.
C: stock ``Accelerator.save_state`` (DDP ``module.`` keys, two RNG files) -> fastckpt.accelerate load.
D: rank 1's RNG file damaged -> rank 1 raises HeaderError, rank 0 CheckpointError, nothing changes on either.
E: the main process cannot write -> it raises its OSError, rank 1 CheckpointError; the group stays usable.
F: ``async_save=True`` while three DDP steps run: every rank's handle completes after the one commit, which holds
   the values at the call; a failed async write raises on every rank's ``wait()``.
G: a shuffled DataLoader (accelerate's default sampler): saved after epoch 0, resumed in fresh objects; the
   resumed epoch 1 (batches, final weights, RNG draws) equals the uninterrupted run's; the checkpoint is also
   loaded by one process in tests/integrations/test_multiprocess.py. A compat="accelerate" save cannot hold the
   shuffling generator: its load warns.
H: as A with an ``s3://`` project_dir (``FASTCKPT_TEST_S3_URL``, the moto server in ``AWS_*``): both ranks' RNG
   files in the one commit, every rank restores its own streams from the latest remote checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastckpt
import fastckpt.accelerate

OUT = Path(sys.argv[1])
checks: dict[str, object] = {}


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def prepared(acc: Accelerator, seed: int, steps: int = 0):
    model, opt, sched = acc.prepare(*build(seed))
    g = torch.Generator().manual_seed(500 + acc.process_index)  # different data per rank; DDP averages grads
    for _ in range(steps):
        opt.zero_grad()
        acc.backward(nn.functional.mse_loss(model(torch.randn(6, 4, generator=g)), torch.randn(6, 3, generator=g)))
        opt.step()
        sched.step()
    return model, opt, sched


def state(acc, model, opt, sched):
    return ({k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
            sched.state_dict())


def same(a, b) -> bool:
    (ma, oa, sa), (mb, ob, sb) = a, b
    return (ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
            and oa.keys() == ob.keys() and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])
            and sa == sb)


def seed_rngs(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def draws():
    return [random.random(), float(np.random.rand()), torch.rand(2).tolist()]


def scenario_a(rank: int) -> None:
    config = dict(project_dir=str(OUT / "proj"), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(**config))
    checks["distributed_type"] = str(acc.distributed_type)
    model, opt, sched = prepared(acc, 0, steps=2)
    acc.step = 3
    seed_rngs(100 + rank)
    paths = [fastckpt.accelerate.save_state(acc) for _ in range(3)]
    checks["A_paths"] = [str(p) for p in paths]
    expected, after = state(acc, model, opt, sched), draws()

    acc2 = Accelerator(cpu=True, project_config=ProjectConfiguration(**config))
    model2, opt2, sched2 = prepared(acc2, 7)
    seed_rngs(999)
    fastckpt.accelerate.load_state(acc2)
    checks["A_state_equal"] = same(state(acc2, model2, opt2, sched2), expected)
    checks["A_draws_equal"] = draws() == after
    checks["A_step"] = acc2.step
    checks["A_iteration"] = acc2.project_configuration.iteration


def scenario_b(rank: int) -> None:
    acc = Accelerator(cpu=True)
    model, opt, sched = prepared(acc, 1, steps=2)
    seed_rngs(200 + rank)
    path = fastckpt.accelerate.save_state(acc, OUT / "compat", compat="accelerate")
    expected, after = state(acc, model, opt, sched), draws()
    acc.save_state(str(OUT / "compat_stock"))  # stock output of the same state, for a byte comparison
    dist.barrier()
    acc2 = Accelerator(cpu=True)
    model2, opt2, sched2 = prepared(acc2, 8)
    seed_rngs(999)
    acc2.load_state(str(path))  # stock accelerate, two processes
    checks["B_state_equal"] = same(state(acc2, model2, opt2, sched2), expected)
    checks["B_draws_equal"] = draws() == after


def scenario_c(rank: int) -> None:
    acc = Accelerator(cpu=True)
    model, opt, sched = prepared(acc, 2, steps=2)
    seed_rngs(300 + rank)
    acc.step = 4
    acc.save_state(str(OUT / "stock"))
    expected, after = state(acc, model, opt, sched), draws()
    dist.barrier()  # stock save_state has no barrier at its end
    acc2 = Accelerator(cpu=True)
    model2, opt2, sched2 = prepared(acc2, 9)
    seed_rngs(999)
    fastckpt.accelerate.load_state(acc2, OUT / "stock")
    checks["C_state_equal"] = same(state(acc2, model2, opt2, sched2), expected)
    checks["C_draws_equal"] = draws() == after
    checks["C_step"] = acc2.step


def scenario_d(rank: int) -> None:
    acc = Accelerator(cpu=True)
    if rank == 0:
        shutil.copytree(OUT / "stock", OUT / "broken")
        data = (OUT / "broken" / "random_states_1.pkl").read_bytes()
        (OUT / "broken" / "random_states_1.pkl").write_bytes(data[: len(data) // 2])
    dist.barrier()
    model, opt, sched = prepared(acc, 10)
    before = state(acc, model, opt, sched)
    try:
        fastckpt.accelerate.load_state(acc, OUT / "broken")
        checks["D_error"] = None
    except Exception as exc:  # noqa: BLE001 - the type is the result
        checks["D_error"] = type(exc).__name__
        checks["D_message"] = str(exc)
    checks["D_unchanged"] = same(state(acc, model, opt, sched), before)


def scenario_e(rank: int) -> None:
    acc = Accelerator(cpu=True)
    prepared(acc, 11)
    if rank == 0:
        (OUT / "a_file").write_text("not a folder")
    dist.barrier()
    try:
        fastckpt.accelerate.save_state(acc, OUT / "a_file" / "ckpt")
        checks["E_error"] = None
    except Exception as exc:  # noqa: BLE001 - the type is the result
        checks["E_error"] = type(exc).__name__
    dist.barrier()
    checks["E_group_usable"] = True


def scenario_f(rank: int) -> None:
    acc = Accelerator(cpu=True)
    torch.manual_seed(5)
    model, opt = acc.prepare(nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 8)),
                             torch.optim.AdamW(nn.Linear(1, 1).parameters()))  # replaced below
    inner = acc.unwrap_model(model)
    opt.optimizer.param_groups.clear()
    opt.optimizer.add_param_group({"params": list(inner.parameters()), "lr": 1e-2})
    g = torch.Generator().manual_seed(600 + rank)

    def step() -> None:
        opt.zero_grad()
        acc.backward(model(torch.randn(4, 128, generator=g)).square().mean())
        opt.step()

    step()
    expected = ({k: v.clone() for k, v in inner.state_dict().items()},
                {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()})
    handle = fastckpt.accelerate.save_state(acc, OUT / "async", async_save=True)
    checks["F_handle"] = type(handle).__name__
    for _ in range(3):  # all-reduces on the default group while the writer broadcasts on its own
        step()
    checks["F_path"] = str(handle.wait())
    loaded = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 8))
    fresh = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    fastckpt.load_state(loaded, fresh, input_dir=OUT / "async")
    state = fresh.state_dict()["state"]
    checks["F_state_equal"] = (all(torch.equal(v, expected[0][k]) for k, v in loaded.state_dict().items())
                               and all(torch.equal(state[i][k], expected[1][i][k]) for i in expected[1]
                                       for k in expected[1][i]))
    if rank == 0:
        (OUT / "f_file").write_text("not a folder")
    dist.barrier()
    failing = fastckpt.accelerate.save_state(acc, OUT / "f_file" / "ckpt", async_save=True)
    step()
    try:
        failing.wait()
        checks["F_error"] = None
    except Exception as exc:  # noqa: BLE001 - the type is the result
        checks["F_error"] = type(exc).__name__


def shuffled(seed: int = 3):
    """A fresh accelerator with model, optimizer, scheduler and a shuffled DataLoader, identical in every call."""
    acc = Accelerator(cpu=True)
    model, opt, sched = build(seed)
    data = TensorDataset(torch.arange(32.0).unsqueeze(1).repeat(1, 4))
    torch.manual_seed(42)  # accelerate seeds the sampler's generator from the global RNG at prepare
    model, opt, sched, dl = acc.prepare(model, opt, sched, DataLoader(data, batch_size=4, shuffle=True))
    return acc, model, opt, sched, dl


def one_epoch(acc, model, opt, dl) -> list:
    batches = []
    for (x,) in dl:
        batches.append(x[:, 0].tolist())
        opt.zero_grad()
        acc.backward(model(x).square().mean())
        opt.step()
    return batches


def scenario_g(rank: int) -> None:
    acc, model, opt, sched, dl = shuffled()
    checks["G_epoch0"] = one_epoch(acc, model, opt, dl)
    seed_rngs(400 + rank)
    fastckpt.accelerate.save_state(acc, OUT / "shuffle")
    fastckpt.accelerate.save_state(acc, OUT / "shuffle_compat", compat="accelerate")
    checks["G_draws"] = draws()
    checks["G_epoch1"] = one_epoch(acc, model, opt, dl)
    final = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}

    acc2, model2, opt2, sched2, dl2 = shuffled()
    seed_rngs(999)
    fastckpt.accelerate.load_state(acc2, OUT / "shuffle")  # PYTHONWARNINGS=error: no warning here
    checks["G_resumed_draws"] = draws()
    checks["G_resumed_epoch1"] = one_epoch(acc2, model2, opt2, dl2)
    checks["G_weights_equal"] = all(torch.equal(v, final[k]) for k, v in acc2.unwrap_model(model2).state_dict().items())

    acc3, model3, opt3, sched3, dl3 = shuffled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fastckpt.accelerate.load_state(acc3, OUT / "shuffle_compat")
    checks["G_compat_warnings"] = [str(w.message) for w in caught]


def scenario_h(rank: int) -> None:
    import os

    config = dict(project_dir=os.environ["FASTCKPT_TEST_S3_URL"], automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(**config))
    model, opt, sched = prepared(acc, 0, steps=2)
    acc.step = 3
    seed_rngs(100 + rank)
    checks["H_urls"] = [fastckpt.accelerate.save_state(acc) for _ in range(3)]
    expected, after = state(acc, model, opt, sched), draws()

    acc2 = Accelerator(cpu=True, project_config=ProjectConfiguration(**config))
    model2, opt2, sched2 = prepared(acc2, 7)
    seed_rngs(999)
    fastckpt.accelerate.load_state(acc2)
    checks["H_state_equal"] = same(state(acc2, model2, opt2, sched2), expected)
    checks["H_draws_equal"] = draws() == after
    checks["H_step"] = acc2.step
    checks["H_iteration"] = acc2.project_configuration.iteration


def main() -> None:
    rank = int(dist.get_rank()) if dist.is_initialized() else int(__import__("os").environ.get("RANK", 0))
    try:
        for scenario in (scenario_a, scenario_b, scenario_c, scenario_d, scenario_e, scenario_f, scenario_g, scenario_h):
            scenario(rank)
    except Exception:
        checks["crash"] = traceback.format_exc()
    rank = dist.get_rank() if dist.is_initialized() else rank
    (OUT / f"rank{rank}.json").write_text(json.dumps(checks, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One process of the FSDP2 tests (``torchrun --nproc-per-node W``, gloo, CPU); tests/integrations/test_fsdp.py
launches it once per world size and asserts on what each rank writes to ``OUT/w{W}_rank{r}.json``.

Usage: ``python -m torch.distributed.run --standalone --nproc-per-node W mp_fsdp_worker.py OUT``

Scenarios, for both models (``gpt2``: transformers GPT-2 with tied wte/lm_head; ``tiny``: uneven shards):

- train: 3 FSDP2 steps equal, bit for bit, the same training in one plain process (``train_{kind}``).
- save: full (``OUT/w{W}_{kind}``) and model-only (``OUT/w{W}_{kind}_weights``, and ``..._weights_split`` with
  ``max_shard_size``) sharded saves; the model-only folder loads back on W ranks (``weights_back_{kind}``).
- load: the 2-rank checkpoints (``OUT/w2_{kind}``) into fresh FSDP2 objects: state equal to the saved one, and the
  next step equal to the plain run's 4th (``load_{kind}``); model-only load of the full folder; resharding on W=4.
- model_only: a full load of a model-only folder raises MissingStateError on every rank, nothing changes.
- frozen (C31, issue 27.4): the 2-rank ``tiny`` checkpoint loaded with block 0 frozen since (``requires_grad``
  False): still in the optimizer, its AdamW moments come back exactly (the state and the next step equal the
  one-process reference with the same block frozen: ``frozen_tiny``, ``frozen_tiny_next``); left out of the
  optimizer, ``strict=False`` lists the dropped state in ``LoadResult.skipped`` (``frozen_tiny_skipped``).
- failure: rank 1's RNG file damaged -> HeaderError there, CheckpointError elsewhere; a shape mismatch raises
  ShapeMismatchError on every rank; nothing changes on any rank.
- integrity (W = 2): one flipped byte in a model part file (IntegrityError naming file and tensor on the rank
  reading it, CheckpointError naming it elsewhere), then in every optimizer part file (IntegrityError on every
  rank); nothing changes on any rank.
- plan cache: a resave of an unchanged state reuses the cached DCP plans (no global planning on the coordinator);
  a state with new optimizer state, then a model with other parameter shapes, saved to the same folder, plan
  again and load back bit-exact into fresh objects.
- rotation kinds (W = 2): automatic naming with ``total_limit=1``: model-only snapshots rotate ``model_only/``
  only; the full checkpoint stays (``rotation_left``).
- timeout (W >= 2): rank 1 skips a save; the others raise CollectiveTimeoutError naming it, within ``timeout``;
  when rank 1 then calls it, it raises too (the save was given up), and the next save works on every rank.
- s3 (W = 2, ``FASTCKPT_TEST_S3`` = a fresh ``s3://`` prefix on the test process's moto server): the trained state
  saved in full and model-only to ``{S3}/{kind}`` / ``{S3}/{kind}_weights`` (``_weights_split``) beside the local
  saves (the test process compares them); loaded back on W ranks bit-exact (``s3_load_{kind}``; the objects each
  rank fetched: ``s3_fetched_{kind}``); automatic naming
  with ``total_limit=2`` (``s3_project``); one flipped byte in an object (IntegrityError on every rank, nothing
  changed: ``s3_damaged``); an upload that fails on rank 1 (every rank raises, nothing committed, no object of
  it left, the previous save loads: ``s3_failed``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastckpt  # noqa: E402
from helpers.fsdp_models import (  # noqa: E402
    blocks,
    build,
    diff,
    full_state,
    optimizer_for,
    reference,
    same,
    shard,
    train_step,
)

OUT = Path(sys.argv[1])
S3 = os.environ.get("FASTCKPT_TEST_S3")  # an s3:// prefix on the test process's S3 server (2-process run)
SPLIT = 600  # bytes per model file of the sharded-model-file scenario (several files + the index)
checks: dict[str, object] = {}


def fresh(kind: str, seed: int = 7, **sizes: int):
    model = shard(build(kind, seed, **sizes))
    opt, sched = optimizer_for(model)
    return model, opt, sched


def record(name: str, fn) -> None:
    try:
        checks[name] = fn()
    except Exception as exc:
        checks[name] = {"error": type(exc).__name__, "message": str(exc)[:600]}


def error_of(fn) -> dict[str, str]:
    try:
        fn()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:800]}
    return {"error": None, "message": ""}


def scenario_train_save(kind: str, rank: int, world: int) -> None:
    model, opt, sched = fresh(kind, seed=0)
    for s in range(3):
        train_step(model, opt, sched, s, rank=rank, world=world)
    ref_model, ref_opt, ref_sched = reference(kind, 3)
    got, want = full_state(model, opt), full_state(ref_model, ref_opt)
    checks[f"train_{kind}"] = same(got, want) or diff(got, want)[:5]
    torch.manual_seed(100 + rank)  # each rank's own RNG streams go to random_states_{rank}
    path = fastckpt.save_state(model, opt, sched, output_dir=OUT / f"w{world}_{kind}", step=3)
    checks[f"save_{kind}"] = str(path)
    fastckpt.save_state(model, opt, sched, output_dir=OUT / f"w{world}_{kind}_weights", model_only=True)
    fastckpt.save_state(model, output_dir=OUT / f"w{world}_{kind}_weights_split", model_only=True,
                        max_shard_size=SPLIT)
    if S3 and world == 2:  # the same state to object storage (the RNG streams unchanged since the seed)
        checks[f"s3_save_{kind}"] = error_of(lambda: s3_saves(kind, model, opt, sched))
    # the model-only folder loads back on this world size too (full files -> each rank's shard)
    m2, _, _ = fresh(kind, seed=5)
    result = fastckpt.load_state(m2, input_dir=OUT / f"w{world}_{kind}_weights", model_only=True)
    checks[f"weights_back_{kind}"] = (same(full_state(m2, None), full_state(model, None))
                                      and [result.missing_keys, result.unexpected_keys] == [[], []])
    train_step(model, opt, sched, 3, rank=rank, world=world)
    ref4 = reference(kind, 4)
    checks[f"next_{kind}"] = same(full_state(model, opt), full_state(ref4[0], ref4[1]))


def s3_saves(kind: str, model, opt, sched) -> None:
    url = fastckpt.save_state(model, opt, sched, output_dir=f"{S3}/{kind}", step=3)
    assert url == f"{S3}/{kind}", url
    fastckpt.save_state(model, output_dir=f"{S3}/{kind}_weights", model_only=True)
    fastckpt.save_state(model, output_dir=f"{S3}/{kind}_weights_split", model_only=True, max_shard_size=SPLIT)


def scenario_s3(rank: int, world: int) -> None:
    """Loads of the s3 saves on W ranks, automatic naming, a damaged object, a save that fails on rank 1."""
    from fastckpt._io.storage.object.fetch import RemoteCheckpoint

    real_fetch, fetched = RemoteCheckpoint.fetch, []

    def recording_fetch(self, names):  # which objects this rank reads
        fetched.extend(sorted(set(names) - set(self.fetched)))
        return real_fetch(self, names)

    for kind in ("gpt2", "tiny"):
        model, opt, sched = fresh(kind)
        fetched.clear()
        RemoteCheckpoint.fetch = recording_fetch
        try:
            result = fastckpt.load_state(model, opt, sched, input_dir=f"{S3}/{kind}")
        finally:
            RemoteCheckpoint.fetch = real_fetch
        checks[f"s3_fetched_{kind}"] = sorted(fetched)
        rng = torch.get_rng_state()  # before reference() reseeds
        ref_model, ref_opt, ref_sched = reference(kind, 3)
        got, want = full_state(model, opt), full_state(ref_model, ref_opt)
        checks[f"s3_load_{kind}"] = {
            "same": same(got, want) or diff(got, want)[:5], "result": [result.missing_keys, result.unexpected_keys],
            "sched": sched.state_dict() == ref_sched.state_dict(),
            "rng": torch.equal(rng, torch.Generator().manual_seed(100 + rank).get_state())}
        weights, _, _ = fresh(kind, seed=5)
        fastckpt.load_state(weights, input_dir=f"{S3}/{kind}_weights", model_only=True)
        checks[f"s3_weights_{kind}"] = same(full_state(weights, None), full_state(ref_model, None))

    model, opt, sched = fresh("tiny")  # automatic naming: checkpoint_0, 1, 2, the oldest rotated away
    saved = []
    for s in range(3):
        train_step(model, opt, sched, s, rank=rank, world=world)
        saved.append(fastckpt.save_state(model, opt, sched, project_dir=f"{S3}/project", total_limit=2, step=s))
    want = full_state(model, opt)
    m2, o2, s2 = fresh("tiny")
    fastckpt.load_state(m2, o2, s2, project_dir=f"{S3}/project")
    checks["s3_project"] = {"urls": saved, "latest": fastckpt.latest_checkpoint(f"{S3}/project"),
                            "same": same(full_state(m2, o2), want)}

    fastckpt.save_state(model, opt, sched, output_dir=f"{S3}/tiny_bad")  # one byte of rank 0's model object flipped
    if rank == 0:
        from helpers.s3_server import BUCKET, client, key_prefix, keys

        key = next(k for k in keys(key_prefix(f"{S3}/tiny_bad")) if k.endswith("/model/shard-00000-of-00002.safetensors"))
        data = bytearray(client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
        data[-3] ^= 0x10
        client().put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
        checks["s3_damaged_key"] = key
    dist.barrier()
    fresh_model, fresh_opt, fresh_sched = fresh("tiny", seed=3)
    train_step(fresh_model, fresh_opt, fresh_sched, 0, rank=rank, world=world)
    before = (full_state(fresh_model, fresh_opt), fresh_sched.state_dict(), torch.get_rng_state())
    checks["s3_damaged"] = error_of(lambda: fastckpt.load_state(fresh_model, fresh_opt, fresh_sched,
                                                                input_dir=f"{S3}/tiny_bad"))
    checks["s3_damaged_unchanged"] = (same(full_state(fresh_model, fresh_opt), before[0])
                                      and fresh_sched.state_dict() == before[1]
                                      and torch.equal(torch.get_rng_state(), before[2]))

    fastckpt.save_state(model, opt, sched, output_dir=f"{S3}/tiny_fail")  # then a save whose upload fails on rank 1
    committed = full_state(model, opt)
    train_step(model, opt, sched, 3, rank=rank, world=world)
    import fastckpt.dcp.writer as writer

    real = writer.upload_tensor_objects

    def failing(*args, **kwargs):
        raise OSError("injected upload failure on process 1")

    if rank == 1:
        writer.upload_tensor_objects = failing
    try:
        checks["s3_failed"] = error_of(lambda: fastckpt.save_state(model, opt, sched, output_dir=f"{S3}/tiny_fail"))
    finally:
        writer.upload_tensor_objects = real
    dist.barrier()
    m3, o3, sched3 = fresh("tiny")
    fastckpt.load_state(m3, o3, sched3, input_dir=f"{S3}/tiny_fail")
    checks["s3_failed_previous_loads"] = same(full_state(m3, o3), committed)


def scenario_load(kind: str, rank: int, world: int) -> None:
    src = OUT / f"w2_{kind}"
    model, opt, sched = fresh(kind)
    rng_before = torch.get_rng_state()
    result = fastckpt.load_state(model, opt, sched, input_dir=src)
    if rank < 2:  # the saving run had ranks 0 and 1: their RNG streams come back; ranks 2, 3 keep theirs
        checks[f"load_{kind}_rng"] = torch.equal(torch.get_rng_state(),
                                                 torch.Generator().manual_seed(100 + rank).get_state())
    else:
        checks[f"load_{kind}_rng"] = torch.equal(torch.get_rng_state(), rng_before)
    ref_model, ref_opt, ref_sched = reference(kind, 3)
    got, want = full_state(model, opt), full_state(ref_model, ref_opt)
    checks[f"load_{kind}"] = same(got, want) or diff(got, want)[:5]
    checks[f"load_{kind}_result"] = [result.missing_keys, result.unexpected_keys]
    checks[f"load_{kind}_sched"] = sched.state_dict() == ref_sched.state_dict()
    train_step(model, opt, sched, 3, rank=rank, world=world)
    ref4 = reference(kind, 4)
    checks[f"load_{kind}_next"] = same(full_state(model, opt), full_state(ref4[0], ref4[1]))
    # weights only, from the full folder and from the model-only one
    for name, folder in (("full", src), ("weights", OUT / f"w2_{kind}_weights")):
        m2, o2, _ = fresh(kind)
        fastckpt.load_state(m2, input_dir=folder, model_only=True)
        checks[f"load_{kind}_model_only_{name}"] = same(full_state(m2, None), full_state(ref_model, None))


def scenario_frozen(rank: int, world: int) -> None:
    src = OUT / "w2_tiny"
    model, opt, sched = fresh("tiny")
    blocks(model)[0].requires_grad_(False)  # frozen since the save; still in the optimizer's param_groups
    result = fastckpt.load_state(model, opt, sched, input_dir=src)
    ref_model, ref_opt, ref_sched = reference("tiny", 3)
    blocks(ref_model)[0].requires_grad_(False)
    got, want = full_state(model, opt), full_state(ref_model, ref_opt)
    checks["frozen_tiny"] = same(got, want) or diff(got, want)[:5]
    checks["frozen_tiny_result"] = [result.missing_keys, result.unexpected_keys, result.skipped]
    train_step(model, opt, sched, 3, rank=rank, world=world)
    train_step(ref_model, ref_opt, ref_sched, 3)
    got, want = full_state(model, opt), full_state(ref_model, ref_opt)
    checks["frozen_tiny_next"] = same(got, want) or diff(got, want)[:5]
    # left out of the optimizer: strict refuses, strict=False applies the rest and lists what it dropped
    model, _, _ = fresh("tiny")
    blocks(model)[0].requires_grad_(False)
    trainable = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    checks["frozen_tiny_strict"] = error_of(lambda: fastckpt.load_state(model, trainable, input_dir=src))
    result = fastckpt.load_state(model, trainable, input_dir=src, strict=False)
    checks["frozen_tiny_skipped"] = result.skipped
    ref = reference("tiny", 3)
    want = {k: v for k, v in full_state(ref[0], ref[1]).items() if not k.startswith("optim.blocks.0.")}
    checks["frozen_tiny_rest"] = same(full_state(model, trainable), want)


def scenario_model_only_rules(rank: int) -> None:
    model, opt, sched = fresh("tiny")
    before = full_state(model, opt)
    checks["model_only_full_load"] = error_of(
        lambda: fastckpt.load_state(model, opt, sched, input_dir=OUT / "w2_tiny_weights"))
    checks["model_only_unchanged"] = same(full_state(model, opt), before) and not opt.state


def scenario_failures(rank: int, world: int) -> None:
    src = OUT / "w2_tiny"
    bad = OUT / f"w{world}_tiny_bad_rng"
    if rank == 0:  # a copy whose random_states_1 is damaged (only rank 1 reads it)
        shutil.copytree(src, bad, copy_function=os.link)  # hard links: the source files are never modified
        name = bad / "random_states_1.safetensors"
        data = bytearray(name.read_bytes())
        name.unlink()
        data[0:8] = (2**40).to_bytes(8, "little")
        name.write_bytes(bytes(data))
    dist.barrier()
    model, opt, sched = fresh("tiny")
    before = (full_state(model, opt), sched.state_dict(), torch.get_rng_state())
    checks["bad_rng"] = error_of(lambda: fastckpt.load_state(model, opt, sched, input_dir=bad))
    checks["bad_rng_unchanged"] = (same(full_state(model, opt), before[0]) and not opt.state
                                   and sched.state_dict() == before[1] and torch.equal(torch.get_rng_state(), before[2]))
    wide, wopt, wsched = fresh("tiny", dim=14)
    before = full_state(wide, wopt)
    checks["shape"] = error_of(lambda: fastckpt.load_state(wide, wopt, wsched, input_dir=src))
    checks["shape_unchanged"] = same(full_state(wide, wopt), before) and not wopt.state


def counted_rounds(fn) -> dict[str, int]:
    """Collective rounds ``fn()`` makes on this rank: fastckpt's store steps, torch.distributed object collectives."""
    from fastckpt._io.group.distributed import Session

    counts = {"store steps": 0, "collectives": 0}
    saved = {name: getattr(dist, name) for name in ("gather_object", "scatter_object_list", "broadcast_object_list",
                                                    "all_gather_object", "barrier", "all_reduce")}
    steps = {name: getattr(Session, name) for name in ("gather", "broadcast")}

    def wrap_collective(f):
        def call(*args, **kwargs):
            counts["collectives"] += 1
            return f(*args, **kwargs)
        return call

    def wrap_step(f):
        def call(self, *args, **kwargs):
            counts["store steps"] += self.active
            return f(self, *args, **kwargs)
        return call

    try:
        for name, f in saved.items():
            setattr(dist, name, wrap_collective(f))
        for name, f in steps.items():
            setattr(Session, name, wrap_step(f))
        fn()
    finally:
        for name, f in saved.items():
            setattr(dist, name, f)
        for name, f in steps.items():
            setattr(Session, name, f)
    return counts


def scenario_rounds(rank: int, world: int) -> None:
    model, opt, sched = fresh("tiny")
    target = OUT / f"w{world}_rounds"
    checks["rounds_save"] = counted_rounds(lambda: fastckpt.save_state(model, opt, sched, output_dir=target))
    checks["rounds_resave"] = counted_rounds(lambda: fastckpt.save_state(model, opt, sched, output_dir=target))
    checks["rounds_load"] = counted_rounds(lambda: fastckpt.load_state(model, opt, sched, input_dir=target))


def _flip_tensor(path: Path, at: int = 3) -> str:
    """Flip one bit of byte ``at`` of the first non-empty tensor of the safetensors file ``path``; its name."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name, info = next((k, v) for k, v in header.items() if k != "__metadata__" and v["data_offsets"][1] > at)
    data[8 + n + info["data_offsets"][0] + at] ^= 0x10
    path.unlink()  # the copy is hard-linked to the source: replace the file, never change the source
    path.write_bytes(bytes(data))
    return name


def scenario_integrity(rank: int, world: int) -> None:
    """One flipped byte in the model part file rank 0 reads (rank 0: IntegrityError naming file and tensor; rank 1:
    CheckpointError naming rank 0's IntegrityError), then one in each rank's optimizer part file (IntegrityError on
    every rank); the live model and optimizer (which holds state) stay bit-identical every time."""
    src = OUT / f"w{world}_tiny"
    for case, part, ranks in (("model", "model", [0]), ("optimizer", "optimizer", list(range(world)))):
        bad = OUT / f"w{world}_tiny_bad_{case}"
        if rank == 0:
            shutil.copytree(src, bad, copy_function=os.link)
            names = [_flip_tensor(bad / part / f"shard-{r:05d}-of-{world:05d}.safetensors") for r in ranks]
            (OUT / f"w{world}_bad_{case}.json").write_text(json.dumps(names))
        dist.barrier()
        model, opt, sched = fresh("tiny")
        train_step(model, opt, sched, 0, rank=rank, world=world)
        before = full_state(model, opt)
        checks[f"integrity_{case}"] = error_of(
            lambda m=model, o=opt, s=sched, d=bad: fastckpt.load_state(m, o, s, input_dir=d))
        checks[f"integrity_{case}_tensors"] = json.loads((OUT / f"w{world}_bad_{case}.json").read_text())
        checks[f"integrity_{case}_unchanged"] = same(full_state(model, opt), before)
        fastckpt.load_state(model, opt, sched, input_dir=src)  # the intact folder still loads
        checks[f"integrity_{case}_intact_loads"] = not same(full_state(model, opt), before)


def planned(fn) -> tuple[int, int]:
    """``(global plans, planning rounds)`` during ``fn()``: how many times the coordinator's DCP global planning
    (dedup, merge, validation) ran, and how many DCP planning rounds (gather + scatter of plans) this rank joined."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    from fastckpt.dcp import SavePlanner  # its _create_global_plan: DCP's global plan over columns

    real, real_round = SavePlanner._create_global_plan, _DistWrapper.reduce_scatter
    calls, rounds = [], []

    def counting(self, all_plans):
        calls.append(1)
        return real(self, all_plans)

    def counting_round(self, step, *args, **kwargs):
        rounds.append(step)
        return real_round(self, step, *args, **kwargs)

    SavePlanner._create_global_plan = counting
    _DistWrapper.reduce_scatter = counting_round
    try:
        fn()
    finally:
        SavePlanner._create_global_plan = real
        _DistWrapper.reduce_scatter = real_round
    return len(calls), rounds.count("plan")


def scenario_plan_cache(rank: int, world: int) -> None:
    target = OUT / f"w{world}_plan_cache"
    model, opt, sched = fresh("tiny")

    def save_and_load_back(m, o, s, **sizes) -> object:
        n, rounds = planned(lambda: fastckpt.save_state(m, o, s, output_dir=target))
        m2, o2, s2 = fresh("tiny", seed=99, **sizes)
        train_step(m2, o2, s2, 0, rank=rank, world=world)  # other values, same structure as the saved state
        fastckpt.load_state(m2, o2, s2, input_dir=target)
        got, want = full_state(m2, o2), full_state(m, o)
        return {"planned": n, "rounds": rounds, "same": same(got, want) or diff(got, want)[:5]}

    checks["cache_first"] = save_and_load_back(model, opt, sched)  # no optimizer state yet
    n, rounds = planned(lambda: fastckpt.save_state(model, opt, sched, output_dir=target))
    checks["cache_unchanged"] = {"planned": n, "rounds": rounds}
    train_step(model, opt, sched, 0, rank=rank, world=world)  # AdamW's exp_avg, exp_avg_sq, step appear
    checks["cache_new_optimizer_state"] = save_and_load_back(model, opt, sched)
    train_step(model, opt, sched, 1, rank=rank, world=world)  # new values, same plans
    checks["cache_new_values"] = save_and_load_back(model, opt, sched)
    other, other_opt, other_sched = fresh("tiny", dim=17, hidden=5)
    train_step(other, other_opt, other_sched, 0, rank=rank, world=world)
    checks["cache_new_shapes"] = save_and_load_back(other, other_opt, other_sched, dim=17, hidden=5)


def scenario_read_once(rank: int, world: int) -> None:
    """``w{world}_tiny`` (this run's save after 3 steps) loaded with boxes read once per replica group (default:
    AdamW's replicated ``step`` of every parameter, the unsharded ``scale`` buffer) and with every rank reading its
    own (the coordinator's share step skipped): both equal the one-process reference; bytes read per rank."""
    import fastckpt.dcp

    counted = {"read": 0, "received": 0}
    real_read = fastckpt.dcp.StorageReader.read_data

    def counting(self, plan, planner):
        before = (self.read_bytes, self.received_bytes)
        out = real_read(self, plan, planner)
        counted["read"] += self.read_bytes - before[0]
        counted["received"] += self.received_bytes - before[1]
        return out

    real_share = fastckpt.dcp.StorageReader.prepare_global_plan
    fastckpt.dcp.StorageReader.read_data = counting
    ref_model, ref_opt, _ = reference("tiny", 3)
    try:
        for once in (True, False):
            if not once:
                fastckpt.dcp.StorageReader.prepare_global_plan = lambda self, plans: plans
            counted.update(read=0, received=0)
            model, opt, sched = fresh("tiny")
            fastckpt.load_state(model, opt, sched, input_dir=OUT / f"w{world}_tiny")
            got, want = full_state(model, opt), full_state(ref_model, ref_opt)
            checks[f"read_once_{once}"] = {"same": same(got, want) or diff(got, want)[:5], **counted}
    finally:
        fastckpt.dcp.StorageReader.read_data = real_read
        fastckpt.dcp.StorageReader.prepare_global_plan = real_share


def scenario_timeout(rank: int, world: int) -> None:
    model, opt, sched = fresh("tiny")
    target = OUT / f"w{world}_timeout"
    if rank != 1:
        checks["timeout"] = error_of(lambda: fastckpt.save_state(model, opt, sched, output_dir=target, timeout=3))
    dist.barrier()  # rank 1 arrives after the others gave up
    if rank == 1:
        checks["timeout"] = error_of(lambda: fastckpt.save_state(model, opt, sched, output_dir=target, timeout=3))
    checks["timeout_nothing_written"] = not target.exists()
    path = fastckpt.save_state(model, opt, sched, output_dir=target, timeout=30)
    checks["timeout_then_saved"] = (path / "fastckpt.json").is_file()


def scenario_rotation_kinds(rank: int, world: int) -> None:
    """Automatic naming with ``total_limit=1``: sharded model-only snapshots rotate ``model_only/`` and leave the
    full checkpoint in ``checkpoints/`` alone, as a one-process save does."""
    model, opt, sched = fresh("tiny")
    project = OUT / f"w{world}_rotation"
    fastckpt.save_state(model, opt, sched, project_dir=project, total_limit=1)
    for _ in range(2):
        fastckpt.save_state(model, project_dir=project, model_only=True, total_limit=1)
    dist.barrier()
    checks["rotation_left"] = sorted(f"{kind}/{p.name}" for kind in ("checkpoints", "model_only")
                                     for p in (project / kind).iterdir() if not p.name.startswith("."))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for kind in ("gpt2", "tiny"):
            record(f"scenario_save_{kind}", lambda kind=kind: scenario_train_save(kind, rank, world))
            if world != 2:
                record(f"scenario_load_{kind}", lambda kind=kind: scenario_load(kind, rank, world))
        record("scenario_frozen", lambda: scenario_frozen(rank, world))
        if world != 2:
            record("scenario_model_only", lambda: scenario_model_only_rules(rank))
            record("scenario_failures", lambda: scenario_failures(rank, world))
        record("scenario_rounds", lambda: scenario_rounds(rank, world))
        record("scenario_plan_cache", lambda: scenario_plan_cache(rank, world))
        record("scenario_read_once", lambda: scenario_read_once(rank, world))
        if world >= 2:
            record("scenario_timeout", lambda: scenario_timeout(rank, world))
        if world == 2:
            record("scenario_integrity", lambda: scenario_integrity(rank, world))
            record("scenario_rotation_kinds", lambda: scenario_rotation_kinds(rank, world))
        if world == 2 and S3:
            record("scenario_s3", lambda: scenario_s3(rank, world))
    except Exception:
        checks["crash"] = traceback.format_exc()
    (OUT / f"w{world}_rank{rank}.json").write_text(json.dumps(checks, indent=1, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

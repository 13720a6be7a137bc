"""FSDP2 / DTensor states through ``fastckpt.save_state`` / ``load_state``: real processes (torchrun, gloo, CPU), a
tiny transformers GPT-2 (tied wte / lm_head) and a GPT-like model with uneven shards, ``fully_shard`` per block.

Each world size starts once (tests/helpers/mp_fsdp_worker.py runs every scenario inside it): 2 processes train,
save (full and model-only) and check timeouts; 4 processes train and save too, load the 2-process checkpoints
(resharding), check the model-only rules and that a failure on one rank changes nothing anywhere; 1 process (this
one, no process group) loads both into plain models. Every comparison is bit-exact against the same training in one
plain process (tests/helpers/fsdp_models.py explains why FSDP2 training is bit-identical to it here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from helpers.fsdp_models import build, full_state, optimizer_for, reference, same, train_step

import fastckpt

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "mp_fsdp_worker.py"
KINDS = ("gpt2", "tiny")


def _launch(out: Path, world: int, **extra: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **extra)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=300)
    files = [out / f"w{world}_rank{r}.json" for r in range(world)]
    assert proc.returncode == 0 and all(f.is_file() for f in files), proc.stdout[-3000:] + proc.stderr[-6000:]
    results = [json.loads(f.read_text()) for f in files]
    crashes = [f"rank {r}: {res['crash']}" for r, res in enumerate(results) if "crash" in res]
    assert not crashes, "\n".join(crashes)
    failed = {f"rank {r}: {k}": v for r, res in enumerate(results) for k, v in res.items()
              if k.startswith("scenario_") and v is not None}
    assert not failed, failed
    return results


@pytest.fixture(scope="module")
def s3_prefix(s3_endpoint):
    """The ``s3://`` prefix the 2-process run saves under (the session's moto server; AWS_* reach the workers)."""
    import uuid

    from helpers.s3_server import BUCKET

    return f"s3://{BUCKET}/fsdp-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, s3_prefix):
    out = tmp_path_factory.mktemp("fsdp")
    two = _launch(out, 2, FASTCKPT_TEST_S3=s3_prefix)
    four = _launch(out, 4)  # loads the 2-process checkpoints
    return out, {2: two, 4: four}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference runs used one thread: same kernels, same bits
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_training_is_bit_exact_to_one_process(runs, world, kind):
    _, results = runs
    for rank, res in enumerate(results[world]):
        assert res[f"train_{kind}"] is True, (rank, res[f"train_{kind}"])
        assert res[f"next_{kind}"] is True, rank


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_folder_layout(runs, kind):
    out, _ = runs
    folder = out / f"w2_{kind}"
    names = {p.name for p in folder.iterdir()}
    assert {"fastckpt.json", "optimizer.json", "scheduler.json", "random_states_0.safetensors",
            "random_states_1.safetensors"} <= names
    manifest = json.loads((folder / "fastckpt.json").read_text())
    assert manifest["mode"] == "full" and manifest["processes"] == 2 and manifest["step"] == 3
    assert manifest["sharded"]["storage"] == "fastckpt.dcp" and manifest["sharded"]["world_size"] == 2
    assert manifest["sharded"]["parts"] == ["model", "optimizer"]
    assert set(manifest["files"]) == names - {"fastckpt.json", "model", "optimizer"}
    # each part is a fastckpt.dcp folder: one safetensors file per rank + the JSON metadata, listed with sizes
    for part in ("model", "optimizer"):
        listed = {n.split("/", 1)[1] for n in manifest["sharded"]["files"] if n.startswith(part + "/")}
        assert listed == {p.name for p in (folder / part).iterdir()}
        assert {"shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"} <= listed
    stored = set(st.load_file(folder / "model" / "shard-00000-of-00002.safetensors"))
    assert not any(k.startswith("model.") for k in stored)  # the model part is keyed by fqn
    if kind == "gpt2":  # the tie is found per parameter and stored once
        assert manifest["sharded"]["aliases"] == [{"lm_head.weight": "transformer.wte.weight"}]
        assert "config.json" in names
    for rank in (0, 1):  # each rank's own streams (seeded 100 + rank before the save)
        assert torch.equal(st.load_file(folder / f"random_states_{rank}.safetensors")["torch"],
                           torch.Generator().manual_seed(100 + rank).get_state())


@pytest.mark.parametrize("kind", KINDS)
def test_two_process_checkpoint_reshards_onto_four(runs, kind):
    _, results = runs
    for rank, res in enumerate(results[4]):
        assert res[f"load_{kind}"] is True, (rank, res[f"load_{kind}"])
        assert res[f"load_{kind}_result"] == [[], []]
        assert res[f"load_{kind}_sched"] is True and res[f"load_{kind}_next"] is True, rank
        assert res[f"load_{kind}_rng"] is True, rank
        assert res[f"load_{kind}_model_only_full"] is True and res[f"load_{kind}_model_only_weights"] is True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_load_into_a_plain_model_in_one_process(runs, one_thread, world, kind):
    out, _ = runs
    model = build(kind, 9)
    opt, sched = optimizer_for(model)
    unrestored = ", ".join(f"random_states_{r}.safetensors" for r in range(1, world))
    with pytest.warns(fastckpt.RngRestoreWarning, match=rf"saved by {world} processes, resumed by 1.*\({unrestored}\)"):
        result = fastckpt.load_state(model, opt, sched, input_dir=out / f"w{world}_{kind}")
    assert result == ([], [])
    ref_model, ref_opt, ref_sched = reference(kind, 3)
    assert same(full_state(model, opt), full_state(ref_model, ref_opt))
    assert sched.state_dict() == ref_sched.state_dict()
    train_step(model, opt, sched, 3)
    train_step(ref_model, ref_opt, ref_sched, 3)
    assert same(full_state(model, opt), full_state(ref_model, ref_opt))
    weights = build(kind, 11)
    fastckpt.load_state(weights, input_dir=out / f"w{world}_{kind}_weights", model_only=True)
    assert same(full_state(weights, None), full_state(reference(kind, 3)[0], None))


def test_full_load_of_model_only_folder_refused_everywhere(runs, one_thread):
    out, results = runs
    for res in results[4]:
        assert res["model_only_full_load"]["error"] == "MissingStateError"
        assert "saved with model_only=True" in res["model_only_full_load"]["message"]
        assert res["model_only_unchanged"] is True
    model = build("tiny", 3)
    opt, sched = optimizer_for(model)
    before = full_state(model, None)
    with pytest.raises(fastckpt.MissingStateError, match="model_only=True"):
        fastckpt.load_state(model, opt, sched, input_dir=out / "w2_tiny_weights")
    assert same(full_state(model, None), before) and not opt.state


def test_failure_on_one_rank_changes_nothing_anywhere(runs):
    _, results = runs
    for rank, res in enumerate(results[4]):
        if rank == 1:
            assert res["bad_rng"]["error"] == "HeaderError" and "random_states_1" in res["bad_rng"]["message"]
        else:
            assert res["bad_rng"]["error"] == "CheckpointError", res["bad_rng"]
            assert "failed on process 1: HeaderError" in res["bad_rng"]["message"]
        assert res["bad_rng_unchanged"] is True, rank
        assert res["shape"]["error"] == "ShapeMismatchError" and "[37, 13]" in res["shape"]["message"]
        assert res["shape_unchanged"] is True, rank


def test_a_flipped_byte_in_a_part_file_is_refused_on_every_rank_and_changes_nothing(runs):
    out, results = runs
    for rank, res in enumerate(results[2]):
        (model_tensor,) = res["integrity_model_tensors"]
        shard0 = out / "w2_tiny_bad_model" / "model" / "shard-00000-of-00002.safetensors"
        named = f'{shard0}: tensor "{model_tensor}": crc32c '
        got = res["integrity_model"]
        if rank == 0 or got["error"] == "IntegrityError":  # every rank that reads the damaged chunk finds it itself
            assert got["error"] == "IntegrityError" and got["message"].startswith(named), got
        else:
            assert got["error"] == "CheckpointError", got
            assert f"failed on process 0: IntegrityError: {named}" in got["message"]
        own = out / "w2_tiny_bad_optimizer" / "optimizer" / f"shard-{rank:05d}-of-00002.safetensors"
        tensor = res["integrity_optimizer_tensors"][rank]
        assert res["integrity_optimizer"]["error"] == "IntegrityError", res["integrity_optimizer"]
        assert res["integrity_optimizer"]["message"].startswith(f'{own}: tensor "{tensor}": crc32c ')
        for case in ("model", "optimizer"):
            assert res[f"integrity_{case}_unchanged"] is True, (rank, case)
            assert res[f"integrity_{case}_intact_loads"] is True, (rank, case)


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_never_calls_makes_the_others_raise(runs, world):
    _, results = runs
    for rank, res in enumerate(results[world]):
        assert res["timeout"]["error"] == "CollectiveTimeoutError", (rank, res["timeout"])
        assert "waited 3 s at step 'arrive' for process(es) [1]" in res["timeout"]["message"], rank
        assert res["timeout_nothing_written"] is True and res["timeout_then_saved"] is True, rank
    assert "given up before this process arrived" in results[world][1]["timeout"]["message"]


def test_sharded_model_only_snapshots_rotate_their_own_kind(runs):
    """total_limit=1 with automatic naming: two sharded model-only snapshots leave the newest of them and the full
    checkpoint (the rotation of model_only/ never reaches checkpoints/)."""
    _, results = runs
    for res in results[2]:
        assert res["rotation_left"] == ["checkpoints/checkpoint_0", "model_only/checkpoint_1"], res["rotation_left"]


def test_consolidate_gives_a_hugging_face_folder(runs, one_thread, tmp_path):
    out, _ = runs
    from transformers import GPT2LMHeadModel

    proc = subprocess.run([sys.executable, "-m", "fastckpt", "consolidate", str(out / "w2_gpt2"), str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert same(full_state(model, None), full_state(reference("gpt2", 3)[0], None))


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_model_only_save_is_the_one_process_folder(runs, one_thread, tmp_path, kind, world, split):
    """An FSDP2 model-only save writes the files a one-process model-only save of the same full model writes, byte
    for byte (model.safetensors, or HF shards + index), and no DCP part; the manifest reads the same."""
    out, results = runs
    suffix = "_weights_split" if split else "_weights"
    folder = out / f"w{world}_{kind}{suffix}"
    ref_model = reference(kind, 3)[0]
    ref = fastckpt.save_state(ref_model, output_dir=tmp_path / "ref", model_only=True,
                              max_shard_size=600 if split else None)
    names = {p.name for p in folder.iterdir()}
    assert names == {p.name for p in ref.iterdir()}
    assert (len([n for n in names if n.endswith(".safetensors")]) > 1) == split
    assert ("model.safetensors.index.json" in names) == split
    for name in names - {"fastckpt.json"}:
        assert (folder / name).read_bytes() == (ref / name).read_bytes(), name
    got, want = (json.loads((f / "fastckpt.json").read_text()) for f in (folder, ref))
    assert "sharded" not in got and got["mode"] == "model_only"
    drop = ("fastckpt_version",)
    assert {k: v for k, v in got.items() if k not in drop} == {k: v for k, v in want.items() if k not in drop}
    fastckpt.verify_checkpoint(folder)  # every file with its recorded checksums
    for rank, res in enumerate(results[world]):
        assert res[f"weights_back_{kind}"] is True, rank
    from fastckpt.cli import main  # issue 27 item 8: consolidate says it is a model folder already

    with pytest.raises(fastckpt.MissingStateError, match=rf"^{folder}: already a model folder \(model.safetensors"
                                                         rf"{'.index.json' if split else ''}\), not a DCP checkpoint"):
        from fastckpt._io.dcp.consolidate import consolidate

        consolidate(folder, tmp_path / "hf", max_shard_size=None)
    assert main(["consolidate", str(folder), str(tmp_path / "hf")]) == 2


@pytest.mark.parametrize("world", [2, 4])
def test_from_pretrained_reads_the_fsdp2_model_only_save(runs, one_thread, world):
    from transformers import GPT2LMHeadModel

    out, _ = runs
    model = GPT2LMHeadModel.from_pretrained(out / f"w{world}_gpt2_weights")
    assert same(full_state(model, None), full_state(reference("gpt2", 3)[0], None))
    split = GPT2LMHeadModel.from_pretrained(out / f"w{world}_gpt2_weights_split")
    assert same(full_state(split, None), full_state(reference("gpt2", 3)[0], None))


def test_convert_to_hf_model_consolidates_a_sharded_checkpoint(runs, one_thread, tmp_path):
    """``fastckpt convert --to hf-model`` of an FSDP2 checkpoint writes the one-process model file, byte for byte
    (ties recorded as the one-process save records them); the other targets name what to use instead."""
    out, _ = runs
    from transformers import GPT2LMHeadModel

    proc = subprocess.run([sys.executable, "-m", "fastckpt", "convert", str(out / "w2_gpt2"), str(tmp_path / "hf"),
                           "--to", "hf-model"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ref = fastckpt.save_state(reference("gpt2", 3)[0], output_dir=tmp_path / "ref", model_only=True)
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    assert (tmp_path / "hf" / "config.json").read_bytes() == (ref / "config.json").read_bytes()
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert same(full_state(model, None), full_state(reference("gpt2", 3)[0], None))
    proc = subprocess.run([sys.executable, "-m", "fastckpt", "convert", str(out / "w2_gpt2"), str(tmp_path / "fc"),
                           "--to", "fastckpt"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "MissingStateError" in proc.stderr and "fastckpt consolidate" in proc.stderr
    assert not (tmp_path / "fc").exists()


def test_collective_rounds_do_not_grow_with_the_world_size(runs):
    """Planning that scales (accelerate#4099): a sharded save and load make the same number of collective rounds
    on 2 and on 4 processes, on every rank; a load makes one round of its own to agree, DCP's to read."""
    _, results = runs
    for op in ("rounds_save", "rounds_resave", "rounds_load"):
        counts = [res[op] for w in (2, 4) for res in results[w]]
        assert all(c == counts[0] for c in counts), (op, counts)
    load = results[2][0]["rounds_load"]
    assert load["store steps"] == 2, load  # validate: gather + broadcast; no arrive or read steps of its own


def test_an_unchanged_state_reuses_the_cached_plan_and_a_changed_one_is_planned_again(runs):
    """Plan caching (issue 20.2, 28): the resave of an unchanged state runs no planning round on any rank; new
    optimizer state and new parameter shapes are planned again, and every save loads back bit-exact."""
    _, results = runs
    for w in (2, 4):
        for rank, res in enumerate(results[w]):
            assert res["scenario_plan_cache"] is None, (w, rank, res["scenario_plan_cache"])
            for name in ("cache_first", "cache_new_optimizer_state", "cache_new_values", "cache_new_shapes"):
                assert res[name]["same"] is True, (w, rank, name, res[name])
        # no planning round at all when every rank's plans are the cached ones (the agreement rides on the save's
        # own "state" round); a part whose plans changed anywhere runs DCP's planning round again
        for rank, res in enumerate(results[w]):
            assert res["cache_unchanged"]["rounds"] == 0 and res["cache_new_values"]["rounds"] == 0, (w, rank, res)
            assert res["cache_new_optimizer_state"]["rounds"] >= 1, (w, rank, res)  # (the first save's plans may
            assert res["cache_new_shapes"]["rounds"] >= 1, (w, rank, res)  # be cached by an earlier scenario's)
        coordinator = results[w][0]
        assert coordinator["cache_unchanged"]["planned"] == 0, coordinator["cache_unchanged"]
        assert coordinator["cache_new_values"]["planned"] == 0, coordinator["cache_new_values"]
        for name in ("cache_new_optimizer_state", "cache_new_shapes"):
            assert coordinator[name]["planned"] >= 1, (name, coordinator[name])


def test_replicated_values_are_read_once_per_replica_group(runs):
    """A 2- and 4-process FSDP2 load: AdamW's ``step`` (replicated on every rank) and the tiny model's unsharded
    buffer are read by one rank and sent to the others; the ranks read fewer bytes in total than when each reads
    its own, and both loads equal the one-process reference bit for bit."""
    _, results = runs
    for w in (2, 4):
        once = [res["read_once_True"] for res in results[w]]
        each = [res["read_once_False"] for res in results[w]]
        assert all(r["same"] is True for r in once + each), (w, once, each)
        assert sum(r["received"] for r in once) > 0 and sum(r["received"] for r in each) == 0, (w, once, each)
        assert sum(r["read"] for r in once) < sum(r["read"] for r in each), (w, once, each)
        assert sum(r["read"] + r["received"] for r in once) >= sum(r["read"] for r in each), (w, once, each)


# -- s3:// (the 2-process run saved and loaded under s3_prefix on the session's moto server) ----------------------
@pytest.fixture
def fetch():
    """``fetch(url)``: a context giving the committed ``s3://`` checkpoint as a local folder (one process)."""
    from fastckpt._io.storage.object.api import fetched
    from fastckpt._io.storage.object.store import parse_url

    return lambda url: fetched(parse_url(url, "url"), None, model_only=False, storage_options=None)


@pytest.mark.parametrize("kind", KINDS)
def test_s3_sharded_save_is_the_local_sharded_save_and_loads_back(runs, s3_prefix, fetch, one_thread, kind):
    """Every rank uploads its own shards, rank 0 the small files and the manifest: fetched, the checkpoint is the
    local sharded save of the same state, file for file (the manifest included, bar none); it loads back bit-exact
    on 2 processes (state, scheduler, each rank's RNG) and into a plain model in one process (resharding 2 -> 1)."""
    out, results = runs
    for rank, res in enumerate(results[2]):
        assert res[f"s3_save_{kind}"] == {"error": None, "message": ""}, (rank, res[f"s3_save_{kind}"])
        assert res[f"s3_load_{kind}"] == {"same": True, "result": [[], []], "sched": True, "rng": True}, rank
        assert res[f"s3_weights_{kind}"] is True, rank
    local = out / f"w2_{kind}"
    with fetch(f"{s3_prefix}/{kind}") as folder:
        got, want = (json.loads((f / "fastckpt.json").read_text()) for f in (folder, local))
        assert got == want
        names = [*want["files"], *want["sharded"]["files"]]
        assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == sorted(
            [*names, "fastckpt.json"])
        for name in names:
            assert (folder / name).read_bytes() == (local / name).read_bytes(), name
    model = build(kind, 9)
    opt, sched = optimizer_for(model)
    with pytest.warns(fastckpt.RngRestoreWarning, match="saved by 2 processes, resumed by 1"):
        assert fastckpt.load_state(model, opt, sched, input_dir=f"{s3_prefix}/{kind}") == ([], [])
    ref_model, ref_opt, ref_sched = reference(kind, 3)
    assert same(full_state(model, opt), full_state(ref_model, ref_opt))
    assert sched.state_dict() == ref_sched.state_dict()


@pytest.mark.parametrize("suffix", ["_weights", "_weights_split"])
@pytest.mark.parametrize("kind", KINDS)
def test_s3_model_only_sharded_save_is_the_one_process_save(runs, s3_prefix, fetch, one_thread, kind, suffix):
    """A model-only FSDP2 save to s3 (the full state dict gathered to rank 0) uploads the files the local model-only
    save writes, byte for byte (which are the one-process save's, see above), with the same manifest."""
    out, _ = runs
    local = out / f"w2_{kind}{suffix}"
    with fetch(f"{s3_prefix}/{kind}{suffix}") as folder:
        names = {p.name for p in folder.iterdir()}
        assert names == {p.name for p in local.iterdir()}
        for name in names - {"fastckpt.json"}:
            assert (folder / name).read_bytes() == (local / name).read_bytes(), name
        assert json.loads((folder / "fastckpt.json").read_text()) == json.loads((local / "fastckpt.json").read_text())
    weights = build(kind, 11)
    fastckpt.load_state(weights, input_dir=f"{s3_prefix}/{kind}{suffix}", model_only=True)
    assert same(full_state(weights, None), full_state(reference(kind, 3)[0], None))


@pytest.mark.parametrize("kind", KINDS)
def test_s3_sharded_load_fetches_on_each_rank_only_the_model_shards_it_reads(runs, s3_prefix, fetch, kind):
    """Loaded in the saved placement, rank r fetches the small files, each part's chunk index and its own model shard
    (FSDP2 shards every parameter along dim 0), plus rank 0's where a replicated value lives there (the tiny
    model's ``scale`` buffer is not sharded: DCP writes it once, on rank 0); rank 0 never needs rank 1's."""
    _, results = runs
    with fetch(f"{s3_prefix}/{kind}") as folder:
        manifest = json.loads((folder / "fastckpt.json").read_text())
    # each part's chunk index, not its full dcp_metadata.json (left for tools)
    small = sorted([*manifest["files"], *(f"{p}/dcp_index.bin" for p in manifest["sharded"]["parts"])])
    for rank, res in enumerate(results[2]):
        fetched = res[f"s3_fetched_{kind}"]
        model = sorted(n for n in fetched if n.startswith("model/shard-"))
        own = [rank, *([0] if kind == "tiny" and rank == 1 else [])]
        assert model == sorted(f"model/shard-{r:05d}-of-00002.safetensors" for r in own), (rank, fetched)
        assert sorted(n for n in fetched if "/shard-" not in n) == small, (rank, fetched)
        everything = {*small, *manifest["sharded"]["files"]}
        assert set(fetched) < everything if rank == 0 else set(fetched) <= everything, (rank, fetched)


def test_s3_sharded_automatic_naming_rotates(runs, s3_prefix):
    from helpers.s3_server import key_prefix, keys

    _, results = runs
    project = f"{s3_prefix}/project"
    for rank, res in enumerate(results[2]):
        assert res["s3_project"] == {"urls": [f"{project}/checkpoints/checkpoint_{n}" for n in range(3)],
                                     "latest": f"{project}/checkpoints/checkpoint_2", "same": True}, rank
    left = {k.split("/checkpoints/", 1)[1].split("/", 1)[0] for k in keys(key_prefix(project))}
    assert left == {"checkpoint_1", "checkpoint_2"}


def test_s3_damaged_object_is_refused_on_every_rank_and_changes_nothing(runs):
    from helpers.s3_server import BUCKET

    _, results = runs
    key = results[2][0]["s3_damaged_key"]
    # rank 0 reads its model shard (the damaged one) while DCP plans, rank 1 too: the replicated ``scale`` buffer
    # lives there; each finds the damage itself before any destination is filled
    for rank, res in enumerate(results[2]):
        assert res["s3_damaged"]["error"] == "IntegrityError", (rank, res["s3_damaged"])
        assert res["s3_damaged"]["message"].startswith(f"s3://{BUCKET}/{key}: crc32c "), res["s3_damaged"]
    for rank, res in enumerate(results[2]):
        assert res["s3_damaged_unchanged"] is True, rank


def test_s3_save_failing_on_one_rank_commits_nothing(runs, s3_prefix):
    from helpers.s3_server import key_prefix, keys

    _, results = runs
    failed = [res["s3_failed"] for res in results[2]]
    assert failed[1] == {"error": "OSError", "message": "injected upload failure on process 1"}, failed[1]
    assert failed[0]["error"] == "CheckpointError", failed[0]
    assert "failed on process 1: OSError: injected upload failure on process 1" in failed[0]["message"], failed[0]
    prefix = key_prefix(f"{s3_prefix}/tiny_fail")
    stored = keys(prefix)
    assert [k for k in stored if "/manifests/" in k] == [f"{prefix}/manifests/0000000000.json"]
    assert {k[len(prefix) + 1:].split("/", 1)[0] for k in stored} - {"manifests"} == {
        next(k[len(prefix) + 1:].split("/", 1)[0] for k in stored if "/save-0000000000-" in k)}
    assert all(res["s3_failed_previous_loads"] is True for res in results[2])


def _frozen_lines(folder: Path) -> list[str]:
    names = [n for n, _ in build("tiny").named_parameters() if n.startswith("blocks.0.")]
    return [f"{folder / 'optimizer.json'}: optimizer state of {n!r} (step, exp_avg, exp_avg_sq) not applied: the "
            "live optimizer does not optimize that parameter (frozen since the save, or left out of its param_groups)"
            for n in names]


@pytest.mark.parametrize("world", [2, 4])
def test_c31_a_block_frozen_at_load_gets_its_moments_on_every_rank(runs, world):
    """Issue 27.4 (pytorch#192202): the 2-rank checkpoint loaded on 2 and 4 ranks with block 0 frozen since: its
    AdamW moments (still in the optimizer) are restored and the next step equals the one-process reference; left
    out of the optimizer, strict refuses and strict=False lists each dropped parameter's state."""
    out, results = runs
    for rank, res in enumerate(results[world]):
        assert res["scenario_frozen"] is None, (rank, res["scenario_frozen"])
        assert res["frozen_tiny"] is True and res["frozen_tiny_next"] is True, (rank, res["frozen_tiny"])
        assert res["frozen_tiny_result"] == [[], [], []], rank
        assert res["frozen_tiny_strict"]["error"] == "KeyMismatchError", res["frozen_tiny_strict"]
        assert "blocks.0." in res["frozen_tiny_strict"]["message"], res["frozen_tiny_strict"]
        assert res["frozen_tiny_skipped"] == _frozen_lines(out / "w2_tiny"), rank
        assert res["frozen_tiny_rest"] is True, rank


def test_c31_a_block_frozen_at_load_gets_its_moments_in_one_process(runs, one_thread):
    """The same 2-rank checkpoint into a plain model in one process (2 -> 1)."""
    from helpers.fsdp_models import blocks

    out, _ = runs
    model = build("tiny", 9)
    opt, sched = optimizer_for(model)
    blocks(model)[0].requires_grad_(False)
    with pytest.warns(fastckpt.RngRestoreWarning):
        result = fastckpt.load_state(model, opt, sched, input_dir=out / "w2_tiny")
    assert (result.missing_keys, result.unexpected_keys, result.skipped) == ([], [], [])
    ref_model, ref_opt, ref_sched = reference("tiny", 3)
    blocks(ref_model)[0].requires_grad_(False)
    assert same(full_state(model, opt), full_state(ref_model, ref_opt))
    train_step(model, opt, sched, 3)
    train_step(ref_model, ref_opt, ref_sched, 3)
    assert same(full_state(model, opt), full_state(ref_model, ref_opt))
    left_out = build("tiny", 9)
    blocks(left_out)[0].requires_grad_(False)
    trainable = torch.optim.AdamW([p for p in left_out.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    with pytest.warns(fastckpt.RngRestoreWarning):
        result = fastckpt.load_state(left_out, trainable, input_dir=out / "w2_tiny", strict=False)
    assert result.skipped == _frozen_lines(out / "w2_tiny")

"""fastckpt.dcp under real processes (``torchrun``, gloo, CPU): a state of every dtype, tied weights, uneven shards
and non-tensor values saved as DTensors on 2 ranks loads bit-exact on 1, 2 and 4 ranks in other placements, equal to
a single-process save; ``dcp.async_save`` works with both checkpointers; a re-save that fails on one rank raises on
both and leaves the previous checkpoint exact; a dtype mismatch raises DtypeError (a template key the checkpoint
lacks: MissingStateError) on every rank and changes nothing; a rank SIGKILLed mid-save leaves the previous checkpoint exact and the other rank exits with an error.
The scenarios run in tests/helpers/dcp_worker.py: each world size starts once (2 ranks ~20 s, 4 ranks ~15 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint
from helpers.dcp_state import full_state, mismatches, same, template
from safetensors import safe_open

import fastckpt.dcp
from fastckpt._io.storage.local.staging import leftovers

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "dcp_worker.py"


def _launch(out: Path, world: int, mode: str, s3_url: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PYTHONWARNINGS="error", FASTCKPT_TEST_S3_URL=s3_url)
    env["PYTHONPATH"] = str(WORKER.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), str(WORKER), str(out), mode], env=env, capture_output=True, text=True,
                          timeout=300)


def _torchrun(out: Path, world: int, mode: str, s3_url: str = "") -> list[dict]:
    proc = _launch(out, world, mode, s3_url)
    files = [out / f"{mode}-rank{r}.json" for r in range(world)]
    results = [json.loads(f.read_text()) for f in files if f.is_file()]
    assert proc.returncode == 0 and len(results) == world, proc.stdout[-3000:] + proc.stderr[-6000:]
    crashes = [f"rank {r}:\n{res['crash']}" for r, res in enumerate(results) if "crash" in res]
    assert not crashes, "\n".join(crashes)
    return results


S3_URL = "s3://fastckpt-test/dcp-two-ranks"


@pytest.fixture(scope="module")
def run(tmp_path_factory, s3_endpoint):
    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    out = tmp_path_factory.mktemp("dcp")
    saved = _torchrun(out, 2, "save", S3_URL)
    loaded = _torchrun(out, 4, "load")
    killed = _launch(out, 2, "kill")
    return out, saved, loaded, killed


def test_two_ranks_reload_in_another_placement(run):
    _, saved, _, _ = run
    assert [r["A_dim1"] for r in saved] == [[], []]


def test_each_rank_opens_only_the_shard_files_its_boxes_come_from_through_the_index(run):
    """The chunk index (dcp_index.bin): in the saved placement rank r opens shard r alone; along dim 1 both; the
    values equal the one-process reference (mismatches against full_state())."""
    _, saved, _, _ = run
    own = "shard-{:05d}-of-00002.safetensors"
    assert [r["I_dim0"] for r in saved] == [[[], [own.format(r)]] for r in range(2)]
    assert [r["I_dim1"] for r in saved] == [[[], [own.format(0), own.format(1)]]] * 2


@pytest.mark.parametrize("world", [2, 4])
def test_a_data_parallel_load_reads_the_checkpoint_once_in_total(run, world, tmp_path):
    """Every rank loads every tensor (plain tensors): with read_once each box is read by one rank and sent to the
    others, so the ranks together read the checkpoint's bytes once (within 5%), as one process reading it alone
    does; each rank reading its own reads them ``world`` times; both loads equal the one-process reference."""
    _, saved, loaded, _ = run
    results = saved if world == 2 else loaded
    reference = fastckpt.dcp.StorageReader(run[0] / "A")
    one = template(full_state())
    with warnings.catch_warnings():  # one process, no process group: what is meant
        warnings.simplefilter("ignore", UserWarning)
        torch.distributed.checkpoint.load(one, storage_reader=reference, planner=reference.load_planner(), no_dist=True)
    assert mismatches(full_state(), one) == []
    once = [r["R_True"] for r in results]
    each = [r["R_False"] for r in results]
    assert all(r["mismatches"] == [] for r in once + each), (once, each)
    total = reference.read_bytes
    assert total <= sum(r["read"] for r in once) <= 1.05 * total, (total, once)
    assert sum(r["verified"] for r in once) <= 1.05 * reference.verified_bytes, (reference.verified_bytes, once)
    assert all(r["read"] < total for r in once), once  # the reads are spread over the ranks
    assert sum(r["read"] + r["received"] for r in once) >= world * total  # every rank got every box (ties twice)
    assert sum(r["read"] for r in each) == world * total, each


@pytest.mark.parametrize("world", [2, 4])
def test_a_failed_read_on_the_reading_rank_raises_on_every_rank(run, world):
    _, saved, loaded, _ = run
    results = saved if world == 2 else loaded
    assert results[1]["R_fail"] == "OSError: [Errno 5] injected read error: 'shard'", results[1]["R_fail"]
    for rank, res in enumerate(results):  # every rank waited on boxes rank 1 reads: each raises rank 1's error
        assert res["R_fail"] == results[1]["R_fail"], (rank, res["R_fail"])


def test_four_ranks_load_a_two_rank_save(run):
    _, _, loaded, _ = run
    assert [(r["L_dim0"], r["L_dim1"]) for r in loaded] == [([], [])] * 4


def test_one_process_loads_a_two_rank_save_like_a_single_process_save(run, tmp_path):
    out, _, _, _ = run
    reference = full_state()
    fastckpt.dcp.save(reference, tmp_path / "single")
    from_ranks, from_single = template(reference), template(reference)
    fastckpt.dcp.load(from_ranks, out / "A")
    fastckpt.dcp.load(from_single, tmp_path / "single")
    assert mismatches(reference, from_ranks) == []
    assert same(from_ranks, from_single)
    assert from_ranks["head"] is from_ranks["emb"]  # the template's tie is untouched


def test_two_ranks_save_to_s3_and_reload_in_another_placement_and_in_one_process(run):
    """FSDP2-style DCP saves from every rank to s3://: each rank's shard object, the manifest object committed by
    the coordinator; 2 ranks reload along dim 1, one process (2 -> 1) loads it bit-exact."""
    from helpers.s3_server import keys

    _, saved, _, _ = run
    assert [r["S_dim1"] for r in saved] == [[], []]
    names = sorted(k.split("/", 2)[2] for k in keys("dcp-two-ranks/") if "/save-" in k)
    assert names == ["dcp_index.bin", "dcp_metadata.json", "shard-00000-of-00002.safetensors",
                     "shard-00001-of-00002.safetensors"]
    reference = full_state()
    reloaded = template(reference)
    fastckpt.dcp.load(reloaded, S3_URL)
    assert mismatches(reference, reloaded) == []
    assert fastckpt.verify_checkpoint(S3_URL).ok


def test_each_rank_fetches_only_the_objects_its_boxes_come_from(run):
    """Reloaded in the saved placement, rank r reads shard r's object alone; in another placement both."""
    _, saved, _, _ = run
    meta, own = "dcp_index.bin", "shard-{:05d}-of-00002.safetensors"  # the index, not the full metadata
    assert [r["O_dim0"] for r in saved] == [[[], [meta, own.format(r)]] for r in range(2)]
    assert [r["O_dim1"] for r in saved] == [[[], [meta, own.format(0), own.format(1)]]] * 2


def test_a_damaged_object_one_rank_reads_is_refused_on_every_rank_before_any_reads(run):
    _, saved, _, _ = run
    for r in saved:
        assert r["O_damaged"].startswith("IntegrityError: "), r["O_damaged"]
        assert "shard-00001-of-00002.safetensors: crc32c" in r["O_damaged"], r["O_damaged"]
        assert r["O_damaged_filled"] == []


def test_two_rank_folder_layout(run):
    out, _, _, _ = run
    names = sorted(p.name for p in (out / "A").iterdir())
    assert names == ["dcp_index.bin", "dcp_metadata.json", "fastckpt.json", "shard-00000-of-00002.safetensors",
                     "shard-00001-of-00002.safetensors"]
    meta = json.loads((out / "A" / "dcp_metadata.json").read_text())
    emb, head = meta["state_dict"]["emb"]["tensor"], meta["state_dict"]["head"]["tensor"]
    assert [c["offsets"] for c in emb["chunks"]] == [[0, 0], [5, 0]]
    assert [(c["file"], c["name"]) for c in head["chunks"]] == [(c["file"], c["name"]) for c in emb["chunks"]]
    stored = set()
    for f in ("shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"):
        with safe_open(out / "A" / f, "pt") as sf:
            stored |= {(f, k) for k in sf.keys()}
    assert not any(k.startswith("head") for _, k in stored)  # the tied weight is stored once
    assert fastckpt.verify_checkpoint(out / "A").ok


@pytest.mark.parametrize("folder", ["B", "C"])
def test_async_save_thread_and_process_checkpointers(run, folder):
    _, saved, _, _ = run
    assert [r[f"{folder}_dim0"] for r in saved] == [[], []]


def test_failed_resave_on_one_rank_leaves_the_previous_checkpoint(run):
    out, saved, _, _ = run
    for rank, res in enumerate(saved):
        assert res["F_io"] == "OSError: [Errno 5] injected I/O error: 'shard'", rank
        assert res["F_raw"] == "CheckpointException[OSError]", rank
        assert res["F_pickle"].startswith("TypeError: opaque is a types.SimpleNamespace"), rank
        assert res["F_io_left"] == res["F_raw_left"] == res["F_pickle_left"] == [], rank
        assert res["F_io_leftovers"] == [] and res["F_after_leftovers"] == [], rank
        assert res["F_after"] == [], rank
    assert [name for name in leftovers(out) if name.startswith(".F.")] == []
    reloaded = template(full_state(2))
    fastckpt.dcp.load(reloaded, out / "F")
    assert mismatches(full_state(2), reloaded) == []


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(run):
    out, _, _, killed = run
    assert killed.returncode != 0, killed.stdout[-2000:] + killed.stderr[-4000:]
    assert "Signal 9 (SIGKILL)" in killed.stderr  # rank 1 died ...
    # ... and rank 0 exited with an error instead of hanging (its own traceback, or torchrun stopped it first)
    assert "[rank0]: Traceback" in killed.stderr or "closing signal SIGTERM" in killed.stderr
    reloaded = template(full_state(1))
    fastckpt.dcp.load(reloaded, out / "K")
    assert mismatches(full_state(1), reloaded) == []
    if "[rank0]: Traceback" in killed.stderr:  # rank 0 (the coordinator, owner of the staging folder) saw the
        assert not any(name.startswith(".K.") for name in leftovers(out))  # error itself: removed it on its way out
    # (when torchrun's SIGTERM stopped rank 0 first, its staging folder stays until the next save of K removes it)
    fastckpt.dcp.save(full_state(2), out / "K")
    assert not any(name.startswith(".K.") for name in leftovers(out))
    reloaded = template(full_state(2))
    fastckpt.dcp.load(reloaded, out / "K")
    assert mismatches(full_state(2), reloaded) == []


def test_dtype_mismatch_raises_on_every_rank_and_changes_nothing(run):
    out, saved, _, _ = run
    for rank, res in enumerate(saved):
        assert res["D_error"].startswith("DtypeError: "), rank
        assert "'w' is stored as torch.float32" in res["D_error"] and "torch.float64" in res["D_error"], rank
        assert res["D_changed"] == [] and res["D_values"] == [None, None], rank
        assert res["D1_error"].startswith("DtypeError: 'f16' is stored as torch.float16"), rank
        assert res["D1_changed"] == [], rank  # rank 0's template was right, and it still read nothing
        # pytorch#126881: a template key the checkpoint lacks (on rank 1 only) is a MissingStateError on every rank
        assert res["M_error"].startswith(f"MissingStateError: {out / 'A'}: the checkpoint has no 'not_saved' "), rank
        assert res["M_changed"] == [], rank



def test_consolidating_the_two_rank_save_equals_the_single_process_one(run, tmp_path):
    from fastckpt.cli import main

    out, _, _, _ = run
    fastckpt.dcp.save(full_state(), tmp_path / "single")
    assert main(["consolidate", str(out / "A"), str(tmp_path / "from_ranks")]) == 0
    assert main(["consolidate", str(tmp_path / "single"), str(tmp_path / "from_single")]) == 0
    views = []
    for folder in ("from_ranks", "from_single"):
        with safe_open(tmp_path / folder / "model.safetensors", "pt") as f:
            views.append(({k: f.get_tensor(k) for k in f.keys()}, f.metadata()))
    assert same(views[0], views[1])
    assert (tmp_path / "from_ranks" / "model.safetensors").read_bytes() == \
        (tmp_path / "from_single" / "model.safetensors").read_bytes()

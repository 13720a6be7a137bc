"""CheckpointManager(remote="s3://..."): each durable checkpoint is uploaded in the background (the tiered upload),
rotated to ``keep`` there too; a new machine with neither memory tier nor local folder restores from the remote
tier, and a damaged remote copy is skipped for an intact local one (session moto server)."""

from __future__ import annotations

import uuid

import pytest
import torch
from helpers.recovery_loop import build, fingerprint, reference, seed_globals, train_step
from helpers.s3_server import BUCKET, keys

import fastckpt
from fastckpt.errors import TierSkippedWarning


def manager(root, url, memory, state):
    mgr = fastckpt.CheckpointManager(root, *state[:3], every_n_steps=2, memory=memory, keep=2, remote=url)
    mgr.register_for_checkpointing(state[3], state[4])
    return mgr


def test_remote_tier_uploads_and_restores(tmp_path, s3_endpoint):
    url = f"s3://{BUCKET}/manager-{uuid.uuid4().hex[:6]}"
    state = build()
    seed_globals()
    mgr = manager(tmp_path / "proj", url, tmp_path / "mem", state)
    for step in range(6):
        train_step(*state)
        mgr.step(step + 1)
        mgr.wait()  # each upload ends before the next save: a known remote tier
    mgr.close()
    manifests = sorted(k.rsplit("/", 1)[-1] for k in keys(url.split("/", 3)[3]) if "/manifests/" in k)
    assert fastckpt.latest_checkpoint(url) == f"{url}/checkpoints/checkpoint_6"
    assert manifests  # committed objects exist
    # a new machine: no memory tier, no local folder
    fresh = build()
    seed_globals()
    mgr = manager(tmp_path / "other", url, tmp_path / "mem-other", fresh)
    assert mgr.restore() == 6 and mgr.restored_from == "remote"
    for _step in range(6, 10):
        train_step(*fresh)
    got, want = fingerprint(*fresh), reference(10)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_only_the_remote_tier_left_damaged_refuses(tmp_path, s3_endpoint):
    url = f"s3://{BUCKET}/manager-{uuid.uuid4().hex[:6]}"
    state = build()
    mgr = manager(tmp_path / "proj", url, tmp_path / "mem", state)
    train_step(*state)
    mgr.step(2)
    mgr.close()
    from helpers.s3_server import client

    key = next(k for k in keys(url.split("/", 3)[3]) if k.endswith("model.safetensors"))
    body = bytearray(client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[-3] ^= 0x10
    client().put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    mgr = manager(tmp_path / "other", url, tmp_path / "mem-other", build())
    with pytest.warns(TierSkippedWarning, match="remote tier"), pytest.raises(fastckpt.CheckpointError) as info:
        mgr.restore()  # starting over would overwrite the damaged checkpoint: refused, naming it
    assert type(info.value) is fastckpt.CheckpointError and "remote tier's checkpoint of step 2" in str(info.value)


def test_readme_recipe_trying_remote_locally_runs_as_written(tmp_path):
    """README's "Trying remote= locally" block (from ``# recipe: try remote= locally with a moto S3 server`` to the
    end of its code block), run as written in a fresh interpreter in an empty folder: its own moto server, the
    environment it sets, a second "machine" restoring step 6 from S3."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = text.index("# recipe: try remote= locally with a moto S3 server")
    (tmp_path / "recipe.py").write_text(text[start:text.index("```", start)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "FASTCKPT_JOB_ID"}
    proc = subprocess.run([sys.executable, "recipe.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["s3://demo/run/checkpoints/checkpoint_6", "6 remote True"]
    assert (tmp_path / "machine1" / "checkpoints" / "checkpoint_6").is_dir()

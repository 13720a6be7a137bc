"""A load racing another process that re-saves the same folder (issue 12, item 3): every load returns the state
of one save (weights and optimizer state of the same save), or raises CheckpointChangedError; never a mix. Files
were opened one by one by path, so 12 of 550 loads took the model of one save and the optimizer of the next."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import fastckpt
from fastckpt._io.storage.local import folder as folder_mod

HELPERS = Path(__file__).parent.parent / "helpers"
sys.path.insert(0, str(HELPERS))
from resave_worker import build  # noqa: E402

LOADS = 100


def _values(model, opt) -> tuple[set, set]:
    weights = {float(v) for p in model.parameters() for v in p.detach().unique()}
    moments = {float(v) for s in opt.state.values() for v in s["momentum_buffer"].unique()}
    return weights, moments


def _race(target: Path, *, retries: int, monkeypatch) -> tuple[int, int, int]:
    """(consistent loads, CheckpointChangedError count, mixed loads) over LOADS loads against a re-saving writer."""
    monkeypatch.setattr(folder_mod, "RETRIES", retries)
    monkeypatch.setattr(fastckpt.checkpoint, "RETRIES", retries)
    writer = subprocess.Popen([sys.executable, str(HELPERS / "resave_worker.py"), str(target)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        assert writer.stdout.readline().strip() == "committed"  # the first save is in place
        ok = changed = mixed = 0
        for _ in range(LOADS):
            model, opt = build(-1.0)
            try:
                fastckpt.load_state(model, opt, input_dir=target)
            except fastckpt.CheckpointChangedError:
                changed += 1
                continue
            weights, moments = _values(model, opt)
            if len(weights) == 1 and weights == moments:
                ok += 1
            else:
                mixed += 1
        return ok, changed, mixed
    finally:
        writer.kill()
        writer.wait()
        writer.stdout.close()


def test_loads_racing_a_resaving_process_never_mix_saves(tmp_path, monkeypatch):
    ok, changed, mixed = _race(tmp_path / "ckpt", retries=1, monkeypatch=monkeypatch)
    assert mixed == 0, (ok, changed, mixed)
    assert ok + changed == LOADS and ok > 0


def test_loads_racing_in_place_commits_never_mix_saves(tmp_path, monkeypatch):
    """A folder committed in place (a mount point): its files are renamed in one by one, the save id in each
    file and the manifest's record of the small files tie them to one save."""
    target = tmp_path / "ckpt"
    model, opt = build(0.0)
    fastckpt.save_state(model, opt, output_dir=target)
    manifest = json.loads((target / "fastckpt.json").read_text())
    manifest["commit"] = "in_place"  # every later save commits in place
    (target / "fastckpt.json").write_text(json.dumps(manifest))
    ok, changed, mixed = _race(target, retries=1, monkeypatch=monkeypatch)
    assert mixed == 0, (ok, changed, mixed)
    assert ok + changed == LOADS and ok > 0


@pytest.mark.parametrize("retries", [5])
def test_load_state_retries_when_the_folder_changes(tmp_path, monkeypatch, retries):
    ok, changed, mixed = _race(tmp_path / "ckpt", retries=retries, monkeypatch=monkeypatch)
    assert mixed == 0 and ok > changed, (ok, changed, mixed)

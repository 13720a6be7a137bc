"""``share_unchanged``: frozen tensors in shards of their own, hard-linked from the previous checkpoint when their
content is unchanged; links survive rotation of the checkpoint that first wrote them; a changed frozen tensor is
written again; a link that cannot be made falls back to writing; a crash mid-save leaves no checkpoint that points
to missing files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from helpers.common import assert_tensor_dicts_identical, model_clone
from helpers.finetune import make_frozen_base, trained

import fastckpt
from fastckpt import _core
from fastckpt._io import tensor_hashes
from fastckpt._io.storage.local import sharing

FROZEN = "model-00001-of-00002.safetensors"
TRAIN = "model-00002-of-00002.safetensors"


def _save(model, opt, root, **kwargs):
    return fastckpt.save_state(model, opt, project_dir=root, share_unchanged=True, durable=False, **kwargs)


def _fresh():
    model = make_frozen_base(0, head_seed=42)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def test_unchanged_frozen_shard_is_hard_linked_and_loads_bit_exact(tmp_path):
    model = make_frozen_base(0, head_seed=1)
    opt = trained(model)
    first = _save(model, opt, tmp_path)
    index = json.loads((first / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n for n, f in index.items() if f == TRAIN} == {"head.weight", "head.bias"}
    trained(model, 1)
    second = _save(model, opt, tmp_path)
    a, b = (first / FROZEN).stat(), (second / FROZEN).stat()
    assert a.st_ino == b.st_ino and b.st_nlink == 2
    assert (first / TRAIN).stat().st_ino != (second / TRAIN).stat().st_ino
    manifest = json.loads((second / "fastckpt.json").read_text())
    assert manifest["shared"] == {FROZEN: f"checkpoint_0/{FROZEN}"}
    assert manifest["frozen_files"] == [FROZEN]
    report = fastckpt.verify_checkpoint(second)
    assert report.hashes_checked == report.tensors_checked > len(model.state_dict())
    fresh, fresh_opt = _fresh()
    fastckpt.load_state(fresh, fresh_opt, input_dir=second)
    assert_tensor_dicts_identical(fresh.state_dict(), model.state_dict())


def test_links_survive_rotation_of_the_checkpoint_that_wrote_them(tmp_path):
    model = make_frozen_base(0, head_seed=1)
    opt = trained(model)
    first = _save(model, opt, tmp_path, total_limit=1)
    inode = (first / FROZEN).stat().st_ino
    for _ in range(3):
        trained(model, 1)
        last = _save(model, opt, tmp_path, total_limit=1)
    assert not first.exists() and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_3"]
    st = (last / FROZEN).stat()
    assert st.st_ino == inode and st.st_nlink == 1
    assert fastckpt.verify_checkpoint(last).ok
    fresh, fresh_opt = _fresh()
    fastckpt.load_state(fresh, fresh_opt, input_dir=last)
    assert_tensor_dicts_identical(fresh.state_dict(), model.state_dict())


def test_a_changed_frozen_tensor_is_written_again(tmp_path):
    model = make_frozen_base(0, head_seed=1)
    opt = trained(model)
    first = _save(model, opt, tmp_path)
    with torch.no_grad():
        model.base[0].weight[0, 0] = 123.0
    second = _save(model, opt, tmp_path)
    assert (first / FROZEN).stat().st_ino != (second / FROZEN).stat().st_ino
    assert "shared" not in json.loads((second / "fastckpt.json").read_text())
    fresh, fresh_opt = _fresh()
    fastckpt.load_state(fresh, fresh_opt, input_dir=second)
    assert fresh.base[0].weight[0, 0].item() == 123.0


def test_unchanged_tensors_are_not_hashed_again_within_a_process(tmp_path, monkeypatch):
    model = make_frozen_base(0, head_seed=1)
    opt = trained(model)
    _save(model, opt, tmp_path)
    hashed = []
    real = _core.hash_tensors
    monkeypatch.setattr(_core, "hash_tensors", lambda sources, **kw: hashed.extend(s[0] for s in sources) or
                        real(sources, **kw))
    _save(model, opt, tmp_path)
    assert hashed == []  # the writer's hashes of checkpoint_0 were remembered
    tensor_hashes.forget()
    third = _save(model, opt, tmp_path)
    assert sorted(hashed) == sorted(n for n in model.state_dict() if not n.startswith("head."))
    assert (third / FROZEN).stat().st_nlink == 3


def test_a_link_that_cannot_be_made_is_written_instead(tmp_path, monkeypatch):
    model = make_frozen_base(0, head_seed=1)
    opt = trained(model)
    first = _save(model, opt, tmp_path)

    def vanished(source, dest):
        raise FileNotFoundError(2, "No such file or directory", str(source))

    monkeypatch.setattr(sharing, "_link", vanished)
    second = _save(model, opt, tmp_path)
    assert (second / FROZEN).stat().st_nlink == 1 and (first / FROZEN).stat().st_nlink == 1
    assert "shared" not in json.loads((second / "fastckpt.json").read_text())
    assert (first / FROZEN).read_bytes() == (second / FROZEN).read_bytes()
    assert fastckpt.verify_checkpoint(second).ok


_CRASH = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from helpers.finetune import make_frozen_base, trained
import fastckpt
from fastckpt._io.storage.local import sharing
model = make_frozen_base(0, head_seed=1)
opt = trained(model)
fastckpt.save_state(model, opt, project_dir={root!r}, share_unchanged=True)
def link_then_die(source, dest):
    os.link(source, dest)
    os._exit(9)
sharing._link = link_then_die
fastckpt.save_state(model, opt, project_dir={root!r}, share_unchanged=True)
"""


def test_a_crash_mid_save_leaves_no_dangling_checkpoint(tmp_path):
    tests = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", _CRASH.format(tests=tests, root=str(tmp_path))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert fastckpt.latest_checkpoint(tmp_path).name == "checkpoint_0"
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name != "checkpoint_0"]
    assert leftovers and all("staging" in n or n.endswith(".lock") for n in leftovers)
    for folder in (tmp_path / "checkpoints").glob("checkpoint_*"):
        assert fastckpt.verify_checkpoint(folder).ok
    model = make_frozen_base(0, head_seed=1)
    opt = trained(model)
    expected = model_clone(model)
    after = _save(model, opt, tmp_path)  # removes the dead save's staging folder, links again
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]
    assert (after / FROZEN).stat().st_ino == (tmp_path / "checkpoints" / "checkpoint_0" / FROZEN).stat().st_ino
    fresh, fresh_opt = _fresh()
    fastckpt.load_state(fresh, fresh_opt, input_dir=after)
    assert_tensor_dicts_identical(fresh.state_dict(), expected)
    assert os.path.samefile(after / FROZEN, tmp_path / "checkpoints" / "checkpoint_0" / FROZEN)

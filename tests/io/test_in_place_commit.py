"""Targets that cannot be replaced whole (issue 12, item 2): a mount point (a container volume) and a folder the
user owns under a parent they cannot write. The save detects them before writing anything and commits inside the
target folder (hidden staging subfolder, fsync, files renamed into place, manifest last, lock inside); the previous
checkpoint survives a failed save, the user's files in the folder are kept, and nothing hidden is left behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from helpers.common import assert_model_state, make_training_state, model_clone, run_python

import fastckpt
import fastckpt.torch
from fastckpt._io.storage.local import in_place

NOBODY = 65534


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _bumped(model, by: float):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)
    return model_clone(model)


@pytest.fixture
def mount_point(tmp_path):
    """A real tmpfs mounted at tmp_path/vol (needs the right to mount; skipped otherwise)."""
    vol = tmp_path / "vol"
    vol.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(vol)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN)")
    yield vol
    subprocess.run(["umount", "-l", str(vol)], check=False)


def test_save_into_a_real_mount_point(mount_point):
    model, opt, sched = make_training_state(0)
    fastckpt.save_state(model, opt, sched, output_dir=mount_point)
    (mount_point / "notes.txt").write_text("mine")
    expected = _bumped(model, 1.0)
    path = fastckpt.save_state(model, opt, sched, output_dir=mount_point)  # was EBUSY (rename of a mount point)
    assert path == mount_point
    manifest = json.loads((mount_point / "fastckpt.json").read_text())
    assert manifest["commit"] == "in_place" and manifest["in_place_reason"] == "it is a mount point"
    assert (mount_point / "notes.txt").read_text() == "mine"
    assert _hidden(mount_point) == [] and _hidden(mount_point.parent) == []
    fresh, fresh_opt, fresh_sched = make_training_state(1)
    fastckpt.load_state(fresh, fresh_opt, fresh_sched, input_dir=mount_point)
    assert_model_state(fresh, expected)
    assert fastckpt.verify_checkpoint(mount_point).ok


def test_detected_mount_point_is_committed_in_place(tmp_path, monkeypatch):
    """The detection monkeypatched (as on a machine without mount rights): the folder keeps its inode, a model-only
    save over a full one removes the optimizer files, files are tagged with the manifest's save id, and later
    saves go in place from the manifest's record alone."""
    target = tmp_path / "vol"
    model, opt, sched = make_training_state(0)
    fastckpt.save_state(model, opt, sched, output_dir=target)
    inode = target.stat().st_ino
    monkeypatch.setattr(in_place, "is_mount_point", lambda folder: folder == target)
    expected = _bumped(model, 2.0)
    fastckpt.save_state(model, output_dir=target, model_only=True)
    assert target.stat().st_ino == inode
    assert sorted(p.name for p in target.iterdir()) == ["fastckpt.json", "model.safetensors"]
    manifest = json.loads((target / "fastckpt.json").read_text())
    with fastckpt.torch.safe_open(target / "model.safetensors", "pt") as f:
        assert f.metadata()["fastckpt.save_id"] == manifest["save_id"]
    monkeypatch.setattr(in_place, "is_mount_point", lambda folder: False)
    fastckpt.save_state(model, opt, sched, output_dir=target)
    assert target.stat().st_ino == inode  # the manifest says "in_place": no rename over the folder
    fresh, fresh_opt, fresh_sched = make_training_state(1)
    fastckpt.load_state(fresh, fresh_opt, fresh_sched, input_dir=target)
    assert_model_state(fresh, expected)


def test_failed_in_place_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "vol"
    model, opt, sched = make_training_state(0)
    fastckpt.save_state(model, opt, sched, output_dir=target)
    expected = model_clone(model)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    monkeypatch.setattr(in_place, "is_mount_point", lambda folder: True)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device", str(target / in_place.STAGING_NAME / "model.safetensors"))

    monkeypatch.setattr(fastckpt._core, "write_files_checked", full_disk)
    _bumped(model, 3.0)
    with pytest.raises(OSError, match="No space left"):
        fastckpt.save_state(model, opt, sched, output_dir=target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    fresh, fresh_opt, fresh_sched = make_training_state(1)
    fastckpt.load_state(fresh, fresh_opt, fresh_sched, input_dir=target)
    assert_model_state(fresh, expected)


def test_folder_under_a_parent_the_user_cannot_write(tmp_path):
    """A folder the user owns in a folder they cannot write: was PermissionError on the hidden lock file beside it."""
    base = Path(tempfile.mkdtemp(prefix="fastckpt-inplace-"))
    try:
        base.chmod(0o755)
        parent = base / "parent"
        target = parent / "ckpt"
        target.mkdir(parents=True)
        code = f"""
import os, sys, torch
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
from helpers.common import make_training_state
import fastckpt
target = {str(target)!r}
model, opt, sched = make_training_state(0)  # warm up as root: every lazy import happens here
fastckpt.load_state(model, opt, sched, input_dir=fastckpt.save_state(model, opt, sched, output_dir=sys.argv[0]))
if os.geteuid() == 0:
    os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
else:
    os.chmod(os.path.dirname(target), 0o555)
model, opt, sched = make_training_state(0)
fastckpt.save_state(model, opt, sched, output_dir=target)
with torch.no_grad():
    next(model.parameters()).add_(1.0)
fastckpt.save_state(model, opt, sched, output_dir=target)
fresh, fo, fs = make_training_state(1)
fastckpt.load_state(fresh, fo, fs, input_dir=target)
assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
print("ok", sorted(os.listdir(target)), sorted(os.listdir(os.path.dirname(target))))
"""
        if os.geteuid() == 0:
            os.chown(target, NOBODY, NOBODY)
            parent.chmod(0o755)
        result = run_python(code.replace("sys.argv[0]", repr(str(base / "warmup"))))
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.split()[0] == "ok"
        assert not any(p.name.startswith(".") for p in target.iterdir())
        assert [p.name for p in parent.iterdir()] == ["ckpt"]
    finally:
        os.chmod(base / "parent", 0o755) if (base / "parent").exists() else None
        shutil.rmtree(base, ignore_errors=True)

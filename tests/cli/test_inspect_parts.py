"""``fastckpt inspect`` shows the trainable / frozen / shared parts of a checkpoint and the bytes each took; ``fastckpt
verify`` checks the xxh3-128 content hashes beside the crc32c (a change that keeps a tensor's crc32c is still
caught by its hash)."""

from __future__ import annotations

import json

from helpers.finetune import make_frozen_base, trained

import fastckpt
from fastckpt.cli import main as cli
from fastckpt.cli.inspect import describe

FROZEN = "model-00001-of-00002.safetensors"


def _two_saves(root):
    model = make_frozen_base(0, head_seed=1)
    opt = trained(model)
    first = fastckpt.save_state(model, opt, project_dir=root, share_unchanged=True, durable=False)
    trained(model, 1)
    second = fastckpt.save_state(model, opt, project_dir=root, share_unchanged=True, durable=False)
    return model, first, second


def test_parts_of_a_shared_checkpoint(tmp_path, capsys):
    model, first, second = _two_saves(tmp_path)
    parts = describe(second)["parts"]
    size = (second / FROZEN).stat().st_size
    assert parts["shared"] == {"files": 1, "bytes": size}
    assert parts["frozen"] == {"files": 0, "bytes": 0}
    assert parts["trainable"] == {"files": 1, "bytes": (second / "model-00002-of-00002.safetensors").stat().st_size}
    assert parts["optimizer"]["bytes"] == (second / "optimizer.safetensors").stat().st_size
    assert describe(first)["parts"]["frozen"] == {"files": 1, "bytes": size}
    assert cli(["inspect", str(second)]) == 0
    out = capsys.readouterr().out
    assert f"{size:,} shared with an earlier checkpoint" in out and "shared       1 files" in out


def test_parts_of_a_trainable_only_checkpoint(tmp_path, capsys):
    model = make_frozen_base(0, head_seed=1)
    path = fastckpt.save_state(model, trained(model), output_dir=tmp_path / "c", trainable_only=True)
    frozen = {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}
    parts = describe(path)["parts"]
    assert parts["frozen_not_stored"] == {"tensors": len(frozen),
                                          "bytes": sum(v.numel() * v.element_size() for v in frozen.values())}
    assert parts["trainable"]["files"] == 1
    assert cli(["inspect", str(path)]) == 0
    assert f"frozen, recorded only (trainable_only): {len(frozen)} tensors" in capsys.readouterr().out


def test_verify_checks_the_content_hash(tmp_path, capsys):
    model = make_frozen_base(0, head_seed=1)
    path = fastckpt.save_state(model, output_dir=tmp_path / "w", model_only=True)
    manifest = json.loads((path / "fastckpt.json").read_text())
    manifest["files"]["model.safetensors"]["xxh3"]["head.bias"] = "0" * 32
    (path / "fastckpt.json").write_text(json.dumps(manifest))
    report = fastckpt.check_checkpoint(path)
    assert [p for p in report.problems if "'head.bias': xxh3-128" in p]
    assert cli(["verify", str(path)]) == 1
    manifest["files"]["model.safetensors"]["xxh3"]["head.bias"] = _hash_of(path, "head.bias")
    (path / "fastckpt.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert cli(["verify", str(path)]) == 0
    assert f"({len(model.state_dict())} with xxh3-128 content hashes)" in capsys.readouterr().out


def _hash_of(folder, tensor):
    from fastckpt import _core

    (tensors, _error), = _core.hash_files([str(folder / "model.safetensors")])
    return dict(tensors)[tensor]

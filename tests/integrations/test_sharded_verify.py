"""A sharded (FSDP2 / DTensor) save records its part files under the manifest's ``"sharded"`` entry; ``fastckpt
verify``, ``verify_checkpoint`` and ``load_state(verify=True)`` check them (size, crc32c, each tensor's crc32c) and
refuse a part file the manifest does not list, and ``fastckpt inspect`` lists them and counts their bytes. The
checkpoint is written by one process in a 1-process gloo group (``fully_shard`` on CPU); this process, without a
process group, checks and loads it."""

from __future__ import annotations

import json
import shutil
import socket

import pytest
import torch
from helpers.common import run_python

import fastckpt
from fastckpt.cli import main as cli
from fastckpt.errors import IntegrityError

SAVE = """
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import fastckpt
dist.init_process_group(backend="gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
fully_shard(m)
opt = torch.optim.AdamW(m.parameters())
m(torch.randn(2, 4)).sum().backward()
opt.step()
fastckpt.save_state(m, opt, output_dir={out!r})
torch.save({{k: v.full_tensor() for k, v in m.state_dict().items()}}, {out!r} + ".pt")
dist.destroy_process_group()
"""
SHARD = "model/shard-00000-of-00001.safetensors"


def _plain() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return m, torch.optim.AdamW(m.parameters())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "ckpt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_python(SAVE.format(port=port, out=str(out)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert isinstance(json.loads((out / "fastckpt.json").read_text()).get("sharded"), dict)
    return out, torch.load(str(out) + ".pt")


def _copy(sharded, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(sharded[0], folder)
    return folder


def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # tensor data
    path.write_bytes(bytes(data))


def test_intact_sharded_checkpoint_verifies_its_part_files(sharded, capsys):
    folder, expected = sharded
    report = fastckpt.verify_checkpoint(folder)
    assert report.files[SHARD] == "ok" and report.files["optimizer/dcp_metadata.json"] == "ok"
    assert report.tensors_checked >= 4 + 12  # the model's 4 and the optimizer's 12 shard tensors, plus RNG
    assert cli(["verify", str(folder)]) == 0
    assert SHARD in capsys.readouterr().out
    model, opt = _plain()
    fastckpt.load_state(model, opt, input_dir=folder, verify=True)
    for k, v in expected.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_flipped_byte_in_a_shard_fails_verify_and_load(sharded, tmp_path, capsys):
    folder = _copy(sharded, tmp_path)
    _flip_last_byte(folder / SHARD)
    with pytest.raises(IntegrityError, match=r"model/shard-00000-of-00001\.safetensors: tensor '1\.weight'"):
        fastckpt.verify_checkpoint(folder)
    assert cli(["verify", str(folder)]) == 1
    assert "shard-00000-of-00001.safetensors" in capsys.readouterr().err
    model, opt = _plain()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(IntegrityError, match=r"model/shard-00000-of-00001\.safetensors"):
        fastckpt.load_state(model, opt, input_dir=folder, verify=True)
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_shard_with_another_size_fails_verify(sharded, tmp_path):
    folder = _copy(sharded, tmp_path)
    with open(folder / "optimizer" / "dcp_metadata.json", "ab") as f:
        f.write(b" ")
    with pytest.raises(IntegrityError, match=r"optimizer/dcp_metadata\.json: \d+ bytes on disk, \d+ recorded"):
        fastckpt.verify_checkpoint(folder)


def test_part_file_missing_from_the_manifest_is_refused(sharded, tmp_path):
    folder = _copy(sharded, tmp_path)
    manifest = json.loads((folder / "fastckpt.json").read_text())
    manifest["sharded"]["files"].pop(SHARD)
    (folder / "fastckpt.json").write_text(json.dumps(manifest))
    _flip_last_byte(folder / SHARD)
    with pytest.raises(IntegrityError, match=r"model/shard-00000-of-00001\.safetensors: not in the manifest"):
        fastckpt.verify_checkpoint(folder)
    model, opt = _plain()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(IntegrityError, match=r"model/shard-00000-of-00001\.safetensors: not in the manifest"):
        fastckpt.load_state(model, opt, input_dir=folder)
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_unlisted_optimizer_json_of_a_sharded_save_is_refused(sharded, tmp_path):
    folder = _copy(sharded, tmp_path)
    manifest = json.loads((folder / "fastckpt.json").read_text())
    manifest["files"].pop("optimizer.json")
    (folder / "fastckpt.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match=r"optimizer\.json: not in the manifest"):
        fastckpt.verify_checkpoint(folder)
    model, opt = _plain()
    with pytest.raises(IntegrityError, match=r"optimizer\.json: not in the manifest"):
        fastckpt.load_state(model, opt, input_dir=folder)


def test_inspect_lists_and_counts_the_part_files(sharded, capsys):
    folder, _ = sharded
    manifest = json.loads((folder / "fastckpt.json").read_text())
    parts = manifest["sharded"]["files"]
    assert cli(["inspect", "--json", str(folder)]) == 0
    desc = json.loads(capsys.readouterr().out)
    listed = {f["file"]: f["bytes"] for f in desc["files"]}
    assert {k: v["bytes"] for k, v in parts.items()}.items() <= listed.items()
    assert SHARD in {t["file"] for t in desc["tensor_files"]}
    model_shards = sum(v["bytes"] for k, v in parts.items() if k.startswith("model/") and k.endswith(".safetensors"))
    optimizer = sum(v["bytes"] for k, v in {**manifest["files"], **parts}.items() if k.startswith("optimizer"))
    assert desc["parts"]["trainable"]["bytes"] == model_shards
    assert desc["parts"]["optimizer"]["bytes"] == optimizer
    assert cli(["inspect", str(folder)]) == 0
    assert SHARD in capsys.readouterr().out

"""Whatever fastckpt writes, it reads: every writer refuses, before anything is written (or committed), what its
reader would refuse, with the limit and the numbers in the message; the limits are one constant each in the Rust
core (``fastckpt._core.MAX_*``), read by both sides.

Limits too large to reach in a test (a 100 MB shard index, a 1 GB DCP metadata file) are lowered by patching the
one constant both sides read, which also proves they share it.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fastckpt
import fastckpt.dcp
import fastckpt.torch as ft
from fastckpt import _core
from fastckpt._io.storage.local.shards import read_index

_OVER = _core.MAX_HEADER_BYTES + 1  # a metadata value this long takes the header over the limit


def test_save_file_refuses_a_header_its_load_file_would_refuse(tmp_path):
    path = tmp_path / "big.safetensors"
    with pytest.raises(ValueError, match=rf"big\.safetensors.*over the limit of {_core.MAX_HEADER_BYTES} bytes"):
        ft.save_file({"w": torch.ones(2)}, path, metadata={"note": "x" * _OVER})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="over the limit"):
        ft.save({"w": torch.ones(2)}, metadata={"note": "x" * _OVER})


def test_a_header_just_under_the_limit_is_written_and_read_back(tmp_path):
    note = "x" * (_core.MAX_HEADER_BYTES - 200)
    path = tmp_path / "fits.safetensors"
    ft.save_file({"w": torch.arange(3.0)}, path, metadata={"note": note})
    assert torch.equal(ft.load_file(path)["w"], torch.arange(3.0))
    with ft.safe_open(path, "pt") as f:
        assert f.metadata()["note"] == note


def test_save_state_refuses_an_optimizer_header_over_the_limit_and_keeps_the_previous_checkpoint(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fastckpt.save_state(model, opt, output_dir=tmp_path / "c")
    previous = {k: v.clone() for k, v in model.state_dict().items()}
    opt.param_groups[0]["note"] = "x" * _OVER  # param_groups go into optimizer.safetensors' metadata
    with torch.no_grad():
        model.weight.add_(1)
    with pytest.raises(ValueError, match=rf"optimizer\.safetensors.*over the limit of {_core.MAX_HEADER_BYTES}"):
        fastckpt.save_state(model, opt, output_dir=tmp_path / "c")
    del opt.param_groups[0]["note"]
    fresh = nn.Linear(2, 2)
    fastckpt.load_state(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), input_dir=tmp_path / "c")
    assert all(torch.equal(v, previous[k]) for k, v in fresh.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_shard_index_over_the_reader_limit_is_refused_at_save(tmp_path, monkeypatch):
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    path = fastckpt.save_state(model, output_dir=tmp_path / "ok", model_only=True, max_shard_size=300)
    index = path / "model.safetensors.index.json"
    size = index.stat().st_size
    monkeypatch.setattr(_core, "MAX_INDEX_BYTES", size - 1)  # the one constant both sides read
    with pytest.raises(Exception, match="index limit"):
        read_index(index)
    with pytest.raises(ValueError, match=rf"shard index would be {size} bytes.*limit of {size - 1}"):
        fastckpt.save_state(model, output_dir=tmp_path / "big", model_only=True, max_shard_size=300)
    assert not (tmp_path / "big").exists()
    assert json.loads(index.read_text())["weight_map"]


def test_dcp_save_refuses_a_tensor_of_more_dimensions_than_its_reader_takes(tmp_path):
    fastckpt.dcp.save({"w": torch.ones(2)}, tmp_path / "c")
    deep = torch.zeros([1] * (_core.MAX_DCP_RANK + 1))
    with pytest.raises(ValueError, match=rf"'deep' has {_core.MAX_DCP_RANK + 1} dimensions"):
        fastckpt.dcp.save({"w": torch.ones(2), "deep": deep}, tmp_path / "c")
    out = {"w": torch.zeros(2)}
    fastckpt.dcp.load(out, tmp_path / "c")  # the previous checkpoint is intact
    assert torch.equal(out["w"], torch.ones(2))


def test_dcp_metadata_over_the_reader_limit_is_refused_at_save(tmp_path, monkeypatch):
    monkeypatch.setattr(_core, "MAX_DCP_METADATA_BYTES", 100)
    with pytest.raises(ValueError, match="over the 100 its reader accepts"):
        fastckpt.dcp.save({"w": torch.ones(2)}, tmp_path / "c")
    assert not (tmp_path / "c").exists()

"""Sharded model and optimizer files (Hugging Face layout): ``max_shard_size`` units, the split rule and index format
(checked against huggingface_hub and the official safetensors writer), loading through the index, and its validation
(C19: missing shards are all named before any weight changes; names outside the folder, misplaced tensors)."""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors.torch as st
import torch
from helpers.common import TiedNet, assert_model_state, batches, make_training_state, model_clone, train
from huggingface_hub import split_torch_state_dict_into_shards
from torch import nn

import fastckpt
from fastckpt._io.sizes import parse_size


class Wide(nn.Module):
    """Five float32 tensors: big (1600 bytes), a.weight (400), a.bias (40), b.weight (400), b.bias (40), in
    state_dict order (a module's own parameters come before its children's)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 10)
        self.b = nn.Linear(10, 10)
        self.big = nn.Parameter(torch.randn(20, 20))


@pytest.mark.parametrize(("size", "expected"), [
    (123, 123),
    ("10GB", 10 * 10**9),
    ("10GiB", 10 * 2**30),
    ("5MB", 5 * 10**6),
    ("5MiB", 5 * 2**20),
    ("3KB", 3000),
    ("3kib", 3 * 1024),
    ("2TB", 2 * 10**12),
    ("1.5GB", 1_500_000_000),
    ("8Gb", 10**9),  # lower-case b: bits, as accelerate and transformers read it
    (" 7 MB ", 7 * 10**6),
])
def test_parse_size_units(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["10", "10XB", "GB", "-1GB", "", "0", 0, -5])
def test_parse_size_rejects(size):
    with pytest.raises(ValueError):
        parse_size(size)


def test_parse_size_rejects_other_types():
    with pytest.raises(TypeError):
        parse_size(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        parse_size(True)  # type: ignore[arg-type]


def test_bad_max_shard_size_writes_nothing(tmp_path):
    with pytest.raises(ValueError):
        fastckpt.save_state(Wide(), output_dir=tmp_path / "c", model_only=True, max_shard_size="lots")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("limit", [500, 1000, 1700, 10**6])
def test_split_matches_huggingface_hub_and_official_writer(tmp_path, limit):
    torch.manual_seed(0)
    model = Wide()
    ckpt = fastckpt.save_state(model, output_dir=tmp_path / "c", model_only=True, max_shard_size=limit)
    sd = dict(model.state_dict())
    hf = split_torch_state_dict_into_shards(sd, max_shard_size=limit)
    if not hf.is_sharded:
        assert not (ckpt / "model.safetensors.index.json").exists()
        assert (ckpt / "model.safetensors").read_bytes() == st.save(sd, metadata={"format": "pt"})
        return
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": sum(t.numel() * 4 for t in sd.values())},
                     "weight_map": hf.tensor_to_filename}
    assert not (ckpt / "model.safetensors").exists()
    for name, keys in hf.filename_to_tensors.items():
        expected = st.save({k: sd[k] for k in keys}, metadata={"format": "pt"})
        assert (ckpt / name).read_bytes() == expected, name
    fresh = Wide()
    assert fastckpt.load_state(fresh, input_dir=ckpt, model_only=True) == ([], [])
    assert_model_state(fresh, model_clone(model))


def test_shard_names_and_index_text(tmp_path):
    ckpt = fastckpt.save_state(Wide(), output_dir=tmp_path / "c", model_only=True, max_shard_size=500)
    names = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("model"))
    # 1600 (over the limit: a shard of its own) | 400+40 | 400+40
    assert names == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map == {"big": "model-00001-of-00003.safetensors", "a.weight": "model-00002-of-00003.safetensors",
                          "a.bias": "model-00002-of-00003.safetensors", "b.weight": "model-00003-of-00003.safetensors",
                          "b.bias": "model-00003-of-00003.safetensors"}
    text = (ckpt / "model.safetensors.index.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"  # transformers' formatting


def test_full_state_sharded_round_trip_with_optimizer_shards(tmp_path):
    model, opt, sched = make_training_state(3)
    train(model, opt, sched, batches(3))
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c", max_shard_size=100)
    names = {p.name for p in ckpt.iterdir()}
    assert "optimizer.safetensors.index.json" in names and "optimizer.safetensors" not in names
    assert any(n.startswith("optimizer-00001-of-") for n in names)
    index = json.loads((ckpt / "optimizer.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {n for n in names if n.startswith("optimizer-")}
    m2, o2, s2 = make_training_state(99)
    fastckpt.load_state(m2, o2, s2, input_dir=ckpt)
    assert_model_state(m2, model_clone(model))
    for (i, a), (j, b) in zip(opt.state_dict()["state"].items(), o2.state_dict()["state"].items()):
        assert i == j and a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (i, k)
    assert o2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert s2.state_dict() == sched.state_dict()


def test_tensor_over_the_limit_gets_its_own_shard(tmp_path):
    torch.manual_seed(0)
    model = Wide()  # big (1600 bytes) is over a 1000-byte limit
    ckpt = fastckpt.save_state(model, output_dir=tmp_path / "c", model_only=True, max_shard_size=1000)
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    big_shard = weight_map["big"]
    assert [k for k, v in weight_map.items() if v == big_shard] == ["big"]
    assert (ckpt / big_shard).stat().st_size > 1000


class TiedPlus(TiedNet):
    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(4, 4)


def test_tied_weights_across_shards_stay_tied(tmp_path):
    torch.manual_seed(4)
    model = TiedPlus()
    ckpt = fastckpt.save_state(model, output_dir=tmp_path / "c", model_only=True, max_shard_size=8)
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(weight_map) == ["emb.weight", "extra.bias", "extra.weight"]  # head.weight: one copy only
    assert st.load_file(ckpt / weight_map["emb.weight"]).keys() == {"emb.weight"}
    with st.safe_open(ckpt / weight_map["emb.weight"], "pt") as f:
        assert f.metadata() == {"format": "pt", "head.weight": "emb.weight"}  # the alias sits with its tensor
    with st.safe_open(ckpt / weight_map["extra.bias"], "pt") as f:
        assert f.metadata() == {"format": "pt"}
    fresh = TiedPlus()
    assert fastckpt.load_state(fresh, input_dir=ckpt, model_only=True) == ([], [])
    assert_model_state(fresh, model_clone(model))
    assert fresh.head.weight is fresh.emb.weight


def test_utf8_names_in_the_shard_index(tmp_path):
    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            for i, name in enumerate(["权重", "poids_é", "w_🙂"]):
                self.register_buffer(name, torch.full((4,), float(i)))

    model = Named()
    ckpt = fastckpt.save_state(model, output_dir=tmp_path / "c", model_only=True, max_shard_size=16)
    raw = (ckpt / "model.safetensors.index.json").read_text(encoding="utf-8")
    assert "权重" in raw and "poids_é" in raw and "w_🙂" in raw  # written raw, not \u-escaped
    assert set(json.loads(raw)["weight_map"]) == {"权重", "poids_é", "w_🙂"}
    fresh = Named()
    for b in fresh.buffers():
        b.zero_()
    fastckpt.load_state(fresh, input_dir=ckpt, model_only=True)
    assert_model_state(fresh, model_clone(model))


def _sharded(tmp_path, limit=500):
    torch.manual_seed(0)
    model = Wide()
    ckpt = fastckpt.save_state(model, output_dir=tmp_path / "c", model_only=True, max_shard_size=limit)
    (ckpt / "fastckpt.json").unlink()  # a foreign (Hugging Face) folder: no manifest to check sizes against
    return model, ckpt


def test_c19_missing_shards_all_named_before_any_weight_changes(tmp_path):
    model, ckpt = _sharded(tmp_path)
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    (ckpt / "model-00003-of-00003.safetensors").unlink()
    live = Wide()
    before = model_clone(live)
    with pytest.raises(fastckpt.MissingStateError) as info:
        fastckpt.load_state(live, input_dir=ckpt, model_only=True)
    message = str(info.value)
    assert "['model-00002-of-00003.safetensors', 'model-00003-of-00003.safetensors']" in message
    assert "2 of 3" in message
    assert_model_state(live, before)
    assert isinstance(info.value, FileNotFoundError)


def test_c19_missing_shard_in_a_fastckpt_checkpoint(tmp_path):
    model, opt, sched = make_training_state(1)
    train(model, opt, sched, batches(1))
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c", max_shard_size=100)
    victim = sorted(p for p in ckpt.iterdir() if p.name.startswith("model-"))[-1]
    victim.unlink()
    live, lopt, lsched = make_training_state(7)
    before = model_clone(live)
    with pytest.raises(fastckpt.CheckpointError) as info:
        fastckpt.load_state(live, lopt, lsched, input_dir=ckpt)
    assert victim.name in str(info.value)
    assert_model_state(live, before)
    assert lopt.state_dict()["state"] == {}


@pytest.mark.parametrize("bad", ["../evil.safetensors", "/tmp/evil.safetensors", "sub/x.safetensors",
                                 "..\\x.safetensors", "model-00001-of-00004.bin", "", ".."])
def test_index_shard_names_must_be_plain_files_inside_the_folder(tmp_path, bad):
    model, ckpt = _sharded(tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["a.weight"] = bad
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    live = Wide()
    before = model_clone(live)
    with pytest.raises(fastckpt.HeaderError) as info:
        fastckpt.load_state(live, input_dir=ckpt, model_only=True)
    assert repr(bad) in str(info.value)
    assert_model_state(live, before)


def test_tensor_not_where_the_index_says(tmp_path):
    model, ckpt = _sharded(tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["a.weight"], index["weight_map"]["big"] = (index["weight_map"]["big"],
                                                                   index["weight_map"]["a.weight"])
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    live = Wide()
    before = model_clone(live)
    with pytest.raises(fastckpt.IntegrityError) as info:
        fastckpt.load_state(live, input_dir=ckpt, model_only=True)
    assert "'a.weight'" in str(info.value) and "'big'" in str(info.value)
    assert_model_state(live, before)


def test_shard_holding_a_tensor_the_index_omits(tmp_path):
    model, ckpt = _sharded(tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"]["a.bias"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(fastckpt.IntegrityError, match="a.bias"):
        fastckpt.load_state(Wide(), input_dir=ckpt, model_only=True)


def test_index_that_is_not_json(tmp_path):
    model, ckpt = _sharded(tmp_path)
    (ckpt / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(fastckpt.HeaderError, match="not valid JSON"):
        fastckpt.load_state(Wide(), input_dir=ckpt, model_only=True)


def test_huggingface_sharded_folder_loads(tmp_path):
    """A folder written by huggingface_hub's own sharded writer (no manifest) loads model-only."""
    from huggingface_hub import save_torch_state_dict

    torch.manual_seed(2)
    model = Wide()
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(dict(model.state_dict()), tmp_path / "hf", max_shard_size=500)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    fresh = Wide()
    fastckpt.load_state(fresh, input_dir=tmp_path / "hf", model_only=True)
    assert_model_state(fresh, model_clone(model))
    shutil.rmtree(tmp_path / "hf")

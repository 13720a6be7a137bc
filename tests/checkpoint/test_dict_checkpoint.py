"""``fastckpt.save`` / ``fastckpt.load``: plain checkpoint dicts round-trip exactly, without pickle by default."""

from __future__ import annotations

import collections
import json
import math
import os

import numpy as np
import pytest
import safetensors.torch
import torch

import fastckpt
from fastckpt.errors import HeaderError, IntegrityError, MissingStateError, UnsafePickleError


def same(a, b, path="obj"):
    """Equal values of equal types, tensors by ``torch.equal`` and dtype (nan equals nan)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
        assert a.requires_grad == b.requires_grad, path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def trained_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_training_dict_round_trips_with_every_type(tmp_path):
    model, opt = trained_adamw()
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4])
    obj = {
        "state_dict": model.state_dict(),  # an OrderedDict
        "optimizer_states": [opt.state_dict()],  # integer keys, tuple betas, None foreach
        "lr_schedulers": [sched.state_dict()],  # a Counter of milestones
        3: ("a", None, float("inf"), -float("inf"), float("nan"), -0.0, 2**70),
        (1, "x"): [True, np.float32(1.5), np.int64(-3), np.bool_(True), np.arange(3, dtype=np.int16)],
        "types": {"dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3])},
        "sets": ({1, 2}, frozenset({"a"})),
        "bytes": b"\x00\xff",
        "nested": collections.OrderedDict([("b", 1), ("a", {"__tuple__": 1})]),  # a key that looks like a tag
        "empty": ({}, [], (), torch.empty(0, 3)),
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    fastckpt.save(obj, tmp_path / "ckpt")
    back = fastckpt.load(tmp_path / "ckpt")
    same(obj, back)
    assert type(back["state_dict"]) is collections.OrderedDict
    assert list(back["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    # the loaded optimizer state restores an optimizer exactly
    _, fresh = trained_adamw()
    fresh.load_state_dict(back["optimizer_states"][0])
    same(fresh.state_dict(), opt.state_dict())


def test_flat_tensor_dict_is_a_plain_safetensors_file(tmp_path):
    torch.manual_seed(0)
    sd = {"w": torch.randn(5, 7), "b": torch.arange(4, dtype=torch.int32), "h": torch.randn(3).half(),
          "t": torch.randn(6, 4).t()}  # non-contiguous: written in row-major order
    fastckpt.save(sd, tmp_path / "ckpt")
    official = safetensors.torch.load_file(tmp_path / "ckpt" / "state.safetensors")
    assert list(official) == sorted(sd) or set(official) == set(sd)
    for k, v in sd.items():
        assert official[k].dtype == v.dtype and torch.equal(official[k], v)
    assert safetensors.torch.load(safetensors.torch.save({k: v.contiguous() for k, v in sd.items()})).keys() \
        == official.keys()
    with open(tmp_path / "ckpt" / "state.safetensors", "rb") as f:
        raw = f.read()
    assert raw == safetensors.torch.save({k: v.contiguous() for k, v in sd.items()}, metadata={"format": "pt"})


def test_tied_tensors_are_stored_once_and_tied_again(tmp_path):
    shared = torch.randn(64, 64)
    other_view = shared.view(64, 64)  # another object, the same view
    obj = {"a": shared, "b": [shared, other_view], "c": shared[1:]}
    fastckpt.save(obj, tmp_path / "ckpt")
    official = safetensors.torch.load_file(tmp_path / "ckpt" / "state.safetensors")
    assert sorted(official) == ["a", "c"]  # b[0], b[1] are aliases of a; c only overlaps, stored apart
    back = fastckpt.load(tmp_path / "ckpt")
    assert back["b"][0] is back["a"]
    assert back["b"][1] is not back["a"] and back["b"][1].data_ptr() == back["a"].data_ptr()
    assert torch.equal(back["c"], shared[1:])
    manifest = json.loads((tmp_path / "ckpt" / "fastckpt.json").read_text())
    assert manifest["layout"] == "dict" and set(manifest["files"]) == {"state.json", "state.safetensors"}


class Custom:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Custom) and other.x == self.x


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize("value, where", [
    (Custom(1), "checkpoint.hyper_parameters.model"),
    (Point(1, 2), "checkpoint.hyper_parameters.model"),
    (print, "checkpoint.hyper_parameters.model"),
    (collections.defaultdict(int), "checkpoint.hyper_parameters.model"),
])
def test_values_needing_pickle_are_refused_naming_the_key_path(tmp_path, value, where):
    obj = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"model": value}}
    with pytest.raises(TypeError, match=rf"^{where.replace('.', '[.]')} is a .*trust_pickle=True"):
        fastckpt.save(obj, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_trust_pickle_writes_one_pickle_part_read_only_when_trusted(tmp_path):
    obj = {"w": torch.ones(3), "hp": {"obj": Custom(5), "pt": Point(1, torch.zeros(2))}, "n": 1}
    fastckpt.save(obj, tmp_path / "ckpt", trust_pickle=True)
    manifest = json.loads((tmp_path / "ckpt" / "fastckpt.json").read_text())
    assert manifest["pickle_part"] == "state.pkl" and "state.pkl" in manifest["files"]
    assert manifest["pickled"] == ["checkpoint.hp.obj", "checkpoint.hp.pt"]
    with pytest.raises(UnsafePickleError, match=r"state\.pkl.*checkpoint\.hp\.obj, checkpoint\.hp\.pt.*trust_pickle"):
        fastckpt.load(tmp_path / "ckpt")
    back = fastckpt.load(tmp_path / "ckpt", trust_pickle=True)
    assert back["hp"]["obj"] == Custom(5) and type(back["hp"]["pt"]) is Point
    assert torch.equal(back["hp"]["pt"].y, torch.zeros(2)) and torch.equal(back["w"], torch.ones(3))


def test_load_checks_files_and_refuses_other_layouts(tmp_path):
    fastckpt.save({"w": torch.arange(1000.0)}, tmp_path / "ckpt")
    fastckpt.save_state(torch.nn.Linear(2, 2), output_dir=tmp_path / "state")
    with pytest.raises(MissingStateError, match="fastckpt.load_state"):
        fastckpt.load(tmp_path / "state")
    with pytest.raises(MissingStateError, match="fastckpt.load"):
        fastckpt.load_state(torch.nn.Linear(2, 2), input_dir=tmp_path / "ckpt")
    with pytest.raises(MissingStateError):
        fastckpt.load(tmp_path / "nothing")
    path = tmp_path / "ckpt" / "state.safetensors"
    data = bytearray(path.read_bytes())
    data[-4:] = b"\x00\x00\x80\x7f"  # same size, other bytes
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"state\.safetensors.*crc32c"):
        fastckpt.load(tmp_path / "ckpt", verify=True)


def test_hostile_structure_is_a_header_error(tmp_path):
    fastckpt.save({"w": torch.ones(2), "n": 1}, tmp_path / "ckpt")
    structure_path = tmp_path / "ckpt" / "state.json"
    manifest_path = tmp_path / "ckpt" / "fastckpt.json"
    good = json.loads(structure_path.read_text())

    def write(structure):
        data = json.dumps(structure).encode()
        structure_path.write_bytes(data)
        manifest = json.loads(manifest_path.read_text())  # a consistent manifest: the structure itself is hostile
        from fastckpt import _core
        manifest["files"]["state.json"] = {"bytes": len(data), "crc32c": f"{_core.crc32c(data):08x}"}
        manifest_path.write_text(json.dumps(manifest))

    for bad, match in [
        ({**good, "object": {"w": {"__torch_dtype__": "load"}}}, "not a torch dtype"),
        ({**good, "object": {"n": 1}}, "no key refers to"),  # the tensor w would be dropped
        ({**good, "object": {"w": {"__tensor__": "x"}}}, "does not hold"),
        ({**good, "object": {"a": {"__tensor__": "w"}, "b": {"__tensor__": "w"}}}, "twice"),
        ({**good, "object": {"w": {"__pickled__": 0}}}, r"not in state\.pkl"),
        ({**good, "version": 2}, "version 2"),
        ({**good, "aliases": {"z": "missing"}}, "does not hold"),
        ([1, 2], "expected a JSON dict"),
    ]:
        write(bad)
        with pytest.raises(HeaderError, match=match):
            fastckpt.load(tmp_path / "ckpt")


def test_map_location_and_overwrite_keeps_only_new_files(tmp_path):
    fastckpt.save({"w": torch.ones(2), "x": Custom(1)}, tmp_path / "ckpt", trust_pickle=True)
    fastckpt.save({"w": torch.zeros(2)}, tmp_path / "ckpt")  # replaces the folder: no stale pickle part
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["fastckpt.json", "state.json", "state.safetensors"]
    back = fastckpt.load(tmp_path / "ckpt", map_location="cpu")
    assert torch.equal(back["w"], torch.zeros(2))
    back = fastckpt.load(tmp_path / "ckpt", map_location={"cpu": "meta"})
    assert back["w"].device.type == "meta"
    with pytest.raises(ValueError, match="map_location"):
        fastckpt.load(tmp_path / "ckpt", map_location="nodevice")


def test_async_save_streams_and_blocks_only_the_next_step(tmp_path):
    model, opt = trained_adamw()
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}}
    handle = fastckpt.save({"model": model.state_dict(), "optimizer": opt.state_dict()["state"]},
                           tmp_path / "ckpt", async_save=True, optimizers=[opt])
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # waits for (copies) what is not yet written; the checkpoint keeps the values of the call
    assert handle.wait() == (tmp_path / "ckpt").absolute()
    back = fastckpt.load(tmp_path / "ckpt")
    same(expected["model"], dict(back["model"]), "model")
    same(expected["optimizer"], back["optimizer"], "optimizer")
    before = model[0].weight.detach().clone()
    snap = fastckpt.save({"w": model[0].weight}, tmp_path / "snap", async_save="snapshot")
    with torch.no_grad():
        model[0].weight.add_(1.0)  # after a snapshot returns, changes are not seen
    snap.wait()
    loaded = fastckpt.load(tmp_path / "snap")["w"]
    assert type(loaded) is torch.nn.Parameter and loaded.requires_grad and torch.equal(loaded, before)


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="dict, list or tuple"):
        fastckpt.save(torch.ones(2), tmp_path / "x")
    with pytest.raises(ValueError, match="async_save"):
        fastckpt.save({}, tmp_path / "x", async_save="yes")
    with pytest.raises(TypeError, match="optimizers"):
        fastckpt.save({}, tmp_path / "x", optimizers=["sgd"])


@pytest.mark.parametrize("url", ["gs://b/x", "hf://b/x", "az://b/x", "s3://b/x", "file:///tmp/x"])
def test_urls_are_refused_before_anything_is_written(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    scheme = url.split("://", 1)[0]
    with pytest.raises(ValueError, match=scheme):
        fastckpt.save({"w": torch.ones(2)}, url)
    with pytest.raises(ValueError, match=scheme):
        fastckpt.load(url)
    assert os.listdir(tmp_path) == []  # no local folder named after the URL


def test_every_load_sums_the_tensor_file_and_verify_false_skips_only_that(tmp_path):
    path = tmp_path / "ck"
    fastckpt.save({"w": torch.arange(1024, dtype=torch.float32), "step": 3}, path)
    data = bytearray((path / "state.safetensors").read_bytes())
    data[-5] ^= 0x01  # one bit of the last tensor byte region
    (path / "state.safetensors").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="state.safetensors"):
        fastckpt.load(path)  # the default
    got = fastckpt.load(path, verify=False)
    assert got["step"] == 3 and not torch.equal(got["w"], torch.arange(1024, dtype=torch.float32))


def test_async_save_with_optimizers_never_commits_a_data_write_made_after_the_call(tmp_path):
    from fastckpt.errors import ConcurrentModificationError

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    fastckpt.save({"model": model.state_dict()}, tmp_path / "ck")  # the previous checkpoint
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = fastckpt.save({"model": model.state_dict()}, tmp_path / "ck", async_save=True, optimizers=[opt])
    for p in model.parameters():
        p.data.mul_(0.5)  # bypasses the version counters
    try:
        handle.wait()
    except ConcurrentModificationError:
        pass  # refused: the previous checkpoint stays
    got = fastckpt.load(tmp_path / "ck")["model"]
    assert all(torch.equal(got[k], before[k]) for k in before)  # the state at the call (or the same previous one)

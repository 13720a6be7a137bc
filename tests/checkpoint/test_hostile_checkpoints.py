"""Hostile checkpoint folders: malformed manifests, hostile JSON in every JSON slot of a checkpoint (scheduler state,
optimizer and RNG metadata), a shard index pointing outside the folder: each is a ``HeaderError`` naming the file,
raised before any live object changes. Nothing on the load path unpickles untrusted data by default."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from helpers.common import assert_model_state, batches, make_training_state, model_clone, train
from helpers.fault_log import record

import fastckpt
import fastckpt.torch as ft

# --------------------------------------------------------------------------------------------------------------
# hostile manifests and checkpoint JSON: refused before anything is changed
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    model, opt, sched = make_training_state(seed=5)
    train(model, opt, sched, batches(2))
    return fastckpt.save_state(model, opt, sched, output_dir=tmp_path_factory.mktemp("hostile") / "ck")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


MANIFEST_EDITS = {
    "name_parent": lambda m: m["files"].update({"../outside.safetensors": {"bytes": 1}}),
    "name_absolute": lambda m: m["files"].update({"/etc/passwd": {"bytes": 1}}),
    "name_subfolder": lambda m: m["files"].update({"sub/x.json": {"bytes": 1}}),
    "name_empty": lambda m: m["files"].update({"": {"bytes": 1}}),
    "files_list": lambda m: m.update(files=["model.safetensors"]),
    "bytes_negative": lambda m: m["files"]["model.safetensors"].update(bytes=-1),
    "bytes_string": lambda m: m["files"]["model.safetensors"].update(bytes="12"),
    "bytes_bool": lambda m: m["files"]["model.safetensors"].update(bytes=True),
    "crc_not_hex": lambda m: m["files"]["model.safetensors"].update(crc32c="zzzzzzzz"),
    "crc_int": lambda m: m["files"]["model.safetensors"].update(crc32c=1234),
    "tensor_crc_int": lambda m: m["files"]["model.safetensors"].update(tensors={"fc1.weight": 5}),
    "models_string": lambda m: m.update(models="one"),
    "models_negative": lambda m: m.update(models=-1),
    "step_float": lambda m: m.update(step=1.5),
    "mode_int": lambda m: m.update(mode=3),
    "version_99": lambda m: m.update(format_version=99),
    "not_fastckpt": lambda m: m.update(format="other"),
}


@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS))
def test_hostile_manifest_is_a_header_error_before_anything_changes(saved_checkpoint, tmp_path, edit):
    ck = _copy(saved_checkpoint, tmp_path / "ck")
    manifest = json.loads((ck / "fastckpt.json").read_text())
    MANIFEST_EDITS[edit](manifest)
    (ck / "fastckpt.json").write_text(json.dumps(manifest))
    live, lopt, lsched = make_training_state(seed=9)
    before = model_clone(live)
    with pytest.raises(fastckpt.HeaderError) as info:
        fastckpt.load_state(live, lopt, lsched, input_dir=ck)
    assert "fastckpt.json" in str(info.value)
    assert_model_state(live, before)
    assert lopt.state_dict()["state"] == {}
    with pytest.raises(fastckpt.HeaderError):
        fastckpt.verify_checkpoint(ck)
    record("malformed")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\"x\"", "\xff"])
def test_manifest_not_a_json_object(saved_checkpoint, tmp_path, text):
    ck = _copy(saved_checkpoint, tmp_path / "ck")
    (ck / "fastckpt.json").write_bytes(text.encode("latin-1"))
    live, lopt, lsched = make_training_state(seed=9)
    before = model_clone(live)
    with pytest.raises(fastckpt.HeaderError):
        fastckpt.load_state(live, lopt, lsched, input_dir=ck)
    assert_model_state(live, before)
    record("malformed")


HOSTILE_JSON = {
    "deep_list": "[" * 100_000 + "]" * 100_000,
    "deep_object": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "a_list": "[1, 2]",
    "a_string": '"x"',
    "huge_int": "9" * 5000,
    "null": "null",
}


def _rewrite(ck: Path, name: str, data: bytes) -> None:
    """Put ``data`` at ``ck/name`` and record its size (no checksum): a damaged file with a consistent manifest."""
    (ck / name).write_bytes(data)
    manifest = json.loads((ck / "fastckpt.json").read_text())
    manifest["files"][name] = {"bytes": len(data)}
    (ck / "fastckpt.json").write_text(json.dumps(manifest))


def _with_metadata(path: Path, key: str, value: str) -> bytes:
    tensors = {k: v.clone() for k, v in ft.load_file(path).items()}
    with ft.safe_open(path, "pt") as f:
        metadata = dict(f.metadata() or {})
    metadata[key] = value
    return ft.save(tensors, metadata)


SLOTS = {
    "scheduler.json": lambda ck, v: _rewrite(ck, "scheduler.json", v.encode()),
    "optimizer param_groups": lambda ck, v: _rewrite(
        ck, "optimizer.safetensors", _with_metadata(ck / "optimizer.safetensors", "param_groups", v)),
    "optimizer state_names": lambda ck, v: _rewrite(
        ck, "optimizer.safetensors", _with_metadata(ck / "optimizer.safetensors", "state_names", v)),
    "optimizer extra_state": lambda ck, v: _rewrite(
        ck, "optimizer.safetensors", _with_metadata(ck / "optimizer.safetensors", "extra_state", v)),
    "rng python": lambda ck, v: _rewrite(
        ck, "random_states_0.safetensors", _with_metadata(ck / "random_states_0.safetensors", "python", v)),
    "rng numpy": lambda ck, v: _rewrite(
        ck, "random_states_0.safetensors", _with_metadata(ck / "random_states_0.safetensors", "numpy", v)),
}


@pytest.mark.parametrize("slot", sorted(SLOTS))
@pytest.mark.parametrize("value", sorted(HOSTILE_JSON))
def test_hostile_checkpoint_json_is_refused_before_anything_changes(saved_checkpoint, tmp_path, slot, value):
    ck = _copy(saved_checkpoint, tmp_path / "ck")
    SLOTS[slot](ck, HOSTILE_JSON[value])
    live, lopt, lsched = make_training_state(seed=9)
    before, sched_before = model_clone(live), lsched.state_dict()
    with pytest.raises(fastckpt.HeaderError) as info:
        fastckpt.load_state(live, lopt, lsched, input_dir=ck)
    file = {"scheduler.json": "scheduler.json", "optimizer": "optimizer.safetensors", "rng": "random_states_0"}
    assert file[slot.split()[0]] in str(info.value), info.value
    assert_model_state(live, before)
    assert lopt.state_dict()["state"] == {} and lsched.state_dict() == sched_before
    record("malformed")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_a_shard_index_pointing_outside_the_folder(tmp_path, shard):
    model, opt, sched = make_training_state(seed=6)
    ck = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "sharded", max_shard_size=200)
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = shard
    _rewrite(ck, "model.safetensors.index.json", json.dumps(index).encode())
    live, lopt, lsched = make_training_state(seed=9)
    before = model_clone(live)
    with pytest.raises(fastckpt.HeaderError) as info:
        fastckpt.load_state(live, lopt, lsched, input_dir=ck)
    assert "model.safetensors.index.json" in str(info.value) and repr(shard) in str(info.value)
    assert_model_state(live, before)
    record("malformed")


# --------------------------------------------------------------------------------------------------------------
# no unpickling of untrusted data by default
# --------------------------------------------------------------------------------------------------------------


def test_no_load_path_unpickles_without_weights_only():
    """Every ``torch.load`` in the package passes ``weights_only``; ``weights_only=False`` appears once, behind
    ``trust_pickle``; ``pickle.load(s)`` and ``Unpickler`` are never called."""
    package = Path(fastckpt.__file__).parent
    unsafe = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name in ("pickle.load", "pickle.loads", "pickle.Unpickler", "cloudpickle.load", "dill.load"):
                unsafe.append(f"{path.name}:{node.lineno} {name}")
            if name == "torch.load":
                kw = {k.arg: k.value for k in node.keywords}
                if "weights_only" not in kw:
                    unsafe.append(f"{path.name}:{node.lineno} torch.load without weights_only")
                elif not (isinstance(kw["weights_only"], ast.Constant) and kw["weights_only"].value is True):
                    func = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                                and f.lineno <= node.lineno <= f.end_lineno)
                    if "trust_pickle" not in ast.unparse(func):
                        unsafe.append(f"{path.name}:{node.lineno} weights_only not True outside trust_pickle")
    assert unsafe == []


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_malicious_pickle_in_an_accelerate_folder_never_runs(tmp_path):
    model, opt, sched = make_training_state(seed=3)
    train(model, opt, sched, batches(1))
    ck = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "stock", compat="accelerate")
    (ck / "fastckpt.json").unlink()  # now a stock accelerate folder
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [], "x": _Payload(str(marker))}, ck / "optimizer.bin")
    live, lopt, lsched = make_training_state(seed=4)
    before = model_clone(live)
    with pytest.raises(fastckpt.UnsafePickleError) as info:
        fastckpt.load_state(live, lopt, lsched, input_dir=ck)
    assert "optimizer.bin" in str(info.value)
    assert not marker.exists(), "the payload ran"
    assert_model_state(live, before)
    record("malformed")


def test_a_folder_in_place_of_model_safetensors_is_named_as_a_folder(tmp_path):
    """Issue 27 item 8: not "4096 bytes on disk, 37720 recorded" (the folder's inode size) but what is there."""
    model = torch.nn.Linear(4, 3)
    folder = fastckpt.save_state(model, output_dir=tmp_path / "ckpt")
    recorded = json.loads((folder / "fastckpt.json").read_text())["files"]["model.safetensors"]["bytes"]
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    want = (f"{folder / 'model.safetensors'}: is a directory, not the file of {recorded} bytes fastckpt.json records; "
            "something replaced it after the save: put the file back or save again")
    fresh = torch.nn.Linear(4, 3)
    before = [t.clone() for t in fresh.state_dict().values()]
    with pytest.raises(fastckpt.IntegrityError) as info:
        fastckpt.load_state(fresh, input_dir=folder, model_only=True)
    assert str(info.value) == want
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.state_dict().values()))
    report = fastckpt.check_checkpoint(folder)
    assert report.files["model.safetensors"] == want and not report.ok

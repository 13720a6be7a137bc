"""A hand-edited manifest cannot vouch for a file it does not list: ``verify_checkpoint``, ``fastckpt verify`` and
``load_state(verify=True)`` refuse a file a load opens that ``fastckpt.json`` leaves out (IntegrityError naming it,
"not in the manifest"), and so does a plain ``load_state``, before anything changes. ``read_manifest`` checks
``mode`` (HeaderError) and that ``models`` / ``optimizers`` / ``schedulers`` match the files listed
(MissingStateError naming the first missing one)."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.common import assert_model_state, batches, make_training_state, model_clone, train

import fastckpt
from fastckpt._io.storage.local.layout import read_manifest
from fastckpt.cli import main as cli
from fastckpt.errors import HeaderError, IntegrityError, MissingStateError


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A committed full checkpoint and the model state it holds."""
    model, opt, sched = make_training_state(seed=31)
    train(model, opt, sched, batches(2))
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path_factory.mktemp("edits") / "good")
    return ckpt, model_clone(model)


def _edited(good, tmp_path, edit):
    ckpt, _ = good
    folder = tmp_path / "edited"
    shutil.copytree(ckpt, folder)
    manifest = json.loads((folder / "fastckpt.json").read_text())
    edit(manifest)
    (folder / "fastckpt.json").write_text(json.dumps(manifest))
    return folder


def _flip(path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_unlisted_model_file_fails_verify_and_load(good, tmp_path, capsys):
    folder = _edited(good, tmp_path, lambda m: m["files"].pop("model.safetensors"))
    _flip(folder / "model.safetensors")  # the last byte: tensor data
    with pytest.raises(IntegrityError, match=r"model\.safetensors: not in the manifest"):
        fastckpt.verify_checkpoint(folder)
    report = fastckpt.check_checkpoint(folder)
    assert not report.ok and "not in the manifest" in report.files["model.safetensors"]
    assert cli(["verify", str(folder)]) == 1
    assert "not in the manifest" in capsys.readouterr().err
    model, opt, sched = make_training_state(seed=5)
    before = model_clone(model)
    for verify in (True, False):
        with pytest.raises(IntegrityError, match=r"model\.safetensors: not in the manifest"):
            fastckpt.load_state(model, opt, sched, input_dir=folder, verify=verify)
        assert_model_state(model, before)  # nothing changed


@pytest.mark.parametrize("name", ["optimizer.safetensors", "scheduler.json", "random_states_0.safetensors"])
def test_unlisted_state_files_are_refused(good, tmp_path, name):
    folder = _edited(good, tmp_path, lambda m: m["files"].pop(name))
    with pytest.raises(IntegrityError, match=rf"{name}: not in the manifest"):
        fastckpt.verify_checkpoint(folder)
    model, opt, sched = make_training_state(seed=5)
    before = model_clone(model)
    with pytest.raises(IntegrityError, match=rf"{name}: not in the manifest"):
        fastckpt.load_state(model, opt, sched, input_dir=folder)
    assert_model_state(model, before)


def test_intact_checkpoint_still_verifies_and_loads(good):
    ckpt, expected = good
    assert fastckpt.verify_checkpoint(ckpt).ok
    model, opt, sched = make_training_state(seed=5)
    fastckpt.load_state(model, opt, sched, input_dir=ckpt, verify=True)
    assert_model_state(model, expected)


@pytest.mark.parametrize("mode", ["partial", "", None, 3])
def test_bad_mode_is_a_header_error(good, tmp_path, mode):
    folder = _edited(good, tmp_path, lambda m: m.__setitem__("mode", mode))
    with pytest.raises(HeaderError, match="'mode' must be 'full' or 'model_only'"):
        read_manifest(folder)
    model, opt, sched = make_training_state(seed=5)
    with pytest.raises(HeaderError, match="'mode'"):
        fastckpt.load_state(model, opt, sched, input_dir=folder)


@pytest.mark.parametrize(("key", "value", "missing"), [
    ("models", 2, "model_1.safetensors"),
    ("optimizers", 3, "optimizer_1.safetensors, optimizer_2.safetensors"),
    ("schedulers", 2, "scheduler_1.json"),
])
def test_counts_must_match_the_files(good, tmp_path, key, value, missing):
    folder = _edited(good, tmp_path, lambda m: m.__setitem__(key, value))
    with pytest.raises(MissingStateError, match="(?s)" + missing.replace(", ", ": missing.*")):
        read_manifest(folder)
    with pytest.raises(IntegrityError, match="(?s)" + missing.replace(", ", ": missing.*")):
        fastckpt.verify_checkpoint(folder)  # reported with the other problems
    model, opt, sched = make_training_state(seed=5)
    before = model_clone(model)
    with pytest.raises(MissingStateError, match=missing.split(",")[0]):
        fastckpt.load_state(model, opt, sched, input_dir=folder)
    assert_model_state(model, before)


@pytest.mark.parametrize("value", [-1, True, 1.0, "1"])
def test_counts_must_be_non_negative_ints(good, tmp_path, value):
    folder = _edited(good, tmp_path, lambda m: m.__setitem__("models", value))
    with pytest.raises(HeaderError, match="'models' must be a non-negative integer"):
        read_manifest(folder)


def test_a_manifest_nested_past_the_recursion_limit_is_a_header_error(good, tmp_path, capsys):
    """``{"a":`` 100,000 times: every reader of ``fastckpt.json`` (load, verify, the CLI)
    raises HeaderError naming the file, never Python's bare RecursionError; nothing is changed."""
    folder = tmp_path / "project" / "checkpoints" / "checkpoint_0"
    shutil.copytree(good[0], folder)
    (folder / "fastckpt.json").write_text('{"a":' * 100_000)
    model, opt, sched = make_training_state(seed=5)
    before = model_clone(model)
    with pytest.raises(HeaderError, match=r"checkpoint_0/fastckpt\.json: not valid JSON"):
        fastckpt.load_state(model, opt, sched, input_dir=folder)
    assert_model_state(model, before)
    with pytest.raises(HeaderError, match=r"checkpoint_0/fastckpt\.json: not valid JSON"):
        fastckpt.verify_checkpoint(folder)
    assert cli(["verify", str(folder)]) == 1  # damaged
    assert "not valid JSON" in capsys.readouterr().err

"""Folders real users have (issue 12, item 11): an input_dir that is a file, a 250-character checkpoint name (hidden staging and lock names stay
within NAME_MAX = 255 bytes), and a parent or a target holding 30,000 files of the user's, which a save must not
list on every save (a listing and a hard link per file made a save 50x slower)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.common import assert_model_state, make_training_state, model_clone

import fastckpt
from fastckpt._io.storage.local import staging

MANY = 30_000


def _fill(folder, n=MANY):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        os.close(os.open(folder / f"data_{i:05d}.txt", os.O_CREAT | os.O_WRONLY, 0o644))


@pytest.fixture
def listings(monkeypatch):
    """Every folder os.listdir / os.scandir is called on, as absolute paths."""
    seen: list[str] = []
    real_listdir, real_scandir = os.listdir, os.scandir

    def listdir(path="."):
        seen.append(os.path.abspath(os.fspath(path)))
        return real_listdir(path)

    def scandir(path="."):
        seen.append(os.path.abspath(os.fspath(path)))
        return real_scandir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(os, "scandir", scandir)
    return seen


def test_a_250_character_folder_name(tmp_path):
    target = tmp_path / ("c" * 250)
    model, opt, sched = make_training_state(0)
    fastckpt.save_state(model, opt, sched, output_dir=target)
    expected = model_clone(model)
    fastckpt.save_state(model, opt, sched, output_dir=target)  # over it: the exchange parks the old tree too
    fresh, fresh_opt, fresh_sched = make_training_state(1)
    fastckpt.load_state(fresh, fresh_opt, fresh_sched, input_dir=target)
    assert_model_state(fresh, expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_a_dead_save_of_a_long_name_is_cleaned_and_its_old_tree_put_back(tmp_path):
    name = "é" * 120  # 240 bytes
    owner = staging.OwnedPath(tmp_path, name)
    assert len(os.fsencode(owner.lock_path.name)) <= 255
    parked = owner.path.with_name(owner.path.name + ".old.1")
    parked.mkdir()
    (parked / "fastckpt.json").write_text("{}")
    os.close(owner._fd)  # the owner dies with its old tree parked and the target missing
    owner._fd = None
    staging.clean_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    assert (tmp_path / name / "fastckpt.json").read_text() == "{}"


def test_a_parent_holding_30000_files_is_not_listed_on_every_save(tmp_path, listings):
    parent = tmp_path / "runs"
    _fill(parent)
    model, opt, sched = make_training_state(0)
    fastckpt.save_state(model, opt, sched, output_dir=parent / "ckpt")
    listings.clear()
    for _ in range(3):
        fastckpt.save_state(model, opt, sched, output_dir=parent / "ckpt")
    assert str(parent) not in listings


def test_a_target_holding_30000_files_is_not_listed_on_every_save(tmp_path, listings):
    target = tmp_path / "ckpt"
    _fill(target)
    model, opt, sched = make_training_state(0)
    fastckpt.save_state(model, opt, sched, output_dir=target)  # stops counting the user's files at 256
    assert json.loads((target / "fastckpt.json").read_text())["commit"] == "in_place"
    listings.clear()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    expected = model_clone(model)
    fastckpt.save_state(model, opt, sched, output_dir=target)
    assert str(target) not in listings and str(tmp_path) not in listings
    assert sum(1 for n in os.listdir(target) if n.startswith("data_")) == MANY
    fresh, fresh_opt, fresh_sched = make_training_state(1)
    fastckpt.load_state(fresh, fresh_opt, fresh_sched, input_dir=target)
    assert_model_state(fresh, expected)


def test_input_dir_that_is_a_file_says_so(tmp_path, new_accelerator):
    import fastckpt.accelerate

    model, opt, sched = make_training_state(0)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c")
    file = ckpt / "model.safetensors"
    with pytest.raises(fastckpt.MissingStateError, match=rf"{file}: is a file, not a checkpoint folder; pass the "
                                                         rf"folder that holds it \({ckpt}\)"):
        fastckpt.load_state(model, input_dir=file, model_only=True)
    with pytest.raises(fastckpt.MissingStateError, match=r"no such checkpoint folder"):
        fastckpt.load_state(model, input_dir=tmp_path / "absent", model_only=True)
    acc = new_accelerator()
    acc.prepare(model)
    with pytest.raises(fastckpt.MissingStateError, match=r"is a file, not a checkpoint folder"):
        fastckpt.accelerate.load_state(acc, file, model_only=True)

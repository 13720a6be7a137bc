"""Automatic naming with model-only snapshots beside full checkpoints (issue 12, item 1): the two kinds are named
and rotated apart (``checkpoints/`` and ``model_only/``), so frequent model-only snapshots never push the resumable
checkpoints out, ``load_state(input_dir=None)`` resumes from the newest full checkpoint, and an explicit
``output_dir`` is always honoured by ``fastckpt.accelerate``."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import ProjectConfiguration
from helpers.accelerate_state import assert_restored, prepared_state, snapshot
from helpers.common import assert_model_state, make_training_state, model_clone

import fastckpt
import fastckpt.accelerate


def _visible(folder):
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


def test_model_only_snapshots_do_not_rotate_full_checkpoints_away(tmp_path):
    model, opt, sched = make_training_state(0)
    full = fastckpt.save_state(model, opt, sched, project_dir=tmp_path, total_limit=2)
    expected = model_clone(model)
    for _ in range(3):  # three model-only snapshots with the same total_limit
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        fastckpt.save_state(model, project_dir=tmp_path, total_limit=2, model_only=True)
    assert _visible(tmp_path / "checkpoints") == [full.name]
    assert _visible(tmp_path / "model_only") == ["checkpoint_1", "checkpoint_2"]
    assert fastckpt.latest_checkpoint(tmp_path) == full
    assert fastckpt.latest_checkpoint(tmp_path, model_only=True) == tmp_path / "model_only" / "checkpoint_2"
    fresh, fresh_opt, fresh_sched = make_training_state(1)
    fastckpt.load_state(fresh, fresh_opt, fresh_sched, project_dir=tmp_path)  # input_dir=None: the full one
    assert_model_state(fresh, expected)


def test_full_load_skips_a_newer_model_only_folder_under_checkpoints(tmp_path):
    """A model-only folder under checkpoints/ (explicit output_dir, or an older fastckpt) is not resumed from and
    is not counted by the rotation of full checkpoints."""
    model, opt, sched = make_training_state(0)
    fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "checkpoints" / "checkpoint_0")
    expected = model_clone(model)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    fastckpt.save_state(model, output_dir=tmp_path / "checkpoints" / "checkpoint_1", model_only=True)
    assert fastckpt.latest_checkpoint(tmp_path).name == "checkpoint_0"
    fresh, fresh_opt, fresh_sched = make_training_state(1)
    fastckpt.load_state(fresh, fresh_opt, fresh_sched, project_dir=tmp_path)
    assert_model_state(fresh, expected)
    fastckpt.save_state(model, opt, sched, project_dir=tmp_path, total_limit=1)  # -> checkpoint_2
    assert _visible(tmp_path / "checkpoints") == ["checkpoint_1", "checkpoint_2"]


def test_accelerate_model_only_snapshots_keep_the_resumable_checkpoint(tmp_path, new_accelerator):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    acc = new_accelerator(project_config=config)
    model, opt, sched = prepared_state(acc, 0, steps=2)
    full = fastckpt.accelerate.save_state(acc)
    expected = snapshot(model, opt, sched)
    for _ in range(2):
        fastckpt.accelerate.save_state(acc, model_only=True)
    assert acc.project_configuration.iteration == 1  # model-only snapshots do not advance the full numbering
    assert _visible(tmp_path / "checkpoints") == [full.name]
    assert _visible(tmp_path / "model_only") == ["checkpoint_1"]
    acc2 = new_accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                               automatic_checkpoint_naming=True))
    model2, opt2, sched2 = prepared_state(acc2, 1, steps=0)
    fastckpt.accelerate.load_state(acc2)
    assert_restored(model2, opt2, sched2, expected)


def test_accelerate_honours_an_explicit_output_dir_with_automatic_naming(tmp_path, new_accelerator):
    config = ProjectConfiguration(project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True,
                                  total_limit=1)
    acc = new_accelerator(project_config=config)
    model, opt, sched = prepared_state(acc, 0, steps=1)
    weights = fastckpt.accelerate.save_state(acc, tmp_path / "weights", model_only=True)
    assert weights == (tmp_path / "weights").absolute()
    assert (tmp_path / "weights" / "model.safetensors").is_file()
    assert not (tmp_path / "proj" / "model_only").exists() and not (tmp_path / "proj" / "checkpoints").exists()
    explicit = fastckpt.accelerate.save_state(acc, tmp_path / "full")
    assert explicit == (tmp_path / "full").absolute() and (tmp_path / "full" / "fastckpt.json").is_file()


def test_accelerate_refuses_a_total_limit_below_one_before_saving(tmp_path, new_accelerator):
    """A total_limit that cannot be kept (0) is refused before anything is written: the save never commits a
    checkpoint and then fails in its rotation."""
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=0)
    acc = new_accelerator(project_config=config)
    prepared_state(acc, 0, steps=1)
    for model_only in (False, True):
        with pytest.raises(ValueError, match="total_limit must be an int >= 1"):
            fastckpt.accelerate.save_state(acc, model_only=model_only)
    assert _visible(tmp_path / "checkpoints") == [] and _visible(tmp_path / "model_only") == []
    assert acc.project_configuration.iteration == 0
    weights = fastckpt.accelerate.save_state(acc, tmp_path / "named")  # no rotation of a named folder: it saves
    assert (weights / "fastckpt.json").is_file()

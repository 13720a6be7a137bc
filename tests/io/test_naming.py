"""Automatic checkpoint naming ``{project_dir or cwd}/checkpoints/checkpoint_{n}``, ``total_limit`` rotation in
numeric order (C27), ``latest_checkpoint`` and ``load_state(input_dir=None)``; a folder without fastckpt.json is
never chosen as the latest."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.common import assert_model_state, model_clone
from torch import nn

import fastckpt


def _linear(value: float) -> nn.Linear:
    m = nn.Linear(2, 2)
    with torch.no_grad():
        m.weight.fill_(value)
        m.bias.fill_(-value)
    return m


def _committed(project, n: int, value: float | None = None):
    return fastckpt.save_state(_linear(float(n) if value is None else value),
                               output_dir=project / "checkpoints" / f"checkpoint_{n}")


def _names(project) -> list[str]:
    return sorted(p.name for p in (project / "checkpoints").iterdir() if not p.name.startswith("."))


def test_c27_rotation_numeric_order(tmp_path):
    project = tmp_path / "proj"
    for n in (9, 10, 100, 1000):
        _committed(project, n)
    path = fastckpt.save_state(_linear(5.0), project_dir=project, total_limit=2)
    assert path.name == "checkpoint_1001"
    assert path.resolve() == (project / "checkpoints" / "checkpoint_1001").resolve()
    assert _names(project) == ["checkpoint_1000", "checkpoint_1001"]
    latest = fastckpt.latest_checkpoint(project)
    assert latest is not None and latest.name == "checkpoint_1001"
    fresh = _linear(0.0)
    fastckpt.load_state(fresh, project_dir=project)  # input_dir=None: the latest committed one
    assert_model_state(fresh, model_clone(_linear(5.0)))


def test_automatic_naming_counts_up_from_an_empty_project(tmp_path):
    project = tmp_path / "p"
    first = fastckpt.save_state(_linear(1.0), project_dir=project)
    assert first.parent.resolve() == (project / "checkpoints").resolve()
    m = re.fullmatch(r"checkpoint_(\d+)", first.name)
    assert m, first.name
    second = fastckpt.save_state(_linear(2.0), project_dir=project)
    assert second.name == f"checkpoint_{int(m.group(1)) + 1}"
    assert fastckpt.latest_checkpoint(project).resolve() == second.resolve()


def test_automatic_naming_defaults_to_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = fastckpt.save_state(_linear(3.0))
    assert path.parent.resolve() == (tmp_path / "checkpoints").resolve()
    assert fastckpt.latest_checkpoint().resolve() == path.resolve()
    assert fastckpt.latest_checkpoint(None).resolve() == path.resolve()
    fresh = _linear(0.0)
    fastckpt.load_state(fresh)
    assert_model_state(fresh, model_clone(_linear(3.0)))


def test_total_limit_keeps_the_newest_n(tmp_path):
    project = tmp_path / "p"
    paths = [fastckpt.save_state(_linear(float(i)), project_dir=project, total_limit=3)
             for i in range(5)]
    assert _names(project) == sorted(p.name for p in paths[-3:])
    for p in paths[-3:]:
        assert (p / "fastckpt.json").is_file()


def test_total_limit_with_full_checkpoints(tmp_path):
    project = tmp_path / "p"
    model = _linear(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(4):
        fastckpt.save_state(model, opt, project_dir=project, total_limit=1)
    assert len(_names(project)) == 1
    latest = fastckpt.latest_checkpoint(project)
    assert latest.name == _names(project)[0]


def test_latest_checkpoint_none_without_checkpoints(tmp_path):
    assert fastckpt.latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    assert fastckpt.latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints" / "checkpoint_3").mkdir()  # no manifest: never a checkpoint
    assert fastckpt.latest_checkpoint(tmp_path) is None


def test_latest_checkpoint_numeric_not_string_order(tmp_path):
    for n in (9, 10, 2):
        _committed(tmp_path, n)
    assert fastckpt.latest_checkpoint(tmp_path).name == "checkpoint_10"


def test_folder_without_manifest_never_chosen_as_latest(tmp_path):
    _committed(tmp_path, 4, value=4.0)
    partial = tmp_path / "checkpoints" / "checkpoint_5"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x00" * 16)  # an unfinished save
    assert fastckpt.latest_checkpoint(tmp_path).name == "checkpoint_4"
    fresh = _linear(0.0)
    fastckpt.load_state(fresh, project_dir=tmp_path)
    assert_model_state(fresh, model_clone(_linear(4.0)))


def test_other_folder_names_are_ignored(tmp_path):
    _committed(tmp_path, 1)
    for name in ("checkpoint_abc", "checkpoint_7_old", "ckpt_9", "checkpoint-8"):
        other = tmp_path / "checkpoints" / name
        fastckpt.save_state(_linear(9.0), output_dir=other)  # committed, but not a numbered name
    assert fastckpt.latest_checkpoint(tmp_path).name == "checkpoint_1"


def test_next_number_is_largest_committed_plus_one(tmp_path):
    """README (API): n = largest *committed* + 1 (an uncommitted checkpoint_7 does not count)."""
    _committed(tmp_path, 5)
    (tmp_path / "checkpoints" / "checkpoint_7").mkdir()
    path = fastckpt.save_state(_linear(1.0), project_dir=tmp_path)
    assert path.name == "checkpoint_6"


def test_load_state_with_no_committed_checkpoint_is_missing_state_error(tmp_path):
    (tmp_path / "checkpoints" / "checkpoint_0").mkdir(parents=True)
    model = _linear(1.0)
    before = model_clone(model)
    with pytest.raises(fastckpt.MissingStateError) as info:
        fastckpt.load_state(model, project_dir=tmp_path)
    assert "checkpoints" in str(info.value)
    assert_model_state(model, before)

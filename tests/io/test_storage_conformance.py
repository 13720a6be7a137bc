"""The storage conformance suite: what every backend of :class:`fastckpt._io.storage.base.Storage` must do, run
against each one (a local folder, ``s3://`` on the moto server of tests/helpers/s3_server.py, the memory tier
of the checkpoint manager, and the tiered composition: a local folder in front of ``s3://``, whose verbs are the
local tier's until a save's upload, started by ``StagedSave.returned``, commits remotely).

The conventions checked (see :mod:`fastckpt._io.storage.base`): a save that was not committed is never listed and
never opened; a commit makes the whole save visible (bit-exact) or raises and changes nothing; ``list`` orders by
checkpoint number (a backend's own numbering: ``checkpoint_{n}`` locally and in object storage, the step in the
memory tier) and keeps full and model-only checkpoints apart; ``open`` reads the newest full checkpoint;
``remove`` and ``rotate`` take checkpoints out of the list at once; a reader's open file survives a ``remove``.

A new backend registers one factory in :data:`BACKENDS` and passes this file unchanged (a backend without named
locations, such as the memory tier, skips the one test of them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers.common import make_training_state

from fastckpt._io.storage import resolve
from fastckpt._io.storage.base import Committed, Storage
from fastckpt._io.storage.memory import MemoryTier
from fastckpt._plan.save import build_save_plan
from fastckpt.errors import MissingStateError


def _local(request: pytest.FixtureRequest, tmp_path: Path, named: bool) -> Storage:
    return resolve(tmp_path / "run" / "ckpt" if named else None, project_dir=tmp_path / "run")


def _s3(request: pytest.FixtureRequest, tmp_path: Path, named: bool) -> Storage:
    url = request.getfixturevalue("s3_url")
    return resolve(f"{url}/ckpt" if named else None, project_dir=None if named else url)


def _tiered(request: pytest.FixtureRequest, tmp_path: Path, named: bool) -> Storage:
    url = request.getfixturevalue("s3_url")
    return resolve(tmp_path / "run" / "ckpt" if named else None, project_dir=tmp_path / "run",
                   remote=f"{url}/ckpt" if named else url)


def _memory(request: pytest.FixtureRequest, tmp_path: Path, named: bool) -> Storage:
    if named:
        pytest.skip("the memory tier names its checkpoints by step: it has no named locations")
    # keep=: the manager's tier keeps the newest only (its retention policy); the suite's checks need several
    return MemoryTier(tmp_path / "mem", keep=100)


#: backend name -> factory ``(request, tmp_path, named) -> Storage``: a project whose checkpoints are numbered
#: (``named=False``), or one named checkpoint location (``named=True``).
BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path, bool], Storage]] = {
    "local": _local, "s3": _s3, "memory": _memory, "tiered": _tiered,
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def project(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    return BACKENDS[backend](request, tmp_path, False)


@pytest.fixture
def named(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    return BACKENDS[backend](request, tmp_path, True)


def _save(storage: Storage, seed: int, *, step: int, model_only: bool = False, **options) -> tuple[dict, object]:
    """Save a training state built from ``seed``; returns (the model's state_dict, the Committed)."""
    model, opt, sched = make_training_state(seed)
    plan = build_save_plan([model], [] if model_only else [opt], [] if model_only else [sched],
                           model_only=model_only, step=step, max_shard_size=None, compat=None, trainable_only=False,
                           trainable_buffers=(), dtype=None, threads=0)
    save = storage.begin(model_only=model_only, step=step)
    save.write(plan, **options)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, save.commit()


def _read_model(storage: Storage, **kwargs) -> tuple[dict, dict]:
    """(model tensors, manifest) of the checkpoint ``storage.open(**kwargs)`` gives."""
    with storage.open(**kwargs) as view:
        tensors = safetensors.torch.load((view.folder / "model.safetensors").read_bytes())
        manifest = json.loads((view.folder / "fastckpt.json").read_text())
    return tensors, manifest


def _steps(listed: list[Committed]) -> list[tuple[int | None, bool]]:
    """(step, model_only) of each listed checkpoint, after checking that ``list`` orders them by number."""
    numbers = [c.number for c in listed]
    assert None not in numbers and numbers == sorted(set(numbers)), numbers
    return [(c.step, c.model_only) for c in listed]


def _assert_equal(saved: dict, read: dict) -> None:
    assert sorted(saved) == sorted(read)
    for name, tensor in saved.items():
        assert torch.equal(tensor, read[name]), name


def test_a_save_that_was_not_committed_is_never_listed_or_opened(project):
    model, opt, sched = make_training_state(0)
    plan = build_save_plan([model], [opt], [sched], model_only=False, step=1, max_shard_size=None, compat=None,
                           trainable_only=False, trainable_buffers=(), dtype=None, threads=0)
    save = project.begin(step=1)
    save.write(plan)
    save.abort()
    save.abort()  # idempotent
    assert project.list() == []
    with pytest.raises(MissingStateError):
        with project.open():
            pass


def test_a_commit_makes_the_whole_save_visible_bit_exact(project):
    saved, committed = _save(project, 1, step=5)
    listed = project.list()
    assert _steps(listed) == [(5, False)]
    assert listed[0].location == committed.location
    tensors, manifest = _read_model(project)
    _assert_equal(saved, tensors)
    assert manifest["step"] == 5 and manifest["mode"] == "full"


def test_list_orders_by_number_and_keeps_kinds_apart(project):
    _save(project, 1, step=1)
    _save(project, 2, step=2)
    snapshot, _ = _save(project, 3, step=3, model_only=True)
    assert _steps(project.list()) == [(1, False), (2, False)]
    assert _steps(project.list(model_only=True)) == [(3, True)]
    _assert_equal(snapshot, _read_model(project, ref=project.list(model_only=True)[0])[0])


def test_list_full_only_false_counts_numbered_checkpoints_of_either_mode(project, backend):
    _save(project, 1, step=1)
    _save(project, 2, step=2, model_only=True)
    assert _steps(project.list(full_only=False)) == [(1, False)]  # model-only snapshots stay apart
    assert _steps(project.list(model_only=True, full_only=False)) == [(2, True)]
    if backend == "memory":
        return  # it names checkpoints by step: no model-only save among the numbered ones
    # a model-only save placed among the numbered checkpoints (an explicit folder): counted, never resumed from
    model, _, _ = make_training_state(3)
    plan = build_save_plan([model], [], [], model_only=True, step=3, max_shard_size=None, compat=None,
                           trainable_only=False, trainable_buffers=(), dtype=None, threads=0)
    save = project.begin("checkpoints/checkpoint_5", model_only=True, step=3)
    save.write(plan)
    save.commit()
    assert _steps(project.list()) == [(1, False)]
    assert [(c.number, c.step, c.model_only) for c in project.list(full_only=False)] == [(0, 1, False), (5, 3, True)]


def test_open_reads_the_newest_full_checkpoint_or_the_one_named(project):
    _save(project, 1, step=1)
    newest, _ = _save(project, 2, step=2)
    _assert_equal(newest, _read_model(project)[0])
    first = project.list()[0]
    with project.open(first) as view:
        assert json.loads((view.folder / "fastckpt.json").read_text())["step"] == 1


def test_a_refused_commit_changes_nothing(project):
    kept, _ = _save(project, 1, step=1)

    def refuse(*_args):
        raise ValueError("refused before the manifest")

    with pytest.raises(ValueError, match="refused before the manifest"):
        _save(project, 2, step=2, before_commit=refuse)
    assert [c.step for c in project.list()] == [1]
    _assert_equal(kept, _read_model(project)[0])


def test_remove_and_rotate_take_checkpoints_out_at_once(project):
    for step in range(4):
        _save(project, step, step=step)
    project.remove(project.list()[-1])
    assert [c.step for c in project.list()] == [0, 1, 2]
    removed = project.rotate(1)
    assert len(removed) == 2
    assert [c.step for c in project.list()] == [2]
    assert _read_model(project)[1]["step"] == 2


def test_a_reader_keeps_what_it_opened_when_the_checkpoint_is_removed(project):
    saved, _ = _save(project, 1, step=1)
    with project.open() as view:
        with open(view.folder / "model.safetensors", "rb") as f:
            project.remove(project.list()[0])
            assert project.list() == []
            _assert_equal(saved, safetensors.torch.load(f.read()))


def test_a_named_location_holds_one_checkpoint_saved_over_in_one_step(named):
    assert named.list() == []
    _save(named, 1, step=1)
    newer, _ = _save(named, 2, step=2)
    assert [(c.number, c.step) for c in named.list()] == [(None, 2)]
    _assert_equal(newer, _read_model(named)[0])
    assert named.rotate(1) == []


def test_as_local_hands_over_the_committed_files_as_they_are(project):
    with pytest.raises(MissingStateError):
        with project.as_local():
            pass
    _save(project, 1, step=1)
    newest, _ = _save(project, 2, step=2)
    snapshot, _ = _save(project, 3, step=3, model_only=True)
    with project.as_local() as view:
        _assert_equal(newest, safetensors.torch.load((view.path / "model.safetensors").read_bytes()))
        assert view.named == (view.location if view.copy else view.path)
    with project.as_local(project.list(model_only=True)[0]) as view:
        _assert_equal(snapshot, safetensors.torch.load((view.path / "model.safetensors").read_bytes()))
        assert json.loads((view.path / "fastckpt.json").read_text())["mode"] == "model_only"


def test_a_committed_checkpoint_is_named_as_a_path_or_its_url(project):
    _, committed = _save(project, 1, step=1)
    listed = project.list()[0]
    assert str(listed.named) == listed.location == committed.location
    # a local folder is a Path (what latest_checkpoint returns), a checkpoint in object storage its URL (a str)
    assert isinstance(listed.named, Path) == (listed.path is not None)
    with project.as_local(listed) as view:
        assert isinstance(view.named, Path) == (not view.copy)


def test_as_local_of_a_named_location_is_that_checkpoint(named):
    saved, _ = _save(named, 1, step=1)
    with named.as_local() as view:
        _assert_equal(saved, safetensors.torch.load((view.path / "model.safetensors").read_bytes()))
        assert view.location == named.location

"""``fastckpt.accelerate.save_state`` / ``load_state`` over ``s3://`` in one process (moto server): an explicit
URL round trip restores models, optimizers, schedulers, step and RNG exactly; ``ProjectConfiguration`` with an
``s3://`` project_dir names, rotates (``total_limit``) and resumes (``iteration``) by committed manifests; what
does not apply to object storage is a ValueError before anything is written. The two-process case is in
tests/integrations/test_multiprocess.py (scenario G)."""

from __future__ import annotations

import pytest
from accelerate.utils import ProjectConfiguration
from helpers.accelerate_state import assert_restored, draws, prepared_state, snapshot
from helpers.s3_server import BUCKET, keys

import fastckpt
import fastckpt.accelerate


def _numbers(url: str) -> list[int]:
    prefix = url.split(f"s3://{BUCKET}/", 1)[1] + "/checkpoints/checkpoint_"
    return sorted({int(k[len(prefix):].split("/", 1)[0]) for k in keys(prefix)})


def test_explicit_url_round_trip_restores_everything_exactly(s3_url, new_accelerator):
    acc = new_accelerator()
    model, opt, sched = prepared_state(acc, 1, steps=3)
    acc.step = 7
    expected = snapshot(model, opt, sched)
    assert fastckpt.accelerate.save_state(acc, s3_url) == s3_url
    after_save = draws()

    acc2 = new_accelerator()
    model2, opt2, sched2 = prepared_state(acc2, 2)
    draws()
    assert fastckpt.accelerate.load_state(acc2, s3_url) == ([], [])
    assert_restored(model2, opt2, sched2, expected)
    assert acc2.step == 7
    assert draws() == after_save


def test_project_naming_rotation_and_iteration_over_s3(s3_url, new_accelerator):
    config = ProjectConfiguration(project_dir=s3_url, automatic_checkpoint_naming=True, total_limit=2)
    acc = new_accelerator(project_config=config)
    model, opt, sched = prepared_state(acc, 1)
    states = []
    for _ in range(3):
        states.append(snapshot(model, opt, sched))
        url = fastckpt.accelerate.save_state(acc)
        opt.step()
        sched.step()
    assert url == f"{s3_url}/checkpoints/checkpoint_2"
    assert _numbers(s3_url) == [1, 2] and acc.project_configuration.iteration == 3
    assert fastckpt.latest_checkpoint(s3_url) == url
    snap = fastckpt.accelerate.save_state(acc, model_only=True)
    assert snap == f"{s3_url}/model_only/checkpoint_0" and acc.project_configuration.iteration == 3

    acc2 = new_accelerator(project_config=ProjectConfiguration(project_dir=s3_url, automatic_checkpoint_naming=True,
                                                               total_limit=2))
    model2, opt2, sched2 = prepared_state(acc2, 2)
    fastckpt.accelerate.load_state(acc2)  # the latest full checkpoint, not the model-only snapshot
    assert_restored(model2, opt2, sched2, states[2])
    assert acc2.project_configuration.iteration == 3
    fastckpt.accelerate.load_state(acc2, f"{s3_url}/checkpoints/checkpoint_1")
    assert_restored(model2, opt2, sched2, states[1])


@pytest.mark.parametrize("kwargs, match", [({"async_save": True}, "async_save"),
                                           ({"share_unchanged": True}, "share_unchanged")])
def test_what_does_not_apply_to_s3_is_refused_before_writing(kwargs, match, s3_url, new_accelerator):
    acc = new_accelerator()
    prepared_state(acc, 1)
    with pytest.raises(ValueError, match=match):
        fastckpt.accelerate.save_state(acc, s3_url, **kwargs)
    assert keys(s3_url.split(f"s3://{BUCKET}/", 1)[1] + "/") == []

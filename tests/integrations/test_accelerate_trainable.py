"""``fastckpt.accelerate.save_state`` with ``trainable_only`` and ``share_unchanged``: a prepared partly frozen model
round-trips bit-exact into a fresh Accelerator; the frozen shard is hard-linked across automatically named
checkpoints and survives ``total_limit`` rotation; a different base is refused."""

from __future__ import annotations

import json

import pytest
import safetensors.torch as official
import torch
from accelerate.utils import ProjectConfiguration
from helpers.common import assert_tensor_dicts_identical
from helpers.finetune import make_frozen_base, trained

import fastckpt
import fastckpt.accelerate


def _prepared(new_accelerator, project, seed=0, head_seed=1, total_limit=None):
    acc = new_accelerator(project_config=ProjectConfiguration(project_dir=str(project),
                                                              automatic_checkpoint_naming=True,
                                                              total_limit=total_limit))
    model = make_frozen_base(seed, head_seed=head_seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def test_trainable_only_round_trip_through_accelerate(new_accelerator, tmp_path):
    acc, model, opt = _prepared(new_accelerator, tmp_path)
    trained(model, 2)
    path = fastckpt.accelerate.save_state(acc, trainable_only=True)
    assert set(official.load_file(path / "model.safetensors")) == {"head.weight", "head.bias"}
    assert json.loads((path / "fastckpt.json").read_text())["trainable_only"] is True
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    acc2, model2, opt2 = _prepared(new_accelerator, tmp_path, head_seed=7)
    fastckpt.accelerate.load_state(acc2, path)
    assert_tensor_dicts_identical(model2.state_dict(), expected)
    acc3, model3, _ = _prepared(new_accelerator, tmp_path, seed=3)
    with pytest.raises(fastckpt.FrozenWeightsError):
        fastckpt.accelerate.load_state(acc3, path)


def test_share_unchanged_links_frozen_shards_across_rotation(new_accelerator, tmp_path):
    acc, model, opt = _prepared(new_accelerator, tmp_path, total_limit=2)
    paths = []
    for _ in range(4):
        trained(model, 1)
        paths.append(fastckpt.accelerate.save_state(acc, share_unchanged=True, max_shard_size=None))
    frozen = "model-00001-of-00002.safetensors"
    assert [p.name for p in paths] == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert not paths[0].exists() and not paths[1].exists()
    assert (paths[2] / frozen).stat().st_ino == (paths[3] / frozen).stat().st_ino
    assert (paths[3] / frozen).stat().st_nlink == 2
    assert fastckpt.verify_checkpoint(paths[3]).ok
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    acc2, model2, _ = _prepared(new_accelerator, tmp_path, head_seed=7)
    fastckpt.accelerate.load_state(acc2)
    assert_tensor_dicts_identical(model2.state_dict(), expected)

"""Shared group folders (issue 12, item 6): a setgid folder of a team (``chmod 2770``, the team's group) keeps its
group, mode and setgid bit when a save replaces it, and every new file gets the group the folder gives."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from helpers.common import make_training_state

import fastckpt

TEAM_GID = 4242


def _other_group() -> int:
    if os.geteuid() == 0:
        return TEAM_GID
    others = [g for g in os.getgroups() if g != os.getegid()]
    if not others:
        pytest.skip("needs a second group to chown to (root, or a user in two groups)")
    return others[0]


def _groups_and_modes(folder):
    return {p.name: (p.stat().st_gid, p.stat().st_mode & 0o7777) for p in folder.iterdir()}


def test_setgid_target_keeps_group_mode_and_setgid(tmp_path):
    gid = _other_group()
    target = tmp_path / "shared"
    target.mkdir()
    os.chown(target, -1, gid)
    os.chmod(target, 0o2770)
    model, opt, sched = make_training_state(0)
    fastckpt.save_state(model, opt, sched, output_dir=target)  # into the empty shared folder
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    fastckpt.save_state(model, opt, sched, output_dir=target)  # and over the checkpoint in it
    st = target.stat()
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (gid, 0o2770)
    files = _groups_and_modes(target)
    assert files and {g for g, _ in files.values()} == {gid}, files


def test_new_checkpoint_in_a_setgid_parent_gets_its_group(tmp_path):
    gid = _other_group()
    os.chown(tmp_path, -1, gid)
    os.chmod(tmp_path, 0o2775)
    model, opt, sched = make_training_state(0)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "ckpt")
    assert ckpt.stat().st_gid == gid and ckpt.stat().st_mode & stat.S_ISGID
    assert {g for g, _ in _groups_and_modes(ckpt).values()} == {gid}

"""A process killed (SIGKILL) while a streaming async save writes in the background leaves the previous checkpoint
bit-exact: killed by the writer thread once every data file is in the staging folder (just before the manifest),
and killed by the training thread at the first optimizer step after the call, while the writer (every file
written, held before its commit until then, so the kill never races the commit) has not committed."""

from __future__ import annotations

import textwrap

import pytest
from helpers.common import run_python
from helpers.crash_worker import build_state
from helpers.procs import owned_leftovers, which_state

import fastckpt

MB = 16
OLD, NEW = 11, 22

_WORKER = """
import os, signal, sys, threading
sys.path.insert(0, {helpers!r})
import torch
import fastckpt
from fastckpt._io.async_save import stream as async_stream
from crash_worker import build_state

model, opt, sched = build_state({new}, {mb})
if {where!r} == "before_commit":
    async_stream.StreamingSave.before_commit = lambda self, *checksums: os.kill(os.getpid(), signal.SIGKILL)
if {where!r} == "at_step":
    never, real = threading.Event(), async_stream.StreamingSave.before_commit

    def held(self, *checksums):
        never.wait(120)  # set by no one: the step's hook kills the process first
        return real(self, *checksums)

    async_stream.StreamingSave.before_commit = held
handle = fastckpt.save_state(model, opt, sched, output_dir={target!r}, step={new}, async_save=True)
for p in model.parameters():
    p.grad = torch.ones_like(p)
if {where!r} == "at_step":  # the writer is held before its commit until the kill (never a race with the step)
    opt.register_step_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
opt.step()
handle.wait()
print("committed")
"""


@pytest.mark.parametrize("where", ["before_commit", "at_step"])
def test_a_crash_during_the_background_write_keeps_the_previous_checkpoint(tmp_path, where):
    from pathlib import Path

    import helpers

    target = tmp_path / "ckpt"
    model, opt, sched = build_state(OLD, MB)
    fastckpt.save_state(model, opt, sched, output_dir=target, step=OLD)
    code = textwrap.dedent(_WORKER).format(helpers=str(Path(helpers.__file__).parent), new=NEW, mb=MB,
                                           where=where, target=str(target))
    proc = run_python(code)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert "committed" not in proc.stdout
    assert which_state(target, MB, {"old": OLD, "new": NEW}) == "old"
    fastckpt.verify_checkpoint(target)
    fastckpt.save_state(model, output_dir=tmp_path / "next", model_only=True)  # clears the dead save's staging
    assert owned_leftovers(tmp_path) == []

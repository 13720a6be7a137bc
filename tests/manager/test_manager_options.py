"""CheckpointManager's folder and signal options are checked at construction, before any handler is installed or
anything is written, with the argument named; close() removes only what the memory tier wrote."""

from __future__ import annotations

import gc
import signal

import pytest
import torch

import fastckpt
from fastckpt.manager import preemption


def state():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("memory, exc, match", [
    ("", ValueError, "names no folder"),
    (".", ValueError, "overlap"),  # the working directory holds project_dir
    ("proj", ValueError, "overlap"),
    ("proj/mem", ValueError, "overlap"),
    ("afile", ValueError, "is a file"),
    ("s3://bucket/mem", ValueError, "s3://"),
    (1, TypeError, "memory must be a folder"),
])
def test_a_memory_folder_that_close_would_wipe_or_cannot_hold_the_tier_is_refused(tmp_path, memory, exc, match):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "keep.txt").write_text("mine")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(exc, match=match):
        fastckpt.CheckpointManager(tmp_path / "proj", *state(), memory=memory)
    assert signal.getsignal(signal.SIGTERM) is before  # nothing installed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "keep.txt"]


def test_close_keeps_the_files_of_a_memory_folder_the_user_named(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "data.bin").write_bytes(b"123")
    model, opt = state()
    mgr = fastckpt.CheckpointManager(tmp_path / "proj", model, opt, memory=scratch, every_n_steps=1)
    mgr.step(1)
    assert (scratch / "checkpoints" / "checkpoint_1").is_dir()
    mgr.close()
    assert sorted(p.name for p in scratch.iterdir()) == ["data.bin"]
    assert (scratch / "data.bin").read_bytes() == b"123"
    assert (tmp_path / "proj" / "checkpoints" / "checkpoint_1").is_dir()


def test_close_removes_the_default_job_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTCKPT_JOB_ID", f"test-options-{tmp_path.name}")
    model, opt = state()
    mgr = fastckpt.CheckpointManager(tmp_path / "proj", model, opt, every_n_steps=1)
    mgr.step(1)
    job = mgr.memory.root.parent
    assert job.name == f"fastckpt-test-options-{tmp_path.name}" and job.is_dir()
    mgr.close()
    assert not job.exists()


@pytest.mark.parametrize("project", ["s3://bucket/run", "gs://bucket/run", ""])
def test_a_project_dir_url_is_refused_not_made_a_local_folder(tmp_path, project):
    with pytest.raises(ValueError, match="remote=|names no folder"):
        fastckpt.CheckpointManager(project, *state())
    assert list(tmp_path.iterdir()) == []  # no local "s3:" folder


def test_project_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        fastckpt.CheckpointManager(tmp_path / "f", *state())
    with pytest.raises(TypeError, match="project_dir must be a folder"):
        fastckpt.CheckpointManager(None, *state())


@pytest.mark.parametrize("signals, exc, match", [
    ((signal.SIGKILL,), ValueError, "SIGKILL cannot be caught"),
    ((signal.SIGTERM, signal.SIGSTOP), ValueError, "SIGSTOP cannot be caught"),
    ((999,), ValueError, "999 is not a signal"),
    (("TERM",), TypeError, "'TERM' is not a signal number"),
    (3.5, TypeError, "sequence of signal numbers"),
])
def test_uncatchable_or_unknown_preemption_signals_are_refused(tmp_path, signals, exc, match):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(exc, match=match):
        fastckpt.CheckpointManager(tmp_path / "proj", *state(), memory=False, preemption_signals=signals)
    assert signal.getsignal(signal.SIGTERM) is before  # not left half installed


def test_one_signal_or_none(tmp_path):
    gc.collect()  # a manager another test left unclosed puts its handler back when collected
    before = signal.getsignal(signal.SIGUSR1)
    mgr = fastckpt.CheckpointManager(tmp_path / "proj", *state(), memory=False, preemption_signals=signal.SIGUSR1)
    # the one process-wide handler every open manager shares (already there if another manager is still open)
    assert mgr.signals.signals == (signal.SIGUSR1,) and signal.getsignal(signal.SIGUSR1) is preemption._dispatch
    mgr.close()
    assert signal.getsignal(signal.SIGUSR1) is before
    mgr = fastckpt.CheckpointManager(tmp_path / "proj", *state(), memory=False, preemption_signals=None)
    assert mgr.signals.signals == () and signal.getsignal(signal.SIGUSR1) is before
    mgr.close()


@pytest.mark.parametrize("code, exc", [(1.7, TypeError), ("1", TypeError), (None, TypeError), (True, TypeError),
                                       (256, ValueError), (-1, ValueError)])
def test_preemption_exit_code_must_be_an_exit_status(tmp_path, code, exc):
    with pytest.raises(exc, match="preemption_exit_code"):
        fastckpt.CheckpointManager(tmp_path / "proj", *state(), memory=False, preemption_exit_code=code)


def test_steps_must_not_go_back_until_a_restore(tmp_path):
    """A smaller step used to be saved as checkpoint_{n} beside the newer one (the tier keeps the highest number,
    so a restore took the stale step), and a negative one wrote a manifest no reader accepts."""
    model, opt = state()
    mgr = fastckpt.CheckpointManager(tmp_path / "proj", model, opt, memory=tmp_path / "mem", every_n_steps=2)
    mgr.step(2)
    mgr.step(4)
    for bad, exc, match in ((3, ValueError, r"\(3\) after step 4"), (-2, ValueError, ">= 0"),
                            (4.0, TypeError, "must be an int"), (True, TypeError, "must be an int")):
        with pytest.raises(exc, match=match):
            mgr.step(bad)
        with pytest.raises(exc, match=match):
            mgr.save_now(bad)
    mgr.wait()
    mgr.memory.clear()
    assert mgr.restore() == 4  # the durable tier
    with pytest.raises(ValueError, match="go back"):
        mgr.step(3)
    mgr.step(4)  # the same step again is fine
    mgr.close()
    with pytest.raises(fastckpt.CheckpointError, match="after close"):
        mgr.save_now(6)
    assert sorted(p.name for p in (tmp_path / "proj" / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_4"]


def test_a_second_process_on_the_same_memory_tier_is_refused(tmp_path):
    # two runs of one project on one machine would silently restore each other's snapshots: the second is refused,
    # naming the first; once the first closes, the folder is free again
    import subprocess
    import sys
    import textwrap

    memory = tmp_path / "mem"
    model = torch.nn.Linear(2, 2)
    first = fastckpt.CheckpointManager(tmp_path / "a", model, memory=memory, preemption_signals=None)
    code = textwrap.dedent(f"""
        import torch, fastckpt
        from fastckpt.errors import CheckpointError
        try:
            fastckpt.CheckpointManager({str(tmp_path / "b")!r}, torch.nn.Linear(2, 2), memory={str(memory)!r},
                                       preemption_signals=None)
        except CheckpointError as exc:
            print("refused:", exc)
        else:
            print("accepted")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("refused:"), out.stdout + out.stderr
    assert f"pid {__import__('os').getpid()}" in out.stdout and str(memory) in out.stdout
    first.close()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "accepted", out.stdout + out.stderr

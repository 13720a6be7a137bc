"""A background save that fails and that nobody waits on is reported at interpreter exit (case C30, orbax#605):
on stderr, with the exception and the checkpoint it was for, and in the exit status (1); the previous checkpoint
stays the latest and loads bit-exact. Each scenario runs a script in a fresh interpreter.

The write fails for real: the writer is held (an event) until the script has capped the size of any file it may
write (``RLIMIT_FSIZE``, ``SIGXFSZ`` ignored: the kernel's ``EFBIG``, as a full disk gives ``ENOSPC``), then the
script ends without ``wait()``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from helpers.common import run_python
from helpers.crash_worker import build_state
from helpers.procs import which_state

import fastckpt

MB = 2
OLD, NEW = 11, 22

_CHILD = """
import resource, signal, sys, threading
sys.path.insert(0, {helpers!r})
import fastckpt
import fastckpt._io.storage.local.backend as checkpoint_module  # where a local save writes its plan
from crash_worker import build_state

gate = threading.Event()
real = checkpoint_module.write_checkpoint


def held(*args, **kwargs):  # the writer waits until the file size limit is set
    gate.wait()
    return real(*args, **kwargs)


checkpoint_module.write_checkpoint = held
handle = fastckpt.save_state(*build_state({new}, {mb}), project_dir={project!r}, step={new}, async_save={mode!r})
if {fail!r}:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
gate.set()
if {wait!r}:
    try:
        handle.wait()
    except OSError as exc:
        print("wait raised", type(exc).__name__, flush=True)
print("script done", flush=True)
"""


def _run(tmp_path: Path, *, fail: bool, wait: bool, mode=True):
    import helpers

    project = tmp_path / "run"
    fastckpt.save_state(*build_state(OLD, MB), project_dir=project, step=OLD)  # checkpoint_0, the previous one
    code = textwrap.dedent(_CHILD).format(helpers=str(Path(helpers.__file__).parent), new=NEW, mb=MB,
                                          project=str(project), mode=mode, fail=fail, wait=wait)
    return project, run_python(code)


@pytest.mark.parametrize("mode", [True, "snapshot"])
def test_a_failed_async_save_never_waited_on_is_reported_at_exit(tmp_path, mode):
    project, proc = _run(tmp_path, fail=True, wait=False, mode=mode)
    assert "script done" in proc.stdout
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    ckpt1 = project.absolute() / "checkpoints" / "checkpoint_1"
    assert f"fastckpt: the async save to {ckpt1} failed and no wait() raised it" in proc.stderr, proc.stderr[-3000:]
    assert "OSError: [Errno 27] preallocating: File too large" in proc.stderr, proc.stderr[-3000:]
    latest = fastckpt.latest_checkpoint(project)
    assert latest is not None and latest.name == "checkpoint_0"
    assert which_state(latest, MB, {"old": OLD, "new": NEW}) == "old"
    fastckpt.verify_checkpoint(latest)


@pytest.mark.parametrize(("fail", "wait"), [(False, False), (True, True)], ids=["committed", "raised_by_wait"])
def test_nothing_is_reported_at_exit_when_the_save_committed_or_wait_raised(tmp_path, fail, wait):
    project, proc = _run(tmp_path, fail=fail, wait=wait)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fastckpt:" not in proc.stderr, proc.stderr[-3000:]
    assert ("wait raised OSError" in proc.stdout) == fail
    assert fastckpt.latest_checkpoint(project).name == ("checkpoint_0" if fail else "checkpoint_1")

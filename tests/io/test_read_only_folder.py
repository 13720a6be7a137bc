"""A checkpoint folder made read-only (mode 0555, its parent writable) by a user without privileges: a save over
it writes every file into a writable staging folder, gives it the folder's mode just before the commit, and
leaves nothing behind (nor when the commit fails: the old checkpoint stays); a staging folder a dead save left with that read-only mode is removed by the next save.

Tests run as root, which ignores file modes, so the saves run in a worker that drops to ``nobody``.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers.crash_worker import build_state
from helpers.procs import finish, owned_leftovers, requires_strace, start_worker, strace_prefix, which_state

import fastckpt

MB = 2
SEEDS = {"old": 7, "new": 8}
NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand the folder to the user nobody")


@pytest.fixture
def parent():
    """A folder owned by ``nobody`` under /tmp (pytest's tmp_path is private to root), holding the old checkpoint
    ``ckpt`` (owned by ``nobody`` too)."""
    base = Path(tempfile.mkdtemp(prefix="fastckpt-ro-"))
    base.chmod(0o755)
    folder = base / "parent"
    model, opt, sched = build_state(SEEDS["old"], MB)
    fastckpt.save_state(model, opt, sched, output_dir=folder / "ckpt")
    for root, dirs, files in os.walk(folder):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.chown(name, NOBODY, NOBODY)
    yield folder
    shutil.rmtree(base, ignore_errors=True)


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(proc.stdout)


def _save_as_nobody(ckpt: Path) -> None:
    rc, out, err = finish(start_worker(SEEDS["new"], MB, ckpt, "--as-user", str(NOBODY)))
    assert rc == 0, (rc, out, err)
    assert out[-1].startswith(f"saved {ckpt}"), out


def _assert_only(parent: Path, names: list[str]) -> None:
    assert owned_leftovers(parent) == []
    assert sorted(p.name for p in parent.iterdir()) == names


def test_save_over_a_read_only_folder_keeps_its_mode(parent):
    ckpt = parent / "ckpt"
    ckpt.chmod(0o555)
    _save_as_nobody(ckpt)
    assert which_state(ckpt, MB, SEEDS) == "new"
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o555
    _assert_only(parent, ["ckpt"])


def test_a_read_only_leftover_of_a_dead_save_is_removed(parent):
    ckpt = parent / "ckpt"
    leftover = parent / f".ckpt.fastckpt-staging-{_dead_pid()}-0123abcd"
    shutil.copytree(ckpt, leftover)
    lock = leftover.with_name(leftover.name + ".lock")
    lock.write_text(f"{_dead_pid()}\nckpt\n")
    for path in [leftover, lock, *leftover.iterdir()]:
        os.chown(path, NOBODY, NOBODY)
    leftover.chmod(0o555)
    _save_as_nobody(ckpt)
    assert which_state(ckpt, MB, SEEDS) == "new"
    _assert_only(parent, ["ckpt"])


@requires_strace
def test_a_failed_save_over_a_read_only_folder_leaves_it_intact(parent):
    """The commit fails (EIO injected into renameat2) after the staging folder took mode 0555: it is removed all
    the same, the error names the folder and the old checkpoint stays, read-only."""
    ckpt = parent / "ckpt"
    ckpt.chmod(0o555)
    proc = start_worker(SEEDS["new"], MB, ckpt, "--as-user", str(NOBODY),
                        strace=strace_prefix("renameat2", "error=EIO:when=1"))
    rc, out, err = finish(proc)
    assert rc == 3, (rc, out, err)
    kind, code, message = out[-1].split(" ", 3)[1:]
    assert (kind, int(code)) == ("OSError", errno.EIO), out
    assert str(parent) in message, message
    _assert_only(parent, ["ckpt"])
    assert which_state(ckpt, MB, SEEDS) == "old"
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o555

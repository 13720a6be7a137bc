"""Resource faults: a full disk (a small tmpfs made by the test, filled to several levels), a read-only file system
(a tmpfs remounted read-only), a permission error (a worker that runs as ``nobody``), and I/O errors injected by
strace at each step of a save (EIO on a data write, on an fsync, on the commit; ENOSPC on preallocation and on the
manifest). Each must end with a clear OSError of the right errno naming a path, no partial checkpoint, staging
folder or temp file left behind, and the previous checkpoint loading bit-exact.

Tests and CI run as root, which ignores file modes; the mounts need root (``mount -t tmpfs``): without it, those
tests skip with the reason.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers.common import make_tiny
from helpers.crash_worker import build_state
from helpers.fault_log import record
from helpers.procs import finish, owned_leftovers, requires_strace, start_worker, strace_prefix, which_state

import fastckpt

MB = 2
SEEDS = {"old": 7, "new": 8}
NOBODY = 65534


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount ({' '.join(args)}): {proc.stderr.strip() or proc.returncode}")


@pytest.fixture
def tmpfs(tmp_path):
    """A fresh 16 MiB tmpfs; unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _mount("-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(mnt))
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _assert_nothing_left(parent: Path, committed: list[str]) -> None:
    """Only the committed checkpoints remain: no staging folder, lock, parked tree or temp file anywhere."""
    assert owned_leftovers(parent) == []
    assert sorted(p.name for p in parent.iterdir() if p.name != "filler") == sorted(committed)
    stray = [str(p) for p in parent.rglob("*") if p.name.endswith(".tmp") or ".fastckpt-" in p.name]
    assert stray == []


def _save_old(folder: Path) -> Path:
    model, opt, sched = build_state(SEEDS["old"], MB)
    return fastckpt.save_state(model, opt, sched, output_dir=folder)


def test_full_disk_at_several_fill_levels(tmpfs):
    """The new checkpoint needs as many pages as the old one (~6 MiB); free space is set (by a filler file) to
    levels from nothing to a few pages short, so the save fails at its lock, at a preallocation, or on the JSON
    files and the manifest written last."""
    ckpt = _save_old(tmpfs / "ckpt")
    needed = sum(-(-p.stat().st_size // 4096) * 4096 for p in ckpt.iterdir())
    model, opt, sched = build_state(SEEDS["new"], MB)
    filler = tmpfs / "filler"
    errors = set()
    for free in (0, 4096, 64 << 10, 1 << 20, needed - (64 << 10), needed - 8192, needed - 4096):
        with open(filler, "wb") as f:
            f.truncate(0)
        stat = os.statvfs(tmpfs)
        fill = stat.f_bavail * stat.f_frsize - free
        with open(filler, "wb") as f:
            if fill > 0:
                os.posix_fallocate(f.fileno(), 0, fill)
        try:
            fastckpt.save_state(model, opt, sched, output_dir=ckpt)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            assert str(tmpfs) in str(exc.filename), exc
            errors.add(f"{exc.strerror.split(':')[0]} {Path(exc.filename).name}")
        else:
            pytest.fail(f"{free} bytes free: a save of {needed} bytes succeeded")
        _assert_nothing_left(tmpfs, ["ckpt"])
        assert which_state(ckpt, MB, SEEDS) == "old"
        record("faults")
    filler.unlink()
    fastckpt.save_state(model, opt, sched, output_dir=ckpt)  # room again: the save goes through
    assert which_state(ckpt, MB, SEEDS) == "new"
    print(f"full disk failed at: {sorted(errors)}")


def test_read_only_file_system(tmpfs):
    ckpt = _save_old(tmpfs / "ckpt")
    _mount("-o", "remount,ro", str(tmpfs))
    try:
        with pytest.raises(OSError) as info:
            fastckpt.save_state(*build_state(SEEDS["new"], MB), output_dir=ckpt)
        assert info.value.errno == errno.EROFS and str(tmpfs) in str(info.value.filename)
        assert which_state(ckpt, MB, SEEDS) == "old"
    finally:
        _mount("-o", "remount,rw", str(tmpfs))
    _assert_nothing_left(tmpfs, ["ckpt"])
    record("faults")


@pytest.fixture
def shared_dir():
    """A folder under /tmp that the user ``nobody`` can reach (pytest's tmp_path is private to root)."""
    base = Path(tempfile.mkdtemp(prefix="fastckpt-perm-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("parent_mode", [0o755, 0o1777], ids=["parent_not_writable", "sticky_parent"])
def test_permission_error_in_a_process_without_privileges(shared_dir, parent_mode):
    """As ``nobody``: a root-owned 0755 parent refuses the staging folder (EACCES); a sticky world-writable parent
    lets it write everything, then refuses the commit over root's checkpoint (EPERM) and the staging goes."""
    parent = shared_dir / "parent"
    ckpt = _save_old(parent / "ckpt")
    parent.chmod(parent_mode)
    rc, out, err = finish(start_worker(SEEDS["new"], MB, ckpt, "--as-user", str(NOBODY)))
    assert rc == 3, (rc, out, err)
    kind, code, message = out[-1].split(" ", 3)[1:]
    want = errno.EACCES if parent_mode == 0o755 else errno.EPERM
    # the staging folder refused: fastckpt's DestinationNotWritableError (also a PermissionError); the commit over
    # root's checkpoint refused: the rename's PermissionError
    name = "DestinationNotWritableError" if parent_mode == 0o755 else "PermissionError"
    assert (kind, int(code)) == (name, want), out
    assert str(parent) in message
    _assert_nothing_left(parent, ["ckpt"])
    assert which_state(ckpt, MB, SEEDS) == "old"
    record("faults")


#: (syscall, strace injection, errno expected, what the message names)
INJECTED = [
    ("pwritev", "error=EIO:when=2", errno.EIO, "writing"),  # a data chunk
    ("fsync", "error=EIO:when=1", errno.EIO, "fsyncing"),  # the first file
    ("write", "error=ENOSPC:when=4", errno.ENOSPC, "scheduler.json"),  # after "ready" and the lock's pid
    ("renameat2", "error=EIO:when=1", errno.EIO, "exchanging"),  # the commit
]


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    """{syscall: (parent folder, checkpoint, worker)} for every INJECTED entry, all started at once."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    runs = {}
    for syscall, inject, _, _ in INJECTED:
        parent = tmp_path_factory.mktemp(f"inject-{syscall}")
        ckpt = _save_old(parent / "ckpt")
        runs[syscall] = (parent, ckpt, start_worker(SEEDS["new"], MB, ckpt, "--threads", "1",
                                                    strace=strace_prefix(syscall, inject)))
    yield runs
    for _, _, proc in runs.values():
        if proc.poll() is None:
            proc.kill()
        finish(proc)


@requires_strace
@pytest.mark.parametrize(("syscall", "inject", "code", "named"), INJECTED, ids=[i[0] for i in INJECTED])
def test_io_error_injected_mid_save(injected, syscall, inject, code, named):
    parent, ckpt, proc = injected[syscall]
    rc, out, err = finish(proc)
    assert rc == 3, (rc, out, err)
    kind, got, message = out[-1].split(" ", 3)[1:]
    assert (kind, int(got)) == ("OSError", code), out
    assert named in message and str(parent) in message, message
    _assert_nothing_left(parent, ["ckpt"])
    assert which_state(ckpt, MB, SEEDS) == "old"
    fastckpt.save_state(make_tiny(2), output_dir=parent / "after", model_only=True)  # the folder still works
    record("faults")

"""Staging folders carry their owner: a flock'ed lock file beside each. The cleanup removes what dead owners left
(staging folders, trash of a rotation, a parked old tree, which it puts back when the commit died halfway) and
never touches a live owner's, nor fails on what it may not remove."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from helpers.common import make_tiny
from helpers.fault_log import record

import fastckpt
from fastckpt._io.storage.local.staging import OwnedPath, clean_leftovers, leftovers


def _dead(parent, target: str, kind: str = "staging", *, lock: bool = True, pid: int = 999_999_999):
    """The leftovers of a process that died: a folder with a file, and its (unheld) lock file."""
    base = parent / f".{target}.fastckpt-{kind}-{pid}-0123abcd"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"partial")
    if lock:
        (parent / (base.name + ".lock")).write_text(f"{pid}\n")
    return base


def test_dead_owners_leftovers_are_removed_and_only_those(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / ".hidden_user_file").write_text("mine")
    staging = _dead(tmp_path, "ckpt")
    trash = _dead(tmp_path, "checkpoint_3", "trash")
    legacy = _dead(tmp_path, "other", lock=False)  # no lock file, and its pid is not running
    removed = clean_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == sorted(
        [staging.name, staging.name + ".lock", trash.name, trash.name + ".lock", legacy.name])
    assert sorted(os.listdir(tmp_path)) == [".hidden_user_file", "ckpt"]
    record("faults", 3)


def test_a_live_owner_is_never_touched(tmp_path):
    with OwnedPath(tmp_path, "ckpt") as live:
        live.path.mkdir()
        (live.path / "model.safetensors").write_bytes(b"being written")
        legacy_alive = _dead(tmp_path, "other", lock=False, pid=os.getpid())  # no lock, but its pid runs
        assert clean_leftovers(tmp_path) == []
        assert (live.path / "model.safetensors").read_bytes() == b"being written"
        assert legacy_alive.is_dir()
    assert not live.path.exists() and not live.lock_path.exists()  # released: both gone
    # Held by another process: the same.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, pathlib; from fastckpt._io.storage.local.staging import OwnedPath\n"
        f"o = OwnedPath(pathlib.Path({str(tmp_path)!r}), 'ckpt'); o.path.mkdir(); print(o.path, flush=True)\n"
        "sys.stdin.readline()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    path = holder.stdout.readline().strip()
    assert clean_leftovers(tmp_path) == [] and os.path.isdir(path)
    holder.kill()
    holder.communicate()
    assert os.path.basename(path) in [p.name for p in clean_leftovers(tmp_path)]
    record("faults")


def test_a_commit_that_died_with_the_old_tree_parked_puts_it_back(tmp_path):
    """Without RENAME_EXCHANGE a commit moves the old checkpoint to ``{staging}.old.{pid}`` for a moment."""
    ckpt = fastckpt.save_state(make_tiny(1), output_dir=tmp_path / "ckpt", model_only=True)
    staging = _dead(tmp_path, "ckpt")  # the new tree, never committed
    os.rename(ckpt, tmp_path / (staging.name + ".old.999999999"))
    assert not ckpt.exists()
    clean_leftovers(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    model = make_tiny(2)
    fastckpt.load_state(model, input_dir=ckpt, model_only=True, verify=True)
    assert all(a.equal(b) for a, b in zip(model.state_dict().values(), make_tiny(1).state_dict().values()))
    record("faults")


def test_cleanup_skips_what_it_may_not_remove():
    """As ``nobody``, root's leftovers in a root-owned folder: the dead owner's lock can be taken (mode 0666) but
    nothing can be removed; the cleanup reports nothing removed and raises nothing."""
    shared = Path(tempfile.mkdtemp(prefix="fastckpt-staging-"))
    try:
        shared.chmod(0o755)
        staging = _dead(shared, "ckpt")
        (shared / (staging.name + ".lock")).chmod(0o666)
        code = ("import os, pathlib; from fastckpt._io.storage.local.staging import clean_leftovers\n"
                "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
                f"print(clean_leftovers(pathlib.Path({str(shared)!r})))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr
        assert staging.is_dir() and (staging / "model.safetensors").is_file()
        assert staging.name in [p.name for p in clean_leftovers(shared)]  # root may
        assert leftovers(shared) == {}
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_unwritable_output_dir_names_the_folder_given(tmp_path):
    """save_state into a place that takes no files (``/proc/x``: ENOENT; ``/sys/x``: EACCES even for root) raises the
    builtin OSError class of its errno (errors.py: permission and disk errors stay builtin) naming the folder the user
    gave; it named fastckpt's hidden ``.x.fastckpt-staging-....lock`` file."""
    model = make_tiny(0)
    for given, kind in (("/proc/x", FileNotFoundError), ("/sys/x", PermissionError)):
        try:
            fastckpt.save_state(model, output_dir=given)
        except kind as exc:
            assert exc.filename == given, exc
            assert given in str(exc) and ".lock" not in str(exc) and "staging" not in str(exc), exc
        else:
            raise AssertionError(f"save_state to {given} did not raise {kind.__name__}")


def test_an_in_place_save_into_a_folder_that_takes_no_files_names_the_folder(tmp_path, monkeypatch):
    """An in-place save (a mount point's folder) into a read-only or full file system: the builtin OSError of the
    errno, naming the folder saved into; it named fastckpt's hidden ``.fastckpt.lock`` file."""
    import errno

    from fastckpt._io.storage.local import in_place

    real_open = os.open

    def refuse(path, *args, **kwargs):
        if os.fspath(path).endswith(in_place.LOCK_NAME):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(in_place.os, "open", refuse)
    try:
        in_place._lock(tmp_path)
    except OSError as exc:
        assert exc.errno == errno.EROFS and exc.filename == str(tmp_path), exc
        assert str(tmp_path) in str(exc) and ".lock" not in str(exc), exc
    else:
        raise AssertionError("the lock of a read-only folder was taken")

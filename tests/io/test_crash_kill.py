"""C17: a save killed with SIGKILL at any moment leaves the previous checkpoint bit-exact or the new one complete,
never a mix; "latest" never names a partial checkpoint; the next save clears what the dead one left.

A worker process (tests/helpers/crash_worker.py) builds a deterministic training state and saves it over a committed
checkpoint. It is killed at named steps of the save (strace injects SIGKILL at the Nth call of a syscall: while
the lock is taken, while data is written, at each fsync, at the commit, while the old tree is removed) and after
random delays through the write, for two sizes. Each outcome is loaded, verified (every crc32c) and
fingerprinted against both states.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import pytest
from helpers.common import make_tiny
from helpers.crash_worker import build_state
from helpers.fault_log import record
from helpers.procs import (
    finish,
    link_copy,
    owned_leftovers,
    requires_strace,
    start_worker,
    strace_prefix,
    wait_ready,
    which_state,
)

import fastckpt

MB_SMALL = 16  # 16 MiB of weights: ~48 MiB written with the two AdamW moments
MB_BIG = 48  # ~145 MiB written
OLD, NEW = 11, 22  # seeds of the committed state and of the one being saved
SEEDS = {"old": OLD, "new": NEW}


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> dict[int, Path]:
    """{mb: a committed checkpoint of the OLD state of that size}."""
    root = tmp_path_factory.mktemp("committed")
    out = {}
    for mb in (MB_SMALL, MB_BIG):
        model, opt, sched = build_state(OLD, mb)
        out[mb] = fastckpt.save_state(model, opt, sched, output_dir=root / f"mb{mb}", step=OLD)
    return out


def _assert_cleaned_by_next_save(parent: Path) -> None:
    """Another save into the same parent removes every leftover of the dead one."""
    fastckpt.save_state(make_tiny(1), output_dir=parent / "next_save", model_only=True)
    assert owned_leftovers(parent) == []


#: (syscall, its call number to kill at, writer threads, the states the folder may then hold). With one writer
#: thread every call is on the main thread, so the numbers are the order of a save: fsync 1-3 the safetensors
#: files, 4 the staging folder, 5 scheduler.json, 6 the manifest, 7 the staging folder, 8 the parent after the
#: commit. strace counts per thread: with two writer threads, "pwritev 2" is either thread's second chunk.
KILL_POINTS = [
    ("flock", 1, 1, {"old"}),  # taking the staging lock
    ("fallocate", 2, 1, {"old"}),  # preallocating the second file
    ("pwritev", 1, 1, {"old"}),  # the first chunk of data
    ("pwritev", 2, 2, {"old"}),  # a second chunk while another thread writes too
    ("fsync", 2, 1, {"old"}),  # syncing the safetensors files
    ("fsync", 6, 1, {"old"}),  # syncing the manifest
    ("renameat2", 1, 1, {"old", "new"}),  # the commit itself (RENAME_EXCHANGE)
    ("fsync", 8, 1, {"new"}),  # syncing the parent after the commit
    ("unlinkat", 2, 1, {"new"}),  # removing the replaced tree
]


@pytest.fixture(scope="module")
def step_kills(committed, tmp_path_factory):
    """{(syscall, when, threads): (parent folder, target, worker)} for every KILL_POINTS entry, all workers started
    at once so that they share the cores (each test then waits for its own)."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    runs = {}
    for syscall, when, threads, _ in KILL_POINTS:
        parent = tmp_path_factory.mktemp(f"kill-{syscall}-{when}")
        target = link_copy(committed[MB_SMALL], parent / "ckpt")
        proc = start_worker(NEW, MB_SMALL, target, "--threads", str(threads),
                            strace=strace_prefix(syscall, f"signal=KILL:when={when}"))
        runs[(syscall, when, threads)] = (parent, target, proc)
    yield runs
    for _, _, proc in runs.values():
        if proc.poll() is None:
            proc.kill()
        finish(proc)


@requires_strace
@pytest.mark.parametrize(("syscall", "when", "threads", "allowed"), KILL_POINTS,
                         ids=[f"{s}-{w}-t{t}" for s, w, t, _ in KILL_POINTS])
def test_c17_sigkill_at_each_step_of_a_save(step_kills, syscall, when, threads, allowed):
    parent, target, proc = step_kills[(syscall, when, threads)]
    rc, out, err = finish(proc)
    assert rc in (-9, 128 + 9) and not any(line.startswith("saved") for line in out), (rc, out, err)
    assert owned_leftovers(parent), "the kill landed inside the save, which left its staging behind"
    assert which_state(target, MB_SMALL, SEEDS) in allowed
    assert sorted(p.name for p in parent.iterdir() if not p.name.startswith(".")) == ["ckpt"]
    _assert_cleaned_by_next_save(parent)
    assert which_state(target, MB_SMALL, SEEDS) in allowed  # the cleanup touched nothing committed
    record("faults")


@pytest.mark.parametrize("mb", [MB_SMALL, MB_BIG])
def test_c17_sigkill_after_random_delays_through_the_write(committed, tmp_path, mb):
    """A full save in a worker first (it reports how long the save took), then kills at random moments spread
    over that time (one in each half): old or new, never a mix."""
    rng = random.Random(1000 + mb)
    target = link_copy(committed[mb], tmp_path / "timed")
    rc, out, err = finish(start_worker(NEW, mb, target))
    assert rc == 0 and out[-1].startswith(f"saved {target} "), (rc, out, err)
    duration = float(out[-1].split()[-1])
    assert which_state(target, mb, SEEDS) == "new"
    outcomes = []
    for k in range(2):
        target = link_copy(committed[mb], tmp_path / f"kill{k}")
        proc = start_worker(NEW, mb, target)
        wait_ready(proc)
        time.sleep(rng.uniform(k / 2, (k + 1) / 2) * duration)
        proc.kill()
        finish(proc)
        outcomes.append(which_state(target, mb, SEEDS))
        _assert_cleaned_by_next_save(tmp_path)
        record("faults")
    print(f"{mb} MiB: a save takes {duration:.2f} s; kills left {outcomes}")


@requires_strace
@pytest.mark.parametrize(("syscall", "when"), [("pwritev", 3), ("rename", 4)])  # rename 4: the commit (1-3: files)
def test_c17_latest_never_names_a_partial_checkpoint(committed, tmp_path, syscall, when):
    """Automatic naming: checkpoint_0 is committed; the save of checkpoint_1 is killed mid-write / at its commit.
    "latest" is checkpoint_0 holding the old state (or, once committed, checkpoint_1 holding the new one)."""
    link_copy(committed[MB_SMALL], tmp_path / "checkpoints" / "checkpoint_0")
    proc = start_worker(NEW, MB_SMALL, tmp_path, "--auto", "--threads", "1",
                        strace=strace_prefix(syscall, f"signal=KILL:when={when}"))
    rc, out, err = finish(proc)
    assert rc in (-9, 128 + 9), (rc, out, err)
    latest = fastckpt.latest_checkpoint(tmp_path)
    state = which_state(latest, MB_SMALL, SEEDS)
    assert (latest.name, state) in {("checkpoint_0", "old"), ("checkpoint_1", "new")}
    assert owned_leftovers(tmp_path / "checkpoints")
    # The next automatic save is numbered after the last committed one and clears the leftovers.
    model, opt, sched = build_state(NEW, MB_SMALL)
    saved = fastckpt.save_state(model, opt, sched, project_dir=tmp_path)
    assert saved.name == f"checkpoint_{int(latest.name.split('_')[1]) + 1}"
    assert owned_leftovers(tmp_path / "checkpoints") == []
    assert fastckpt.latest_checkpoint(tmp_path) == saved
    assert which_state(latest, MB_SMALL, SEEDS) == state
    record("faults")

"""fastckpt.CheckpointManager in one process: schedules, preemption by SIGTERM at chosen points (sent from inside
the loop, no sleeps), restore of the newest intact step across tiers, a flipped byte in each tier, failed background
saves, and bit-exact resumes against an uninterrupted run (model, AdamW, StepLR, every global RNG, a registered data
order and counter)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers.recovery_loop import build, fingerprint, reference, seed_globals, train_step

import fastckpt
from fastckpt.errors import TierSkippedWarning
from fastckpt.manager import young_daly_interval
from fastckpt.manager.schedule import Schedule

TOTAL = 10


def manager(tmp_path, state, **kw):
    kw.setdefault("memory", tmp_path / "mem")
    kw.setdefault("every_n_steps", 2)
    mgr = fastckpt.CheckpointManager(tmp_path / "proj", *state[:3], **kw)
    mgr.register_for_checkpointing(state[3], state[4])
    return mgr


def run(tmp_path, *, signal_at: int | None = None, total: int = TOTAL, **kw):
    """Fresh objects, restore, train to ``total``; SIGTERM to this process during step ``signal_at``. Returns
    (manager, fingerprint or the Preempted exception, the restored step)."""
    state = build()
    seed_globals()  # as the script seeds at its start: the wrong RNG state for step k unless restored
    mgr = manager(tmp_path, state, **kw)
    start = mgr.restore()
    try:
        for step in range(start, total):
            train_step(*state)
            if step + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            mgr.step(step + 1)
    except fastckpt.Preempted as exc:
        return mgr, exc, start
    mgr.close()
    return mgr, fingerprint(*state), start


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def first_run(tmp_path, total: int = TOTAL, settle: bool = True, **kw):
    state = build()
    seed_globals()
    mgr = manager(tmp_path, state, **kw)
    assert mgr.restore() == 0 and mgr.restored_from is None
    for step in range(total):
        train_step(*state)
        mgr.step(step + 1)
        if settle:  # each durable copy ends before the next save (none is superseded): a known durable tier
            mgr.wait()
    return mgr, state


# -- schedule ------------------------------------------------------------------------------------------------------
def test_young_daly():
    assert young_daly_interval(2.0, 3600.0) == 120.0
    with pytest.raises(ValueError):
        young_daly_interval(1.0, 0)


def test_schedule_kinds():
    s = Schedule(every_n_steps=3)
    assert [n for n in range(10) if s.due_by_steps(n)] == [0, 3, 6, 9]
    c = Schedule(continuous=True)
    assert c.due_by_time(durable_busy=False) and not c.due_by_time(durable_busy=True)
    t = Schedule(every_seconds=10.0)
    assert t.due_by_time(durable_busy=False, now=0.0)
    t.saved(1, 100.0, 0.5)
    assert not t.due_by_time(durable_busy=False, now=105.0) and t.due_by_time(durable_busy=False, now=110.0)
    y = Schedule(mtbf=3600.0)
    assert y.due_by_time(durable_busy=False, now=0.0)  # the first save measures the cost
    y.saved(1, 0.0, 2.0)
    assert y.interval_seconds == 120.0
    for bad in ({"every_n_steps": 0}, {"every_seconds": -1}, {"mtbf": 1.0, "every_seconds": 1.0}):
        with pytest.raises(ValueError):
            Schedule(**bad)


def test_continuous_saves_as_soon_as_durable(tmp_path):
    state = build()
    mgr = manager(tmp_path, state, every_n_steps=None, continuous=True)
    saved = []
    for step in range(6):
        train_step(*state)
        if mgr.step(step + 1):
            saved.append(step + 1)
        mgr.durable.wait()  # the durable copy ends before the next step: every step is due
    mgr.close()
    assert saved == [1, 2, 3, 4, 5, 6]
    assert mgr.schedule.intervals == [1, 1, 1, 1, 1]


# -- saves and tiers -----------------------------------------------------------------------------------------------
def test_memory_tier_holds_the_newest_and_durable_follows(tmp_path):
    mgr, state = first_run(tmp_path, total=6, keep=2, settle=False)
    assert mgr.wait() == 6
    mem = sorted(p.name for p in (tmp_path / "mem" / "checkpoints").iterdir() if not p.name.startswith("."))
    assert mem == ["checkpoint_6"]
    durable = sorted(p.name for p in (tmp_path / "proj" / "checkpoints").iterdir())
    # keep=2; a save handed in while the previous one was still copied may have been superseded by a newer one
    assert durable[-1] == "checkpoint_6" and len(durable) <= 2
    # the durable tier is a normal checkpoint: load_state reads it, its manifest records the step
    fresh = build()
    fastckpt.load_state(fresh[0], fresh[1], fresh[2], input_dir=tmp_path / "proj" / "checkpoints" / "checkpoint_6")
    for a, b in zip(fresh[0].parameters(), state[0].parameters()):
        assert torch.equal(a, b)
    assert fastckpt.verify_checkpoint(tmp_path / "mem" / "checkpoints" / "checkpoint_6").tensors_checked > 0
    mgr.close()
    assert not (tmp_path / "mem").exists()  # a run that ended leaves no memory tier


@pytest.mark.parametrize("signal_at", [4, 5, 10])  # a due step, a step between saves, the last step
def test_sigterm_saves_the_step_and_resumes_bit_exactly(tmp_path, signal_at):
    mgr, exc, start = run(tmp_path, signal_at=signal_at)
    assert isinstance(exc, SystemExit) and exc.code == 0 and exc.step == signal_at and start == 0
    assert exc.path == tmp_path / "proj" / "checkpoints" / f"checkpoint_{signal_at}"
    fastckpt.verify_checkpoint(exc.path)  # durable before Preempted was raised
    assert mgr.preempt_seconds is not None and mgr.preempt_seconds >= 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    mgr2, got, start2 = run(tmp_path)
    assert start2 == signal_at and mgr2.restored_from == "memory"
    assert_same(got, reference(TOTAL))


def test_sigterm_before_the_loop_and_during_restore(tmp_path):
    first_run(tmp_path, total=4)[0].wait()
    state = build()
    seed_globals(5)
    mgr = manager(tmp_path, state)
    os.kill(os.getpid(), signal.SIGTERM)  # arrives while the loop has not started (e.g. during restore)
    start = mgr.restore()
    assert start == 4
    train_step(*state)
    with pytest.raises(fastckpt.Preempted) as info:
        mgr.step(5)
    assert info.value.step == 5
    _, got, start = run(tmp_path)
    assert start == 5
    assert_same(got, reference(TOTAL))


def test_second_signal_during_the_save_corrupts_nothing(tmp_path):
    state = build()
    seed_globals()
    mgr = manager(tmp_path, state, preemption_exit_code=3)
    for step in range(3):
        train_step(*state)
        mgr.step(step + 1)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR1)
    train_step(*state)
    with pytest.raises(fastckpt.Preempted) as info:
        mgr.step(4)
    assert info.value.code == 3 and info.value.signum == signal.SIGTERM and mgr.signals.count == 2
    fastckpt.verify_checkpoint(tmp_path / "proj" / "checkpoints" / "checkpoint_4")
    _, got, _ = run(tmp_path)
    assert_same(got, reference(TOTAL))


def test_without_a_memory_tier_each_save_is_durable_in_step(tmp_path):
    mgr, state = first_run(tmp_path, total=4, memory=False)
    assert sorted(p.name for p in (tmp_path / "proj" / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_4"]
    mgr.close()
    _, got, start = run(tmp_path, memory=False)
    assert start == 4
    assert_same(got, reference(TOTAL))


# -- restore across tiers ------------------------------------------------------------------------------------------
def flip(folder, name="model.safetensors"):
    path = folder / name
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))


def test_restore_prefers_the_memory_tier_then_the_durable_one(tmp_path):
    first_run(tmp_path, total=6)[0].wait()
    state = build()
    mgr = manager(tmp_path, state)
    assert mgr.restore() == 6 and mgr.restored_from == "memory"
    (tmp_path / "mem2").mkdir()
    mgr = manager(tmp_path, build(), memory=tmp_path / "mem2")  # a new machine: empty memory tier
    assert mgr.restore() == 6 and mgr.restored_from == "local"


def test_a_flipped_byte_in_each_tier_is_skipped_with_a_warning(tmp_path):
    first_run(tmp_path, total=6)[0].wait()
    flip(tmp_path / "mem" / "checkpoints" / "checkpoint_6")
    flip(tmp_path / "proj" / "checkpoints" / "checkpoint_6", "optimizer.safetensors")
    state = build()
    before = {k: v.clone() for k, v in state[0].state_dict().items()}
    mgr = manager(tmp_path, state)
    with pytest.warns(TierSkippedWarning) as caught:
        assert mgr.restore() == 4
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "memory tier" in messages[0] and "checkpoint_6" in messages[0] and "IntegrityError" in messages[0]
    assert "local tier" in messages[1] and "optimizer.safetensors" in messages[1]
    assert mgr.restored_from == "local" and mgr.restored_step == 4
    assert any(not torch.equal(before[k], v) for k, v in state[0].state_dict().items())
    # the resumed run from step 4 equals the uninterrupted one
    for _step in range(4, TOTAL):
        train_step(*state)
    assert_same(fingerprint(*state), reference(TOTAL))


def test_nothing_intact_raises_and_restores_nothing(tmp_path):
    # every checkpoint damaged: starting from step 0 would overwrite them, so restore() refuses, naming each
    first_run(tmp_path, total=2)[0].wait()
    flip(tmp_path / "mem" / "checkpoints" / "checkpoint_2")
    flip(tmp_path / "proj" / "checkpoints" / "checkpoint_2")
    state = build()
    before = {k: v.clone() for k, v in state[0].state_dict().items()}
    mgr = manager(tmp_path, state)
    with pytest.warns(TierSkippedWarning), pytest.raises(fastckpt.CheckpointError) as info:
        mgr.restore()
    assert type(info.value) is fastckpt.CheckpointError
    assert "memory tier's checkpoint of step 2" in str(info.value) and "local tier's" in str(info.value)
    assert mgr.restored_from is None
    assert (tmp_path / "proj" / "checkpoints" / "checkpoint_2").is_dir()  # nothing deleted
    assert all(torch.equal(before[k], v) for k, v in state[0].state_dict().items())  # nothing changed


def test_registered_objects_must_match(tmp_path):
    first_run(tmp_path, total=2)[0].wait()
    state = build()
    mgr = fastckpt.CheckpointManager(tmp_path / "proj", *state[:3], memory=tmp_path / "mem")
    mgr.register_for_checkpointing(state[3])  # one of the two saved objects
    with pytest.raises(fastckpt.KeyMismatchError, match="1 object"):
        mgr.restore()
    with pytest.raises(TypeError, match="state_dict"):
        mgr.register_for_checkpointing(object())


def test_a_failed_background_save_is_raised_at_the_next_step(tmp_path):
    state = build()
    mgr = manager(tmp_path, state)
    (tmp_path / "proj").mkdir(exist_ok=True)  # made by the manager (its incarnation id)
    (tmp_path / "proj" / "checkpoints").write_text("a file where the durable tier goes")
    train_step(*state)
    mgr.step(2)  # committed in memory; the durable copy fails in the background
    with pytest.raises(fastckpt.DurableSaveError) as info:
        mgr.wait()
    assert isinstance(info.value, OSError) and isinstance(info.value.__cause__, OSError)
    assert "background durable save of step 2" in str(info.value) and "newest durable step is None" in str(info.value)
    mgr.wait()  # raised once
    mgr.close()


def test_exit_on_preemption_false_returns_and_sets_preempted(tmp_path):
    state = build()
    mgr = manager(tmp_path, state)
    train_step(*state)
    mgr.request_preemption(signal.SIGUSR1)  # as a framework callback or a scheduler's notice API would
    assert mgr.preemption_requested
    assert mgr.step(1, exit_on_preemption=False) is True
    assert mgr.preempted is not None and mgr.preempted.step == 1 and mgr.preempted.signum == signal.SIGUSR1
    fastckpt.verify_checkpoint(tmp_path / "proj" / "checkpoints" / "checkpoint_1")


def test_host_memory_budget_refuses_a_larger_state(tmp_path):
    state = build()
    mgr = manager(tmp_path, state, host_memory_budget=1000)
    train_step(*state)
    with pytest.raises(ValueError, match="host_memory_budget=1000 bytes"):
        mgr.step(2)
    assert fastckpt.latest_checkpoint(tmp_path / "mem") is None
    with pytest.raises(ValueError, match="every_n_steps"):
        manager(tmp_path, state, every_n_steps=0)


def test_a_failed_background_save_nobody_waited_for_is_reported_at_exit(tmp_path):
    import subprocess
    import sys

    (tmp_path / "proj").mkdir(exist_ok=True)  # made by the manager (its incarnation id)
    (tmp_path / "proj" / "checkpoints").write_text("a file where the durable tier goes")
    script = (
        "import torch, fastckpt\n"
        "m = torch.nn.Linear(2, 2)\n"
        f"mgr = fastckpt.CheckpointManager({str(tmp_path / 'proj')!r}, m, every_n_steps=1, "
        f"memory={str(tmp_path / 'mem')!r})\n"
        "mgr.step(1)\n"  # the script ends without close(): the durable copy fails in the background
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # the exit report's status, as for an unwaited async save
    assert f"fastckpt: a CheckpointManager background durable save to {tmp_path / 'proj'} failed" in proc.stderr
    assert "DurableSaveError" in proc.stderr and "checkpoints" in proc.stderr


class Trap:
    """A registered object that sends SIGTERM to this process from inside a save (its ``state_dict``, called while
    the manager writes the memory tier) or from inside a restore (its ``load_state_dict``)."""

    def __init__(self) -> None:
        self.on_save: set[int] = set()
        self.on_restore = False
        self.step = 0

    def state_dict(self) -> dict:
        if self.step in self.on_save:
            self.on_save.discard(self.step)
            os.kill(os.getpid(), signal.SIGTERM)
        return {}

    def load_state_dict(self, state: dict) -> None:
        if self.on_restore:
            self.on_restore = False
            os.kill(os.getpid(), signal.SIGTERM)


def test_twenty_sigterms_at_random_moments_lose_nothing(tmp_path):
    """C29: 20 SIGTERMs in one job, each at a random step and moment (mid-step, during a save, during the restore);
    every one leaves the step reached durable and the job, restarted 20 times, ends equal to the uninterrupted one."""
    import random

    total = 44
    rng = random.Random(29)
    preempted_at, moments = [], []
    finished = None
    for _ in range(21):
        state = build()
        seed_globals()
        trap = Trap()
        mgr = manager(tmp_path, state, every_n_steps=3)
        mgr.register_for_checkpointing(trap)
        moment = rng.choice(["step", "save", "restore"]) if len(preempted_at) < 20 else None
        if moment == "restore" and not preempted_at:
            moment = "step"  # nothing to restore yet
        trap.on_restore = moment == "restore"
        start = mgr.restore()
        if moment is not None and moment != "restore":
            at = rng.randrange(start + 1, start + 3)
            if moment == "save":  # inside the next due save at or after `at`: acted on at the step after it
                at = next(s for s in range(at, total) if s % 3 == 0)
                trap.on_save.add(at)
        try:
            for step in range(start, total):
                train_step(*state)
                trap.step = step + 1
                if moment == "step" and step + 1 == at:
                    os.kill(os.getpid(), signal.SIGTERM)
                mgr.step(step + 1)
        except fastckpt.Preempted as exc:
            want = {"step": at, "save": at + 1, "restore": start + 1}[moment]
            assert exc.step == want, (moment, start)
            assert fastckpt.latest_checkpoint(tmp_path / "proj").name == f"checkpoint_{want}"
            preempted_at.append(exc.step)
            moments.append(moment)
            continue
        mgr.close()
        finished = fingerprint(*state)
        break
    assert len(preempted_at) == 20 and preempted_at == sorted(preempted_at)
    assert {m: moments.count(m) for m in set(moments)} == {"step": 9, "save": 5, "restore": 6}
    assert_same(finished, reference(total))


def test_young_daly_interval_from_the_measured_save_cost(tmp_path):
    state = build()
    mgr = manager(tmp_path, state, every_n_steps=None, mtbf=1e-9)
    assert mgr.interval_seconds is None
    train_step(*state)
    assert mgr.step(1)  # the first save measures the cost
    cost = mgr.schedule.cost
    assert cost > 0 and mgr.interval_seconds == young_daly_interval(cost, 1e-9)
    mgr.close()

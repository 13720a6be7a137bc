"""Two ways a CheckpointManager lost a step or the exit status, each in a child process: a crash before the durable
copy of the newest step, then a restart that restores it from the memory tier and closes at once (the step must be
copied to the durable tier, not cleared with ``/dev/shm``); and a second SIGTERM during the preemption save, after
:class:`Preempted` is raised, or during ``close()`` while the durable copy runs (the exit status stays 0). The
signals are sent in-process at fixed points (a state_dict, an except block, atexit, a wrapped copy): no sleeps."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import fastckpt

PRELUDE = """
import atexit, os, signal, sys, threading, torch, fastckpt
import fastckpt.manager.durable as durable
root = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def train(n):
    opt.zero_grad()
    model(torch.full((2, 4), float(n))).sum().backward()
    opt.step()
def make(**kw):
    return fastckpt.CheckpointManager(os.path.join(root, "run"), model, opt, every_n_steps=5,
                                      memory=os.path.join(root, "mem"), **kw)
"""


def child(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)


def test_a_step_restored_from_memory_and_newer_than_the_durable_tier_is_made_durable(tmp_path):
    crashed = child(tmp_path, """
        copy = durable.copy_committed
        def crash_at_10(src, target, **kw):  # the crash lands as the durable copy of step 10 starts
            if target.name == "checkpoint_10":
                torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(root, "ref.pt"))
                os._exit(0)
            return copy(src, target, **kw)
        durable.copy_committed = crash_at_10
        mgr = make()
        for n in range(1, 11):
            train(n)
            mgr.step(n)
        mgr.wait()
        print("not reached")
    """)
    assert crashed.returncode == 0 and "not reached" not in crashed.stdout, crashed.stderr
    assert fastckpt.latest_checkpoint(tmp_path / "run").name == "checkpoint_5"
    restarted = child(tmp_path, """
        mgr = make()
        print(mgr.restore(), mgr.restored_from)
        mgr.close()  # no steps left
    """)
    assert restarted.returncode == 0, restarted.stderr
    assert restarted.stdout.split("\n")[0] == "10 memory"
    latest = fastckpt.latest_checkpoint(tmp_path / "run")
    assert latest is not None and latest.name == "checkpoint_10"
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    fastckpt.load_state(model, input_dir=latest)
    want = torch.load(tmp_path / "ref.pt")
    assert want.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert not any((tmp_path / "mem").rglob("checkpoint_*")), "the durable step 10 is cleared from memory"


def test_a_second_sigterm_during_and_after_the_preemption_save_changes_nothing(tmp_path):
    proc = child(tmp_path, """
        class Twice:  # a second SIGTERM from inside the preemption save
            armed = False
            def state_dict(self):
                if self.armed:
                    os.kill(os.getpid(), signal.SIGTERM)
                return {"n": 1}
            def load_state_dict(self, state):
                pass
        twice = Twice()
        mgr = make()
        mgr.register_for_checkpointing(twice)
        atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))  # and one while the process exits
        for n in range(1, 10):
            train(n)
            if n == 3:
                os.kill(os.getpid(), signal.SIGTERM)
                twice.armed = True
            try:
                mgr.step(n)
            except fastckpt.Preempted as exc:
                print("preempted", exc.step)
                os.kill(os.getpid(), signal.SIGTERM)  # and one right after Preempted is raised
                raise
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split("\n")[0] == "preempted 3"
    latest = fastckpt.latest_checkpoint(tmp_path / "run")
    assert latest is not None and latest.name == "checkpoint_3"
    fastckpt.verify_checkpoint(latest)  # intact: every byte checked (raises otherwise)


def test_a_sigterm_during_close_while_the_durable_copy_runs_changes_nothing(tmp_path):
    proc = child(tmp_path, """
        entered = threading.Event()
        wait = durable.DurableWriter.wait
        def waiting(self, *a, **kw):  # close() is waiting for the durable copy
            entered.set()
            return wait(self, *a, **kw)
        durable.DurableWriter.wait = waiting
        copy = durable.copy_committed
        def signalled_copy(src, target, **kw):
            entered.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            return copy(src, target, **kw)
        durable.copy_committed = signalled_copy
        mgr = make()
        for n in range(1, 6):
            train(n)
            mgr.step(n)
        mgr.close()
        print("closed", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split("\n")[0] == "closed True"
    latest = fastckpt.latest_checkpoint(tmp_path / "run")
    assert latest is not None and latest.name == "checkpoint_5"

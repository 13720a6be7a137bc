"""A CheckpointManager's SIGTERM / SIGUSR1 handler lives exactly as long as the manager: close(), a context exit
(with or without an error), a close() that raised, and a manager garbage-collected without close() all put back
the handler found before it, and several managers in one process chain (each records while it is open; the last
one closed restores the first one's predecessor, in any order). Each case runs in a child process that ends by
``os.kill(os.getpid(), SIGTERM)``: its exit status says which handler got the signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

PRELUDE = """
import gc, os, signal, sys, threading, torch, fastckpt
seen = []
def mine(signum, frame):
    seen.append(signum)
def make(name, **kw):
    kw.setdefault("memory", os.path.join(sys.argv[1], name + "-mem"))
    return fastckpt.CheckpointManager(os.path.join(sys.argv[1], name), torch.nn.Linear(2, 2), every_n_steps=1, **kw)
"""


def child(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)


def test_the_default_handler_is_back_after_each_way_a_manager_ends(tmp_path):
    proc = child(tmp_path, """
        def default():
            return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
        ends = []
        mgr = make("a")
        mgr.close()
        ends.append(("close", default()))
        with make("b") as mgr:
            mgr.step(1)
        ends.append(("with", default()))
        try:
            with make("c"):
                raise KeyError("boom")
        except KeyError:
            pass
        ends.append(("with_error", default()))
        mgr = make("d")
        del mgr
        gc.collect()
        ends.append(("collected", default()))
        print(ends)
        os.kill(os.getpid(), signal.SIGTERM)
        print("survived")
    """)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert proc.stdout.split("\n")[0] == str([(e, True) for e in ("close", "with", "with_error", "collected")])
    assert "survived" not in proc.stdout


def test_a_manager_collected_off_the_main_thread_passes_the_signal_on(tmp_path):
    """No handler can be set there: the handler finds no manager left and hands the signal to the default."""
    proc = child(tmp_path, """
        holder = [make("a")]
        t = threading.Thread(target=holder.clear)
        t.start()
        t.join()
        gc.collect()
        os.kill(os.getpid(), signal.SIGTERM)
        print("survived")
    """)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert "survived" not in proc.stdout


def test_a_close_that_raised_put_the_handler_back(tmp_path):
    proc = child(tmp_path, """
        signal.signal(signal.SIGTERM, mine)
        os.makedirs(os.path.join(sys.argv[1], "a"))
        open(os.path.join(sys.argv[1], "a", "checkpoints"), "w").close()  # a file where the durable tier goes
        mgr = make("a")
        mgr.step(1)
        try:
            mgr.close()
        except fastckpt.DurableSaveError:
            print("close raised")
        assert signal.getsignal(signal.SIGTERM) is mine
        os.kill(os.getpid(), signal.SIGTERM)
        print("mine got", seen)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["close raised", f"mine got [{int(signal.SIGTERM)}]"]


def test_two_managers_chain_in_either_order(tmp_path):
    proc = child(tmp_path, """
        signal.signal(signal.SIGTERM, mine)
        for order in ("first_closed_first", "last_closed_first"):
            a, b = make("a" + order), make("b" + order)
            first, second = (a, b) if order == "first_closed_first" else (b, a)
            first.close()
            os.kill(os.getpid(), signal.SIGTERM)  # the open manager records it; the user's handler does not run
            print(order, first.preemption_requested, second.preemption_requested, seen)
            second.signals.signum = None  # forget it: the manager stays open
            second.close()
            assert signal.getsignal(signal.SIGTERM) is mine
            os.kill(os.getpid(), signal.SIGTERM)
            print(seen)
            seen.clear()
    """)
    assert proc.returncode == 0, proc.stderr
    term = int(signal.SIGTERM)
    assert proc.stdout.split("\n")[:4] == ["first_closed_first False True []", f"[{term}]",
                                          "last_closed_first False True []", f"[{term}]"]


def test_a_handler_set_after_the_manager_is_left_alone(tmp_path):
    proc = child(tmp_path, """
        mgr = make("a")
        signal.signal(signal.SIGTERM, mine)  # the user's own, installed after the manager's
        mgr.close()
        assert signal.getsignal(signal.SIGTERM) is mine
        os.kill(os.getpid(), signal.SIGTERM)
        print(seen, mgr.preemption_requested)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == f"[{int(signal.SIGTERM)}] False"


def test_a_caught_preempted_keeps_the_handler_until_release_kept_or_a_new_manager(tmp_path):
    """The documented rule (Preempted's docstring, README "Preemption and crashes"): after a Preempted the signals
    stay recorded (a second SIGTERM while the process exits changes nothing); a process that caught it gets its
    own handler back from fastckpt.release_kept(), or from the next manager's close()."""
    proc = child(tmp_path, """
        signal.signal(signal.SIGTERM, mine)
        out = []
        for name, release in (("a", fastckpt.release_kept), ("b", lambda: make("c").close())):
            mgr = make(name)
            mgr.request_preemption()
            try:
                mgr.step(1)
            except fastckpt.Preempted as exc:
                assert exc.path.is_dir()
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the kept handler: not passed on, not fatal
            out.append(len(seen))
            release()
            os.kill(os.getpid(), signal.SIGTERM)  # the process's own handler again
            out.append(len(seen))
        print(out)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[0, 1, 1, 2]"


def test_a_kept_handler_ignores_the_signals_while_the_interpreter_finalizes(tmp_path):
    """After a Preempted, an ``atexit`` function set the kept signals to SIG_IGN: Python's finalization puts SIG_DFL
    back in place of every Python handler after the atexit functions ran, and a SIGTERM repeated by the scheduler in
    that window ended a saved job with status 143. The child's own atexit function (registered first, so run after
    fastckpt's) sees SIG_IGN and sends itself SIGTERM; the process still exits with the Preempted code (0)."""
    proc = child(tmp_path, """
        import atexit
        def last():
            print(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        atexit.register(last)
        mgr = make("a")
        mgr.request_preemption()
        mgr.step(1)
    """)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert proc.stdout.strip().splitlines()[-1] == "True"

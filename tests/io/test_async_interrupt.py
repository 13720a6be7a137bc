"""Ctrl-C during ``AsyncSave.wait()``: the first raises ``KeyboardInterrupt`` and the save goes on (committed before
the interpreter exits); a second, while the save is still in flight (here: while the exiting interpreter joins
the writer thread), cancels it: nothing is committed and the previous checkpoint stays bit-exact.

The child process sends itself SIGINT from the writer thread, held before its commit, once the main thread is
where the keystroke is meant to land (seen in ``sys._current_frames()``: waiting inside ``AsyncSave.wait``; a
signal handled at the very first instruction of ``wait`` would raise before its ``try``, as a Ctrl-C just before the
call does): a handshake, no delays. An ``atexit`` hook keeps the process alive until the writer is done, so what
it commits is never cut short by the exit.

A Ctrl-C is a ``KeyboardInterrupt`` raised at whatever instruction the main thread runs. Issue 27.9 (the
``two_ctrl_c`` case hung under load): waiting through ``concurrent.futures.Future.result()``, one landing right
after the future's condition lock was taken left it held, so the writer blocked forever setting its result and the
exit hung joining it (see :mod:`fastckpt._io.async_save.outcome`). ``test_ctrl_c_at_any_instruction_of_wait...`` raises
it at every instruction of ``wait`` in turn, deterministically (an opcode trace), and the save must still finish.
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
import atexit, os, signal, sys, threading
sys.path.insert(0, {helpers!r})
import fastckpt
from fastckpt._io.async_save import cancel, stream as async_stream
from crash_worker import build_state

model, opt, sched = build_state({new}, {mb})
MAIN = threading.main_thread().ident


def main_in(*names, file=""):
    f = sys._current_frames().get(MAIN)
    while f is not None:
        if f.f_code.co_name in names and file in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def until(condition):
    tick = threading.Event()
    while not condition():  # polls a state; the outcome never depends on how long it takes
        tick.wait(0.001)


real = async_stream.StreamingSave.before_commit


def held(self, *checksums):  # the writer thread, every file written, before the commit
    until(lambda: main_in("wait", file="outcome.py"))  # inside AsyncSave.wait's try: where a Ctrl-C lands
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the main thread waits in handle.wait()
    until(lambda: cancel._armed)  # the main thread took it while the save was in flight (else the commit could win)
    if {second!r}:
        until(lambda: main_in("_python_exit", "_shutdown"))  # the interpreter exits and joins this thread
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C
        until(lambda: not main_in("_python_exit", "_shutdown"))
    return real(self, *checksums)


async_stream.StreamingSave.before_commit = held
handle = fastckpt.save_state(model, opt, sched, output_dir={target!r}, step={new}, async_save=True)
atexit.register(handle._outcome.wait)
try:
    handle.wait()
except KeyboardInterrupt as exc:
    print("interrupted", *getattr(exc, "__notes__", []), flush=True)
"""


@pytest.mark.parametrize("second", [False, True], ids=["one_ctrl_c", "two_ctrl_c"])
def test_ctrl_c_during_wait_commits_on_exit_unless_pressed_twice(tmp_path, second):
    import helpers

    target = tmp_path / "ckpt"
    fastckpt.save_state(*build_state(OLD, MB), output_dir=target, step=OLD)
    code = textwrap.dedent(_CHILD).format(helpers=str(Path(helpers.__file__).parent), new=NEW, mb=MB,
                                          target=str(target), second=second)
    proc = run_python(code)
    assert "interrupted" in proc.stdout and "press Ctrl-C again to cancel it" in proc.stdout, proc.stderr[-3000:]
    if second:
        assert "cancelled the async save(s) to" in proc.stderr, proc.stderr[-3000:]
        assert which_state(target, MB, {"old": OLD, "new": NEW}) == "old"
        fastckpt.verify_checkpoint(target)
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert which_state(target, MB, {"old": OLD, "new": NEW}) == "new"


@pytest.mark.parametrize("mode", [True, "snapshot"])
def test_cancel_before_the_commit_commits_nothing(tmp_path, held_writer, mode):
    from fastckpt.errors import SaveCancelledError

    model, opt, sched = build_state(OLD, MB)
    held_writer.set()
    fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c", step=OLD)
    held_writer.clear()
    new = build_state(NEW, MB)
    handle = fastckpt.save_state(*new, output_dir=tmp_path / "c", step=NEW, async_save=mode)
    assert handle.cancel() is True
    held_writer.set()
    with pytest.raises(SaveCancelledError, match="nothing was committed"):
        handle.wait()
    assert which_state(tmp_path / "c", MB, {"old": OLD, "new": NEW}) == "old"
    done = fastckpt.save_state(*new, output_dir=tmp_path / "c", step=NEW, async_save=mode)
    done.wait()
    assert done.cancel() is False  # committed: too late
    assert which_state(tmp_path / "c", MB, {"old": OLD, "new": NEW}) == "new"


_EVERY_INSTRUCTION = """
import sys, threading
sys.path.insert(0, {helpers!r})
import fastckpt
from fastckpt._io.async_save import stream as async_stream
from crash_worker import build_state

model, opt, sched = build_state({new}, {mb})
gate = threading.Event()
real = async_stream.StreamingSave.before_commit


def held(self, *checksums):  # the writer, every file written, waits before its commit
    gate.wait()
    return real(self, *checksums)


def interrupt_at(k):
    seen = [0]

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            if seen[0] == k:
                raise KeyboardInterrupt  # a Ctrl-C handled before this instruction (the trace is then unset)
            seen[0] += 1
        return trace
    return trace


async_stream.StreamingSave.before_commit = held
handle = fastckpt.save_state(model, opt, sched, output_dir={target!r}, step={new}, async_save=True)
k = interrupted = 0
others = []
try:
    while True:
        sys.settrace(interrupt_at(k))
        try:
            handle.wait(timeout=0)
        except KeyboardInterrupt:
            interrupted += 1
        except TimeoutError:
            break  # a whole call ran before instruction k: every instruction was interrupted once
        except Exception as exc:  # what a Ctrl-C must never turn into
            others.append(f"instruction {{k}}: {{type(exc).__name__}}: {{exc}}")
        finally:
            sys.settrace(None)
        k += 1
finally:
    gate.set()
print("others", others, flush=True)
waiter = threading.Thread(target=handle.wait)  # not the main thread: it must not need the main thread's help
waiter.start()
waiter.join()
print("committed", interrupted, k, flush=True)
"""


def test_ctrl_c_at_any_instruction_of_wait_never_blocks_the_writer(tmp_path):
    """A KeyboardInterrupt raised at each instruction of ``AsyncSave.wait`` in turn (the whole call tree: lock and
    condition code included) leaves nothing the writer or another waiter needs: the save commits, another thread's
    ``wait()`` returns, and the process exits. With ``concurrent.futures.Future`` underneath, the interrupt after
    ``Condition.__enter__`` took the future's lock made the writer block forever (this child hung)."""
    import helpers

    target = tmp_path / "ckpt"
    fastckpt.save_state(*build_state(OLD, MB), output_dir=target, step=OLD)
    code = textwrap.dedent(_EVERY_INSTRUCTION).format(helpers=str(Path(helpers.__file__).parent), new=NEW, mb=MB,
                                                      target=str(target))
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "others []" in proc.stdout, proc.stdout
    words = proc.stdout.splitlines()[-1].split()
    assert words[0] == "committed" and int(words[1]) == int(words[2]) > 10, proc.stdout
    assert which_state(target, MB, {"old": OLD, "new": NEW}) == "new"

"""Every CheckpointManager option is checked at construction, before a signal handler is installed or a memory tier
claimed: a bad one is fastckpt's OptionError (a ValueError) or OptionTypeError (a TypeError too) naming the option
and the value given, and the process is left as it was."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import fastckpt
from fastckpt.errors import CheckpointError, OptionError, OptionTypeError


def make(tmp_path, model=None, **kw):
    kw.setdefault("memory", tmp_path / "mem")
    kw.setdefault("every_n_steps", 2)
    return fastckpt.CheckpointManager(tmp_path / "proj", torch.nn.Linear(2, 2) if model is None else model, **kw)


@pytest.mark.parametrize("kw, exc, match", [
    ({"continuous": "no"}, OptionTypeError, "continuous must be True or False, got str 'no'"),
    ({"continuous": 1}, OptionTypeError, "continuous must be True or False, got int 1"),
    ({"every_seconds": float("inf")}, OptionError, "every_seconds must be a positive finite number of seconds, got inf"),
    ({"every_seconds": float("nan")}, OptionError, "every_seconds must be a positive finite number of seconds, got nan"),
    ({"every_seconds": -1.0}, OptionError, r"every_seconds must be a positive finite number of seconds, got -1\.0"),
    ({"every_seconds": 0}, OptionError, "every_seconds must be a positive finite number of seconds, got 0"),
    ({"every_seconds": "60"}, OptionTypeError, "every_seconds must be a positive finite number of seconds, got str"),
    ({"every_seconds": True}, OptionTypeError, "every_seconds must be .* got bool True"),
    ({"mtbf": float("inf")}, OptionError, "mtbf must be a positive finite number of seconds, got inf"),
    ({"mtbf": 3600, "every_seconds": 60}, OptionError, "mtbf=3600, every_seconds=60"),
    ({"every_n_steps": 0}, OptionError, "every_n_steps must be a positive int, got 0"),
    ({"every_n_steps": -3}, OptionError, "every_n_steps must be a positive int, got -3"),
    ({"every_n_steps": True}, OptionTypeError, "every_n_steps must be a positive int, got bool True"),
    ({"every_n_steps": 2.0}, OptionTypeError, "every_n_steps must be a positive int, got float 2.0"),
    ({"replicas": 1}, OptionError, "replicas=1 needs several processes"),
    ({"replicas": -1}, OptionError, "replicas must be an int >= 0, got -1"),
    ({"replicas": True}, OptionTypeError, "replicas must be an int >= 0, got bool True"),
    ({"keep": 0}, OptionError, r"keep must be an int >= 1 or None, got 0"),
    ({"keep": "3"}, OptionTypeError, r"keep must be an int >= 1 or None, got str '3'"),
    ({"threads": -1}, OptionError, "threads must be an int >= 0, got -1"),
    ({"timeout": 0}, OptionError, "timeout must be a positive number of seconds, got 0"),
    ({"timeout": "60"}, OptionError, "timeout must be a positive number of seconds, got '60'"),
    ({"host_memory_budget": "lots"}, OptionError, "host_memory_budget 'lots' is not a size"),
    ({"host_memory_budget": 1.5}, OptionTypeError, "host_memory_budget must be an int"),
    ({"remote": "/tmp/elsewhere"}, OptionError, "remote='/tmp/elsewhere' is not an s3:// URL"),
    ({"remote": "gs://bucket/run"}, OptionError, "remote"),
    ({"remote": "s3://"}, OptionError, "remote"),
    ({"remote": 5}, OptionTypeError, "remote must be an s3:// URL .str., got int 5"),
    ({"storage_options": {"region": "x"}}, OptionError, "storage_options=.* without remote="),
    ({"memory": "/proc/x"}, OptionError, "memory='/proc/x': this process cannot write its memory tier there"),
])
def test_a_bad_option_is_a_typed_error_naming_it_before_anything_is_installed(tmp_path, kw, exc, match):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    with pytest.raises(exc, match=match) as info:
        make(tmp_path, **kw)
    assert isinstance(info.value, CheckpointError)
    assert isinstance(info.value, TypeError if exc is OptionTypeError else ValueError)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before
    assert not (tmp_path / "mem").exists() and not (tmp_path / "proj").exists()


def test_an_empty_model_list_says_so(tmp_path):
    with pytest.raises(OptionTypeError, match=r"model=\[\] holds no module"):
        make(tmp_path, model=[])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through folder permissions")
def test_a_memory_folder_this_process_cannot_write_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(OptionError, match=f"memory='{locked / 'mem'}': this process cannot write"):
            make(tmp_path, memory=str(locked / "mem"))
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_a_read_only_memory_folder_is_refused(tmp_path, monkeypatch):
    """Whoever runs the test (root writes through permissions): the probe's own failure is what is reported."""
    import tempfile

    def refuse(*args, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(OptionError, match=r"memory='.*mem'.*PermissionError: Permission denied"):
        make(tmp_path, memory=str(tmp_path / "mem"))


def test_good_options_still_make_a_manager(tmp_path):
    mgr = make(tmp_path, every_seconds=30, continuous=False, keep=None, replicas=0, threads=2, timeout=5,
               host_memory_budget="1MB")
    assert mgr.interval_seconds == 30 and mgr.keep is None and mgr.budget == 10**6
    mgr.close()


@pytest.mark.parametrize("kw, exc, match", [
    ({"filename": "a/last.ckpt"}, OptionError, "filename must be a file name, got 'a/last.ckpt'"),
    ({"filename": 3}, OptionTypeError, "filename must be a file name .str., got int 3"),
    ({"signals": (signal.SIGKILL,)}, OptionError, "SIGKILL cannot be caught"),
    ({"signals": ("USR1",)}, OptionTypeError, "'USR1' is not a signal number"),
    ({"exit_code": 256}, OptionError, "preemption_exit_code must be in 0-255"),
    ({"exit_code": "3"}, OptionTypeError, "preemption_exit_code must be an int"),
    ({"timeout": -1}, OptionError, "timeout must be a positive number of seconds, got -1"),
])
def test_the_lightning_preemption_callback_checks_its_options_when_made(tmp_path, kw, exc, match):
    pytest.importorskip("pytorch_lightning")
    import fastckpt.lightning

    with pytest.raises(exc, match=match):
        fastckpt.lightning.PreemptionCheckpoint(tmp_path, **kw)


def test_the_trainer_preemption_signals_are_a_typed_error():
    from fastckpt.transformers.preemption import check_signals

    with pytest.raises(OptionError, match="fastckpt_preemption_signals: 9 is not a signal that can be caught"):
        check_signals([int(signal.SIGKILL)])


@pytest.mark.parametrize("where", ["durable writer", "event board", "second signal"])
def test_a_constructor_failing_after_the_claim_leaves_nothing_behind(tmp_path, monkeypatch, where):
    """A failure after the memory tier was claimed (and the project id written, the handler installed) undoes it
    all: no owner file, no folder made, the previous signal handlers back (the owner file stayed in /dev/shm)."""
    import gc

    from fastckpt.manager import preemption, starting

    preemption.release_kept()  # another test's manager, unclosed, would still hold the handlers: it is collected
    gc.collect()
    assert signal.getsignal(signal.SIGUSR1) is not preemption._dispatch, "a manager of another test is still open"

    class Boom(Exception):
        pass

    def boom(*args, **kw):
        raise Boom(where)

    if where == "durable writer":
        monkeypatch.setattr(starting, "DurableWriter", boom)
    elif where == "event board":
        monkeypatch.setattr(starting, "EventBoard", boom)
    else:  # SIGTERM installed, then SIGUSR1 refused
        real = signal.signal

        def second(signum, handler):
            if signum == signal.SIGUSR1 and handler is preemption._dispatch:
                raise Boom(where)
            return real(signum, handler)

        monkeypatch.setattr(preemption.signal, "signal", second)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    with pytest.raises(Boom):
        make(tmp_path, memory=tmp_path / "shm" / "job" / "rank0")
    monkeypatch.undo()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before
    assert list(tmp_path.iterdir()) == []  # no owner file, no memory folder, no project folder or id
    mgr = make(tmp_path, memory=tmp_path / "shm" / "job" / "rank0")  # nothing claimed: a new one works
    mgr.close()


def test_a_constructor_failing_on_the_default_memory_tier_leaves_no_owner_file(tmp_path, monkeypatch):
    from fastckpt._io.storage.memory import default_memory_root
    from fastckpt.manager import starting

    monkeypatch.setenv("FASTCKPT_JOB_ID", f"test-failed-constructor-{tmp_path.name}")
    job = default_memory_root(tmp_path / "proj", 0).parent
    monkeypatch.setattr(starting, "EventBoard", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        make(tmp_path, memory=True)
    assert not job.exists() and not (tmp_path / "proj").exists()


def test_preemption_signals_given_as_a_string_name_the_string():
    """``preemption_signals="TERM"`` named its first letter (``'T' is not a signal number``)."""
    from fastckpt.manager.options import check_signals

    with pytest.raises(OptionTypeError, match="must be a sequence of signal numbers .* got str 'TERM'"):
        check_signals("TERM")

"""pytest fixtures and hooks for the fastckpt suite; the helpers live in :mod:`helpers` (tests/helpers/)."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.common import official_model_file

#: Test modules that launch multi-process worlds (torchrun): under pytest-xdist they form one group, run one after
#: another on one worker (two worlds never compete for the cores and their collective timeouts), first, beside the
#: single-process tests on the other workers; ``make test-quick`` leaves them out (marker ``launches``).
LAUNCHES = frozenset({
    "tests/integrations/test_dcp_multiprocess.py",
    "tests/integrations/test_fsdp.py",
    "tests/integrations/test_fsdp_accelerate.py",
    "tests/integrations/test_fsdp_crash.py",
    "tests/integrations/test_multiprocess.py",
    "tests/integrations/test_participation.py",
    "tests/integrations/test_transformers_multiprocess.py",
})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the :data:`LAUNCHES` modules; under ``--dist loadgroup`` give every test without an ``xdist_group`` of
    its own its module's group (module-scoped fixtures such as one torchrun launch per world size then run once, on
    one worker) and the launching modules one shared group, scheduled first (the longest chain)."""
    for item in items:
        if item.nodeid.split("::")[0] in LAUNCHES:
            item.add_marker(pytest.mark.launches)
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers by --dist loadgroup
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            module = item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group("launches" if module in LAUNCHES else module))
    items.sort(key=lambda item: item.get_closest_marker("launches") is None)  # stable: launches first


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    return official_model_file()


@pytest.fixture(autouse=True)
def _deterministic_rngs():
    """Every test starts from the same global RNG state; the state is put back afterwards."""
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One closing line for the fault tests (see tests/helpers/fault_log.py)."""
    from helpers import fault_log as _fault_log

    failed = [r for r in terminalreporter.stats.get("failed", [])
              if any(f"{m}.py" in r.nodeid for m in _fault_log.FAULT_MODULES)]
    terminalreporter.write_line(_fault_log.summary_line(len(failed)))


@pytest.fixture
def new_accelerator():
    """``new_accelerator(**kw)``: a CPU ``accelerate.Accelerator`` on reset singleton state (tests/helpers/accelerate_state.py)."""
    from helpers.accelerate_state import accelerator_factory

    yield from accelerator_factory()


@pytest.fixture
def held_writer(monkeypatch):
    """Make async saves' background write wait until the test sets the returned event (the caller has moved on);
    afterwards every save in flight is waited for (a failed one, which the test expected, is not raised again)."""
    import fastckpt._io.storage.local.backend as checkpoint_module  # where a local save writes its plan
    from fastckpt._io.async_save import writer as async_writer
    from fastckpt.errors import CheckpointError

    go = threading.Event()
    real = checkpoint_module.write_checkpoint

    def gated(*args, **kwargs):
        assert go.wait(60), "the test never released the writer"
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "write_checkpoint", gated)
    yield go
    go.set()
    try:
        async_writer.default_saver().wait_all()
    except CheckpointError:
        pass


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on a free localhost port for the session, AWS_* pointed at it (tests/helpers/s3_server.py)."""
    from helpers.s3_server import moto_server

    yield from moto_server()


@pytest.fixture
def proxy(s3_endpoint):
    """A fault-injecting HTTP proxy in front of the session's S3 server (tests/helpers/s3_server.py)."""
    from helpers.s3_server import FaultProxy

    with FaultProxy(s3_endpoint) as p:
        yield p


@pytest.fixture
def s3_url(s3_endpoint, request) -> str:
    """A fresh ``s3://fastckpt-test/<test name>-<uuid>`` prefix on the session's server."""
    import re
    import uuid

    from helpers.s3_server import BUCKET

    return f"s3://{BUCKET}/{re.sub(r'[^A-Za-z0-9_.-]+', '-', request.node.name).strip('-')}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(autouse=True)
def _release_kept_preemption_handlers():
    """Many tests run managers and Trainers in one process: a case that caught ``Preempted`` leaves its signal
    handler kept until the process exits (``fastckpt.manager.preemption.SignalRecorder.keep_until_exit``, so a
    second signal cannot kill a preempted process); it is released after each case."""
    yield
    from fastckpt.manager.preemption import release_kept

    release_kept()

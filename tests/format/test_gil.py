"""The Rust core releases the GIL while it writes: threads behind a ``threading.Barrier`` are inside the core's
write call at the same time, and Python keeps running while a background save writes.

Deterministic, no sleeps and no timing: the writer's ``ready`` gate (the hook CUDA staging uses, called by the
core's worker threads *inside* the write call, before each chunk) makes each write wait for an event that only
Python code on another thread can produce. Had the calling thread kept the GIL inside the core, the worker could
not even call the gate (it needs the GIL for that) and no other thread could run: the barrier would time out
instead of tripping. The gate holds the GIL only for its own call and blocks in ``Barrier.wait`` /
``Event.wait``, which release it.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import nn

import fastckpt
import fastckpt._io.storage.local.backend as checkpoint_module  # where a local save writes its plan
from fastckpt._io.storage.local.commit import write_checkpoint
from fastckpt._plan.save import build_save_plan

TIMEOUT = 60  # seconds: only reached when the GIL is held (the test then fails instead of hanging)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))


def _first_call_waits(wait) -> object:
    """A ``ready`` gate whose first call (per gate) runs ``wait()``; later chunks pass straight through."""
    first = threading.Lock()

    def ready(spans: list[tuple[int, int]]) -> None:
        if first.acquire(blocking=False):
            wait()

    return ready


def test_two_saves_are_inside_the_writer_at_the_same_time(tmp_path):
    start, inside = threading.Barrier(2, timeout=TIMEOUT), threading.Barrier(2, timeout=TIMEOUT)
    models = [_model(1), _model(2)]
    errors: list[BaseException] = []

    def save(i: int) -> None:
        try:
            start.wait()
            plan = build_save_plan([models[i]], [], [], model_only=True)
            # Each write stops inside the core at its first chunk until the *other* write is inside too.
            write_checkpoint(plan, tmp_path / f"ckpt{i}", ready=_first_call_waits(inside.wait))
        except BaseException as exc:  # reported below, with the thread's traceback
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT)
    assert not errors, f"the two writes were never inside the core together (GIL held?): {errors!r}"
    for i, m in enumerate(models):
        loaded = _model(10 + i)
        fastckpt.load_state(loaded, input_dir=tmp_path / f"ckpt{i}")
        for (k, a), b in zip(m.state_dict().items(), loaded.state_dict().values()):
            assert torch.equal(a, b), k


def test_training_runs_python_while_an_async_save_is_inside_the_writer(tmp_path, monkeypatch):
    model = _model(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    inside, go = threading.Event(), threading.Event()

    def wait_for_training() -> None:
        inside.set()
        assert go.wait(TIMEOUT), "the training thread never ran while the writer was inside the core"

    gated = functools.partial(write_checkpoint, ready=_first_call_waits(wait_for_training))
    monkeypatch.setattr(checkpoint_module, "write_checkpoint", lambda plan, target, **kw: gated(plan, target, **kw))
    handle = fastckpt.save_state(model, output_dir=tmp_path / "ckpt", model_only=True, async_save=True)
    assert inside.wait(TIMEOUT), "the background write never reached the core"
    steps = 0
    while steps < 3:  # the writer thread is blocked inside the core's write call; this thread trains
        model(torch.randn(4, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    go.set()
    handle.wait(TIMEOUT)
    loaded = _model(4)
    fastckpt.load_state(loaded, input_dir=tmp_path / "ckpt")
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, expected[k]), k  # the values as of the call, not after the three steps


def test_a_ready_gate_exception_stops_the_write_and_is_raised(tmp_path):
    plan = build_save_plan([_model(5)], [], [], model_only=True)

    def refuse(spans: list[tuple[int, int]]) -> None:
        raise RuntimeError(f"not ready: {len(spans)} spans")

    try:
        write_checkpoint(plan, tmp_path / "ckpt", ready=refuse)
    except RuntimeError as exc:
        assert "not ready" in str(exc)
    else:
        raise AssertionError("the gate's exception was swallowed")
    assert not (tmp_path / "ckpt").exists()
    assert not [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")]

"""``save_state(..., async_save=...)`` to ``s3://``: every mode copies the state at the call and uploads the copy
on the writer thread; the upload is held on an event by the proxy in front of the moto server
(tests/helpers/s3_server.py), so the changes made meanwhile, the cancel and the load that waits are ordered
without sleeps."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.crash_worker import build_state
from helpers.procs import expected_fingerprint, loaded_fingerprint
from helpers.s3_server import Faults, key_prefix, keys, proxy_options

import fastckpt
import fastckpt.checkpoint
from fastckpt.errors import SaveCancelledError


class _Held:
    """Proxy faults that hold the first PUT of a safetensors object until :attr:`go` is set."""

    def __init__(self) -> None:
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self, method: str, path: str) -> None:
        if method == "PUT" and ".safetensors" in path and not self.reached.is_set():
            self.reached.set()
            assert self.go.wait(60), "the test never released the upload"


def _held(proxy) -> _Held:
    held = _Held()
    proxy.faults = Faults(hold=held)
    return held


def _saves(url: str) -> set[str]:
    return {k.split("/")[1] for k in keys(key_prefix(url) + "/") if "/save-" in k}


@pytest.mark.parametrize("mode", [True, "stream", "snapshot"])
def test_an_async_save_commits_the_state_at_the_call_while_training_changes_it(mode, proxy, s3_url):
    model, opt, sched = build_state(1, 2)
    held = _held(proxy)
    handle = fastckpt.save_state(model, opt, sched, output_dir=s3_url, async_save=mode,
                                 storage_options=proxy_options(proxy))
    assert held.reached.wait(60)
    for p in model.parameters():  # writes torch does not track, and a tracked step, during the upload
        p.data.mul_(0.5)
    opt.step()
    assert not handle.done()
    held.go.set()
    assert handle.wait() == s3_url
    assert loaded_fingerprint(s3_url, 2) == expected_fingerprint(1, 2)


def test_a_cancelled_async_save_commits_nothing_and_removes_its_objects(proxy, s3_url):
    fastckpt.save_state(*build_state(1, 2), output_dir=s3_url)
    before = _saves(s3_url)
    held = _held(proxy)
    handle = fastckpt.save_state(*build_state(2, 2), output_dir=s3_url, async_save=True,
                                 storage_options=proxy_options(proxy))
    assert held.reached.wait(60)
    assert handle.cancel() is True
    held.go.set()
    assert repr(handle).startswith(f"AsyncSave({s3_url!r}, running")
    with pytest.raises(SaveCancelledError, match=f"async save to {s3_url} was cancelled"):
        handle.wait()
    assert _saves(s3_url) == before
    assert loaded_fingerprint(s3_url, 2) == expected_fingerprint(1, 2)


def test_a_load_of_the_url_waits_for_the_async_save_in_flight(proxy, s3_url, monkeypatch):
    held = _held(proxy)
    handle = fastckpt.save_state(*build_state(3, 2), output_dir=s3_url, async_save=True,
                                 storage_options=proxy_options(proxy))
    assert held.reached.wait(60)
    real = fastckpt.checkpoint.wait_for_saves_to
    asked = []

    def release_then_wait(folder):  # the load has begun: let the upload go, then the load must wait for it
        asked.append(str(folder))
        held.go.set()
        real(folder)

    monkeypatch.setattr(fastckpt.checkpoint, "wait_for_saves_to", release_then_wait)
    assert loaded_fingerprint(s3_url, 2) == expected_fingerprint(3, 2)
    assert handle.done() and asked[0] == str(fastckpt.checkpoint.Path(s3_url))  # then the fetched folder's


def test_async_saves_with_automatic_naming_rotate_after_each_commit(s3_url):
    urls = []
    for seed in range(3):
        model, opt, sched = build_state(seed, 1)
        urls.append(fastckpt.save_state(model, opt, sched, project_dir=s3_url, total_limit=2, async_save=True).wait())
    assert urls == [f"{s3_url}/checkpoints/checkpoint_{n}" for n in range(3)]
    assert fastckpt.latest_checkpoint(s3_url) == urls[-1]
    assert {k.split("/")[2] for k in keys(key_prefix(s3_url) + "/checkpoints/")} == {"checkpoint_1", "checkpoint_2"}
    assert loaded_fingerprint(urls[-1], 1) == expected_fingerprint(2, 1)


def test_a_budget_below_the_state_is_refused_before_anything_is_sent(s3_url):
    model, opt, sched = build_state(1, 1)
    with pytest.raises(ValueError, match="host_memory_budget of 1,000 bytes is below"):
        fastckpt.save_state(model, opt, sched, output_dir=s3_url, async_save="stream", host_memory_budget=1000)
    assert keys(key_prefix(s3_url) + "/") == []
    assert torch.is_tensor(next(model.parameters()))


def test_a_numbered_local_snapshot_save_while_an_s3_save_is_in_flight(proxy, s3_url, tmp_path, monkeypatch):
    """Regression: the numbering of a local automatic name skipped the saves in flight by ``h.path.parent``, which
    an ``s3://`` save's handle (a ``str`` path) does not have: the local save raised AttributeError at the call."""
    from fastckpt._io.async_save import writer

    monkeypatch.setattr(writer, "_DEFAULT", writer.AsyncSaver(max_in_flight=2))  # both snapshots fit at once
    held = _held(proxy)
    remote = fastckpt.save_state(*build_state(1, 2), output_dir=s3_url, async_save="snapshot",
                                 storage_options=proxy_options(proxy))
    assert held.reached.wait(60)
    local = fastckpt.save_state(*build_state(2, 2), project_dir=tmp_path, async_save="snapshot")
    assert local.path == tmp_path.absolute() / "checkpoints" / "checkpoint_0"
    held.go.set()
    assert remote.wait() == s3_url
    assert local.wait() == tmp_path.absolute() / "checkpoints" / "checkpoint_0"
    assert loaded_fingerprint(s3_url, 2) == expected_fingerprint(1, 2)
    assert loaded_fingerprint(local.wait(), 2) == expected_fingerprint(2, 2)

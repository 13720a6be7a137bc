"""Writes torch does not track, made after ``save_state(..., async_save=...)`` returned: through ``p.data`` (its
own version counter), a ``.numpy()`` view, and from another thread. Every mode but the opt-in ``"stream"`` must
commit exactly the state at the call (``"snapshot"``) or raise ``ConcurrentModificationError`` and commit nothing
(``True``: the write guards or, where the kernel refuses them, the hashes taken at the call; both are run), the
previous checkpoint intact.

The writer thread is held at an event until the write under test is done (no sleeps).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from helpers.common import requires_cuda
from torch import nn

import fastckpt
from fastckpt._io.async_save import write_guard
from fastckpt.errors import ConcurrentModificationError

REFUSED = r"model\.safetensors:0\.weight.*(xxh3-128 at the call|written after save_state returned)"


@pytest.fixture(params=["guard", "hash"])
def proof(request, monkeypatch):
    """``async_save=True``'s two proofs: write guards (skipped where the kernel refuses them) or hashes at the call."""
    if request.param == "hash":
        monkeypatch.setattr(write_guard, "ENABLED", False)
    else:
        guard = write_guard.WriteGuard.open()
        if guard is None:
            pytest.skip(f"write guards unavailable here: {write_guard._refused}")
        guard.close()
    return request.param


def _check_proof(handle, proof: str) -> None:
    """The save pinned its streamed tensors the way ``proof`` says."""
    stream = handle._stream
    assert stream.proof is not None and stream.deferred
    if proof == "guard":
        assert set(stream.proof.guarded) == {d.id for d in stream.deferred}
    else:
        assert not stream.proof.guarded and len(stream.proof.hashes) == len(stream.deferred)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])  # 256 KiB weights: streamed, not copied


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"o.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def _loaded(path) -> dict[str, torch.Tensor]:
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fastckpt.load_state(model, opt, input_dir=path)
    return _state(model, opt)


def _assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(actual[k], v), k


def _halve_data(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.mul_(0.5)  # the repro: p.data has a version counter of its own


def _halve_numpy(model: nn.Module) -> None:
    for p in model.parameters():
        view = p.detach().numpy()  # shares memory, bumps no counter
        view *= 0.5


def _halve_in_thread(model: nn.Module) -> None:
    start, done = threading.Event(), threading.Event()

    def other() -> None:
        assert start.wait(60)
        _halve_data(model)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    start.set()
    assert done.wait(60)
    t.join()


def _first_and_last(model: nn.Module) -> None:
    for p in model.parameters():  # the bytes outside a guard's whole pages
        view = p.detach().reshape(-1).numpy()
        view[0] += 1.0
        view[-1] += 1.0


def _read_into(model: nn.Module) -> None:
    data = bytes(range(256)) * 32
    for p in model.parameters():  # the kernel writes (read() into the weights): no user-mode write at all
        view = p.detach().reshape(-1).view(torch.uint8).numpy()
        if len(view) < 4096 + len(data):
            continue  # a bias: copied at the call
        r, w = os.pipe()
        try:
            os.write(w, data)
            assert os.readv(r, [memoryview(view[4096:4096 + len(data)])]) == len(data)
        finally:
            os.close(r)
            os.close(w)


WRITES = {"data": _halve_data, "numpy": _halve_numpy, "thread": _halve_in_thread, "ends": _first_and_last,
          "syscall": _read_into}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("mode", [True, "snapshot"])
@pytest.mark.parametrize("then_step", [False, True], ids=["no_step", "then_step"])
def test_an_untracked_write_after_the_call_commits_the_call_state_or_raises(tmp_path, held_writer, write, mode,
                                                                             then_step, proof):
    if mode == "snapshot" and proof == "guard":
        pytest.skip("a snapshot guards nothing")
    model, opt = _trained()
    target = tmp_path / "c"
    held_writer.set()
    fastckpt.save_state(model, opt, output_dir=target, durable=False)
    previous = _state(model, opt)
    held_writer.clear()
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()  # the state at the call differs from the previous checkpoint
    at_call = _state(model, opt)
    handle = fastckpt.save_state(model, opt, output_dir=target, async_save=mode, durable=False)
    if mode is True:
        _check_proof(handle, proof)
    WRITES[write](model)
    if then_step:  # the step's hook copies the (changed) tensors not yet written
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
    held_writer.set()
    if mode is True and proof == "guard" and then_step and write == "ends":
        handle.wait()  # the step copied every tensor (writer held) and gave each copy the call's end bytes
        _assert_same(_loaded(target), at_call)
    elif mode is True:
        with pytest.raises(ConcurrentModificationError, match=REFUSED):
            handle.wait()
        _assert_same(_loaded(target), previous)
    else:
        handle.wait()
    if mode is True:
        assert not handle._stream.proof.guard or handle._stream.proof.guard._fd == -1  # every guard released


@pytest.mark.parametrize("then_step", [False, True], ids=["no_step", "then_step"])
def test_true_without_a_change_commits_the_call_state_and_reads_it_once(tmp_path, held_writer, proof, then_step):
    model, opt = _trained()
    at_call = _state(model, opt)
    handle = fastckpt.save_state(model, opt, output_dir=tmp_path / "c", async_save=True, durable=False)
    streamed = sum(v.numel() * v.element_size() for v in at_call.values()) - handle.snapshot_bytes
    assert streamed > 0 and handle.snapshot_bytes < streamed // 4  # guarded or hashed, not copied
    _check_proof(handle, proof)
    if then_step:  # the step's hook copies every tensor (the writer is held) and releases the guards
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
    held_writer.set()
    handle.wait()
    _assert_same(_loaded(tmp_path / "c"), at_call)
    if then_step:  # the step wrote the parameters after the save released them: the next save takes the new state
        after = _state(model, opt)
        fastckpt.save_state(model, opt, output_dir=tmp_path / "d", async_save=True, durable=False).wait()
        _assert_same(_loaded(tmp_path / "d"), after)


def test_stream_is_the_opt_in_without_hashes(tmp_path, held_writer):
    model, opt = _trained()
    handle = fastckpt.save_state(model, opt, output_dir=tmp_path / "c", async_save="stream", durable=False)
    assert handle._stream.proof is None
    with torch.no_grad():
        model[0].weight.add_(1.0)  # tracked by the version counter: still refused
    held_writer.set()
    with pytest.raises(ConcurrentModificationError, match="version counter"):
        handle.wait()
    assert not (tmp_path / "c").exists()


@requires_cuda
def test_cuda_true_commits_the_call_state_after_a_data_write(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 256, device="cuda")).square().mean().backward()
    opt.step()
    at_call = {k: v.cpu() for k, v in _state(model, opt).items()}
    handle = fastckpt.save_state(model, opt, output_dir=tmp_path / "c", async_save=True, durable=False)
    _halve_data(model)  # queued on the caller's stream, after the copies
    handle.wait()
    _assert_same(_loaded(tmp_path / "c"), at_call)

"""Writes torch does not track, made after ``save_state(..., async_save=...)`` returned: through ``p.data`` (its
own version counter), a ``.numpy()`` view, and from another thread. Every mode but the opt-in ``"stream"`` must
commit exactly the state at the call (``"snapshot"``) or raise ``ConcurrentModificationError`` and commit nothing
(``True``: the hashes taken at the call), the previous checkpoint intact.

The writer thread is held at an event until the write under test is done (no sleeps).
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.common import requires_cuda
from torch import nn

import fastckpt
from fastckpt.errors import ConcurrentModificationError


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


WRITES = {"data": _halve_data, "numpy": _halve_numpy, "thread": _halve_in_thread}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("mode", [True, "snapshot"])
@pytest.mark.parametrize("then_step", [False, True], ids=["no_step", "then_step"])
def test_an_untracked_write_after_the_call_commits_the_call_state_or_raises(tmp_path, held_writer, write, mode,
                                                                             then_step):
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
    WRITES[write](model)
    if then_step:  # the step's hook copies the (changed) tensors not yet written
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
    held_writer.set()
    if mode is True:
        with pytest.raises(ConcurrentModificationError, match=r"model\.safetensors:0\.weight.*xxh3-128 at the call"):
            handle.wait()
        _assert_same(_loaded(target), previous)
    else:
        handle.wait()
        _assert_same(_loaded(target), at_call)


def test_true_without_a_change_commits_the_call_state_and_reads_it_once(tmp_path, held_writer):
    model, opt = _trained()
    at_call = _state(model, opt)
    handle = fastckpt.save_state(model, opt, output_dir=tmp_path / "c", async_save=True, durable=False)
    streamed = sum(v.numel() * v.element_size() for v in at_call.values()) - handle.snapshot_bytes
    assert streamed > 0 and handle.snapshot_bytes < streamed // 4  # hashed, not copied
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    held_writer.set()
    handle.wait()
    _assert_same(_loaded(tmp_path / "c"), at_call)


def test_stream_is_the_opt_in_without_hashes(tmp_path, held_writer):
    model, opt = _trained()
    handle = fastckpt.save_state(model, opt, output_dir=tmp_path / "c", async_save="stream", durable=False)
    assert handle._stream.call_hashes is None
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

"""``save_state(..., async_save=True)`` streams from the live tensors: the checkpoint holds exactly the values at the
call while training goes on, buffers are copied at the call, each optimizer's step takes over only its own unwritten
tensors, in-place changes outside a step fail the save (never a mix), the budget path, a crash mid-write, and a
load that waits for the save in flight.

Where the write must happen after the caller moved on, the writer thread is held at a ``threading.Event``
(no sleeps), so what is checked never depends on timing.
"""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from helpers.common import requires_cuda
from torch import nn

import fastckpt
import fastckpt.checkpoint as checkpoint_module
from fastckpt._io.async_save import writer as _async
from fastckpt.errors import ConcurrentModificationError


class Net(nn.Module):
    """Tensors of 128-512 KiB (streamed, not copied at the call) and a BatchNorm (buffers change in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.bn = nn.BatchNorm1d(256)
        self.b = nn.Linear(256, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.bn(self.a(x)))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return model(torch.randn(16, 256, generator=g)).square().mean()


def _step(model: nn.Module, optimizers: list[torch.optim.Optimizer], seed: int) -> None:
    _loss(model, seed).backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _everything(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for j, opt in enumerate(optimizers):
        for p, state in opt.state.items():
            for k, v in state.items():
                out[f"o{j}.{names[id(p)]}.{k}"] = v.clone()
    return out


def _loaded(path, optimizers_of: callable) -> dict:
    model = _net(99)
    optimizers = optimizers_of(model)
    fastckpt.load_state(model, optimizers, input_dir=path)
    return _everything(model, optimizers)


def _assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(actual[k], v), k


def _adam(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(model.parameters(), lr=1e-2)]




@pytest.mark.parametrize("hold", [True, False])
def test_checkpoint_holds_the_values_at_the_call_while_three_steps_run(tmp_path, request, hold):
    go = request.getfixturevalue("held_writer") if hold else None
    model = _net()
    opts = _adam(model)
    _step(model, opts, 1)
    expected = _everything(model, opts)
    handle = fastckpt.save_state(model, opts, output_dir=tmp_path / "c", async_save=True, durable=False)
    assert handle.snapshot_bytes < sum(v.numel() * v.element_size() for v in expected.values()) // 4
    for seed in (2, 3, 4):
        _step(model, opts, seed)
    assert not torch.equal(model.a.weight, expected["m.a.weight"])
    if go is not None:
        assert not handle.done()
        go.set()
    handle.wait()
    _assert_same(_loaded(tmp_path / "c", _adam), expected)
    assert opts[0]._optimizer_step_pre_hooks == {}  # removed once the save is done


def test_batchnorm_buffers_changed_by_the_next_forward_are_saved_as_at_the_call(tmp_path, held_writer):
    model = _net()
    opts = _adam(model)
    _step(model, opts, 1)
    expected = _everything(model, opts)
    handle = fastckpt.save_state(model, opts, output_dir=tmp_path / "c", async_save=True, durable=False)
    _loss(model, 7).backward()  # the forward updates running_mean / running_var / num_batches_tracked
    assert not torch.equal(model.bn.running_mean, expected["m.bn.running_mean"])
    held_writer.set()
    handle.wait()
    _assert_same(_loaded(tmp_path / "c", _adam), expected)


def test_an_in_place_change_outside_the_step_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path, held_writer):
    model = _net()
    opts = _adam(model)
    _step(model, opts, 1)
    held_writer.set()
    fastckpt.save_state(model, opts, output_dir=tmp_path / "c", durable=False)
    previous = _everything(model, opts)
    held_writer.clear()
    _step(model, opts, 2)
    handle = fastckpt.save_state(model, opts, output_dir=tmp_path / "c", async_save=True, durable=False)
    with torch.no_grad():
        model.b.weight.mul_(0.5)  # an EMA-like update outside optimizer.step()
    _step(model, opts, 3)
    held_writer.set()
    with pytest.raises(ConcurrentModificationError, match=r"model\.safetensors:b\.weight.*async_save='snapshot'"):
        handle.wait()
    assert isinstance(handle.exception(), RuntimeError)
    _assert_same(_loaded(tmp_path / "c", _adam), previous)


@pytest.mark.parametrize("when", ["before_step", "after_written"])
def test_an_in_place_change_is_absent_or_fails_the_save_never_a_mix(tmp_path, request, when):
    # "before_step": the change is complete before the writer reads the tensor (the writer is held until then).
    # An op still running on another thread while the writer reads it is the documented limit: its version
    # counter moves only when it ends (the crc32c re-check at commit narrows that window, it cannot close it).
    go = request.getfixturevalue("held_writer") if when == "before_step" else None
    model = _net()
    opts = _adam(model)
    _step(model, opts, 1)
    at_call = _everything(model, opts)
    handle = fastckpt.save_state(model, opts, output_dir=tmp_path / "c", async_save=True, durable=False)
    if when == "after_written":
        handle.wait()
    with torch.no_grad():
        model.a.weight.add_(1.0)
    if go is not None:
        go.set()
    try:
        handle.wait()
    except ConcurrentModificationError:
        assert not (tmp_path / "c").exists()
        return
    _assert_same(_loaded(tmp_path / "c", _adam), at_call)


def test_two_optimizers_each_take_over_only_their_own_tensors(tmp_path, held_writer):
    def two(model: nn.Module) -> list[torch.optim.Optimizer]:
        return [torch.optim.AdamW([*model.a.parameters(), *model.bn.parameters()], lr=1e-2),
                torch.optim.SGD(model.b.parameters(), lr=0.1, momentum=0.9)]

    model = _net()
    opts = two(model)
    _step(model, opts, 1)
    expected = _everything(model, opts)
    handle = fastckpt.save_state(model, opts, output_dir=tmp_path / "c", async_save=True, durable=False)
    stream = handle._stream
    _loss(model, 2).backward()
    opts[0].step()  # only optimizer 0's tensors are taken over here
    assert all(d.safe == (0 in d.owners) for d in stream.deferred)
    opts[1].step()
    assert all(d.safe for d in stream.deferred)
    _step(model, opts, 3)
    held_writer.set()
    handle.wait()
    _assert_same(_loaded(tmp_path / "c", two), expected)


def test_parameters_no_optimizer_owns_are_copied_at_the_call(tmp_path, held_writer):
    def subset(model: nn.Module) -> list[torch.optim.Optimizer]:
        return [torch.optim.AdamW(model.b.parameters(), lr=1e-2)]

    model = _net()
    opts = subset(model)
    _step(model, opts, 1)
    expected = _everything(model, opts)
    handle = fastckpt.save_state(model, opts, output_dir=tmp_path / "c", async_save=True, durable=False)
    assert {d.name.split(":")[1] for d in handle._stream.deferred} == {"b.weight", "state.b.weight.exp_avg",
                                                                      "state.b.weight.exp_avg_sq"}
    with torch.no_grad():
        model.a.weight.zero_()  # not owned by the optimizer: copied at the call, so this is allowed
    _step(model, opts, 2)
    held_writer.set()
    handle.wait()
    _assert_same(_loaded(tmp_path / "c", subset), expected)


@pytest.mark.parametrize("budget", [0, "300KB", 600_000])
def test_a_budget_below_the_state_copies_what_fits_and_waits_for_the_rest(tmp_path, held_writer, budget):
    model = _net()
    opts = _adam(model)
    _step(model, opts, 1)
    expected = _everything(model, opts)
    fastckpt.release_buffers()  # a fresh pool: the save allocates what it needs (nothing for budget 0)
    opts[0].register_step_pre_hook(lambda *_: held_writer.set())  # runs before the save's hook: writer starts
    handle = fastckpt.save_state(model, opts, output_dir=tmp_path / "c", async_save=True, durable=False,
                                 host_memory_budget=budget)
    stream = handle._stream
    limit = {0: 0, "300KB": 300_000, 600_000: 600_000}[budget]
    assert stream.budget == limit
    for seed in (2, 3, 4):
        _step(model, opts, seed)
    assert stream._used <= limit
    handle.wait()
    _assert_same(_loaded(tmp_path / "c", _adam), expected)
    assert fastckpt.release_buffers() >= 0 and _async.default_saver().pool.nbytes == 0


def test_a_step_waiting_for_the_writer_goes_on_when_the_write_fails(tmp_path, held_writer):
    model = _net()
    opts = _adam(model)
    _step(model, opts, 1)
    (tmp_path / "file").mkdir()
    opts[0].register_step_pre_hook(lambda *_: held_writer.set())  # the writer starts, then fails at once
    handle = fastckpt.save_state(model, opts, output_dir=tmp_path / "file" / "c", async_save=True,
                                 host_memory_budget=0)  # the step must wait for the writer: nothing is copied
    shutil.rmtree(tmp_path / "file")  # the folder (and the staging folder the call claimed in it) becomes a file
    # before the held writer starts: its write fails
    (tmp_path / "file").write_text("not a folder")
    stepped = threading.Thread(target=_step, args=(model, opts, 2))
    stepped.start()
    stepped.join(60)
    assert not stepped.is_alive(), "the optimizer step hangs after the write failed"
    with pytest.raises(OSError):
        handle.wait()


def test_a_bad_budget_or_mode_is_refused_before_anything_is_copied(tmp_path):
    model = _net()
    with pytest.raises(ValueError, match="host_memory_budget"):
        fastckpt.save_state(model, output_dir=tmp_path / "c", async_save=True, host_memory_budget="4 parsecs")
    with pytest.raises(ValueError, match="async_save"):
        fastckpt.save_state(model, output_dir=tmp_path / "c", async_save="later")
    assert not (tmp_path / "c").exists()


def test_a_load_waits_for_the_save_in_flight_to_its_folder(tmp_path, held_writer, monkeypatch):
    model = _net()
    opts = _adam(model)
    held_writer.set()
    fastckpt.save_state(model, opts, output_dir=tmp_path / "c", durable=False)  # the previous checkpoint
    held_writer.clear()
    _step(model, opts, 1)
    expected = _everything(model, opts)
    waiting = threading.Event()
    real_wait = checkpoint_module.wait_for_saves_to

    def spy(folder):
        waiting.set()
        return real_wait(folder)

    monkeypatch.setattr(checkpoint_module, "wait_for_saves_to", spy)
    fastckpt.save_state(model, opts, output_dir=tmp_path / "c", async_save=True, durable=False)
    _step(model, opts, 2)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(_loaded(tmp_path / "c", _adam)))
    reader.start()
    assert waiting.wait(60)
    held_writer.set()
    reader.join(60)
    _assert_same(got[0], expected)


@requires_cuda
@pytest.mark.parametrize("mode", [True, "stream"])
def test_cuda_checkpoint_holds_the_values_at_the_call(tmp_path, mode):
    torch.manual_seed(0)
    model = Net().cuda()
    opts = _adam(model)
    x = torch.randn(16, 256, device="cuda")
    for _ in range(2):
        model(x).square().mean().backward()
        opts[0].step()
    expected = {k: v.cpu() for k, v in _everything(model, opts).items()}
    handle = fastckpt.save_state(model, opts, output_dir=tmp_path / "c", async_save=mode, durable=False)
    for _ in range(3):
        model(x).square().mean().backward()
        opts[0].step()
    handle.wait()
    fresh = Net().cuda()
    fresh_opts = _adam(fresh)
    fastckpt.load_state(fresh, fresh_opts, input_dir=tmp_path / "c")
    _assert_same({k: v.cpu() for k, v in _everything(fresh, fresh_opts).items()}, expected)


class Wide(nn.Module):
    """A 9 MB weight: it spans two 8 MiB write chunks, so a 256 KiB content-hash block runs across a chunk end."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(1500, 1500)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x)


@pytest.mark.parametrize("hold", [False, True], ids=["racing", "taken-over"])
@pytest.mark.parametrize("durable", [False, True], ids=["buffered", "durable"])
def test_checksums_and_content_hashes_match_the_bytes_written_while_steps_run(tmp_path, request, hold, durable):
    # the writer hashes blocks that run past its chunk from the source it reads; once a step has taken a tensor
    # over, that source is the copy, so the recorded xxh3-128 must still be the hash of the bytes in the file
    go = request.getfixturevalue("held_writer") if hold else None
    torch.manual_seed(0)
    model = Wide()
    opts = [torch.optim.AdamW(model.parameters(), lr=1e-2)]

    def step(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        model(torch.randn(4, 1500, generator=g)).square().mean().backward()
        opts[0].step()
        opts[0].zero_grad(set_to_none=True)

    step(1)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    handle = fastckpt.save_state(model, opts, output_dir=tmp_path / "c", async_save=True, durable=durable)
    for seed in (2, 3):
        step(seed)
    if go is not None:
        go.set()
    handle.wait()
    report = fastckpt.verify_checkpoint(tmp_path / "c")  # crc32c and xxh3-128 of every tensor, from the files
    assert report.problems == [] and report.hashes_checked >= 4  # w.weight, w.bias, exp_avg / exp_avg_sq ...
    loaded = Wide()
    fastckpt.load_state(loaded, input_dir=tmp_path / "c", model_only=True)
    for k, v in expected.items():
        assert torch.equal(loaded.state_dict()[k], v), k

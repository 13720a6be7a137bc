"""``save_state(..., async_save=True)``: the checkpoint holds the values as of the call while training goes on,
failures surface on ``wait()`` or on the next save, the host buffer pool is allocated once and reused, at most
one save is in flight, and automatic names / rotation / sync saves keep their order.

Where a test needs the write to happen *after* the caller moved on, it holds the writer thread at a
``threading.Event`` (no sleeps), so what is checked never depends on timing.
"""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from torch import nn

import fastckpt
from fastckpt._io.async_save import writer as _async
from fastckpt._io.async_save.host_pool import HostBufferPool
from fastckpt._io.async_save.writer import AsyncSave


def _model_and_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 64, generator=g)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _state_clone(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moments = {(i, k): v.clone() for i, p in enumerate(model.parameters()) for k, v in optimizer.state[p].items()}
    return weights, moments


def _assert_loaded_equals(path, weights: dict, moments: dict, seed: int = 99) -> None:
    model, optimizer = _model_and_optimizer(seed)
    fastckpt.load_state(model, optimizer, input_dir=path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for i, p in enumerate(model.parameters()):
        for k, v in optimizer.state[p].items():
            assert torch.equal(v, moments[(i, k)]), (i, k)




def test_checkpoint_holds_the_values_at_the_call_while_training_goes_on(tmp_path, held_writer):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    weights, moments = _state_clone(model, optimizer)
    handle = fastckpt.save_state(model, optimizer, output_dir=tmp_path / "ckpt", async_save=True)
    assert isinstance(handle, AsyncSave) and not handle.done()
    for seed in (2, 3, 4):  # the next optimizer steps update every parameter and moment in place
        _step(model, optimizer, seed)
    assert not torch.equal(model[0].weight, weights["0.weight"])
    held_writer.set()
    assert handle.wait() == (tmp_path / "ckpt").absolute()
    assert handle.done() and handle.exception() is None
    _assert_loaded_equals(tmp_path / "ckpt", weights, moments)


def test_async_save_without_holding_the_writer_round_trips(tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    weights, moments = _state_clone(model, optimizer)
    handle = fastckpt.save_state(model, optimizer, output_dir=tmp_path / "ckpt", async_save=True)
    _step(model, optimizer, 2)
    handle.wait()
    _assert_loaded_equals(tmp_path / "ckpt", weights, moments)
    assert handle.blocking_seconds >= 0 and handle.snapshot_bytes >= sum(
        t.numel() * 4 for t in [*weights.values(), *moments.values()])


def test_the_host_buffer_pool_is_allocated_once_and_reused(tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    handles = []
    for i in range(3):
        handles.append(fastckpt.save_state(model, optimizer, output_dir=tmp_path / f"c{i}", async_save="snapshot"))
        handles[-1].wait()
        _step(model, optimizer, 10 + i)
    assert len({h.buffer_ptr for h in handles}) == 1 and handles[0].buffer_ptr != 0
    assert handles[-1].pool_allocations == handles[0].pool_allocations


def test_pool_grows_only_for_a_larger_state_and_bounds_saves_in_flight():
    pool = HostBufferPool(2, pin_memory=False)
    a = pool.acquire(1000)
    b = pool.acquire(10)
    assert pool.in_use() == 2 and a.capacity == 1000 and b.capacity == 10
    with pytest.raises(TimeoutError, match="no free host buffer slot"):
        pool.acquire(1, timeout=0.01)
    pool.release(b)
    pool.release(a)
    again = pool.acquire(500)  # the smallest slot that fits: no new allocation
    assert again is a and again.allocations == 1
    pool.release(again)
    bigger = pool.acquire(5000)
    assert bigger.capacity == 5000 and bigger.allocations == 2


def test_a_second_async_save_waits_for_the_first(tmp_path, held_writer):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    first = fastckpt.save_state(model, optimizer, output_dir=tmp_path / "a", async_save=True)
    second: list[AsyncSave] = []
    t = threading.Thread(target=lambda: second.append(
        fastckpt.save_state(model, optimizer, output_dir=tmp_path / "b", async_save=True)))
    t.start()
    assert not second and not first.done()  # one slot: the second save waits for the first to be written
    held_writer.set()
    t.join(60)
    assert first.done() and second and second[0].wait() == (tmp_path / "b").absolute()


def _becomes_a_file(folder) -> None:
    """Replace the folder ``folder`` (holding only the staging folder the call claimed) by a file: a held async
    write into it then fails in the writer (a save is refused at the call when its folder already lies under a
    file)."""
    shutil.rmtree(folder)
    folder.write_text("not a folder")


def test_a_failure_is_raised_by_wait(tmp_path, held_writer):
    model, _ = _model_and_optimizer()
    (tmp_path / "file").mkdir()
    handle = fastckpt.save_state(model, output_dir=tmp_path / "file" / "ckpt", async_save=True)
    _becomes_a_file(tmp_path / "file")
    held_writer.set()
    with pytest.raises(OSError):
        handle.wait()
    assert isinstance(handle.exception(), OSError)
    fastckpt.save_state(model, output_dir=tmp_path / "ok")  # reported by wait(): not raised again


def test_a_failure_is_raised_by_the_next_save_once(tmp_path, held_writer):
    model, _ = _model_and_optimizer()
    (tmp_path / "file").mkdir()
    fastckpt.save_state(model, output_dir=tmp_path / "file" / "ckpt", async_save=True)
    _becomes_a_file(tmp_path / "file")
    held_writer.set()
    with pytest.raises(OSError) as info:
        fastckpt.save_state(model, output_dir=tmp_path / "next", async_save=True)
    assert any("earlier async save" in note for note in getattr(info.value, "__notes__", []))
    assert not (tmp_path / "next").exists()  # the save that raised was not made
    fastckpt.save_state(model, output_dir=tmp_path / "after", async_save=True).wait()
    assert (tmp_path / "after" / "model.safetensors").is_file()


def test_a_sync_save_waits_for_async_saves_in_flight(tmp_path, held_writer):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    handle = fastckpt.save_state(model, optimizer, output_dir=tmp_path / "ckpt", async_save=True)
    done: list = []
    t = threading.Thread(target=lambda: done.append(fastckpt.save_state(model, output_dir=tmp_path / "sync",
                                                                        model_only=True)))
    t.start()
    assert not done and not handle.done()
    held_writer.set()
    t.join(60)
    assert handle.done() and done == [(tmp_path / "sync").absolute()]


def test_automatic_names_skip_saves_in_flight_and_rotation_runs_after_commit(tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    paths = []
    for i in range(3):
        paths.append(fastckpt.save_state(model, optimizer, project_dir=tmp_path, total_limit=2, step=i,
                                         async_save=True).path)
    _async.default_saver().wait_all()
    assert [p.name for p in paths] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith(".")) == [
        "checkpoint_1", "checkpoint_2"]
    assert fastckpt.latest_checkpoint(tmp_path) == paths[-1]


def test_a_tensor_the_format_cannot_hold_is_refused_before_anything_is_copied(tmp_path):
    class Sparse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("s", torch.eye(3).to_sparse())

    with pytest.raises(ValueError, match="'s'"):
        fastckpt.save_state(Sparse(), output_dir=tmp_path / "c", async_save=True)
    assert _async.default_saver().pool.in_use() == 0


def test_non_contiguous_and_tied_tensors_are_snapshotted_exactly(tmp_path, held_writer):
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = nn.Parameter(torch.arange(12.0).reshape(3, 4).t())  # transposed view
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight  # tied
            self.register_buffer("h16", torch.arange(6, dtype=torch.float16))
            self.register_buffer("flag", torch.tensor([True, False]))

    model = Odd()
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    handle = fastckpt.save_state(model, output_dir=tmp_path / "c", async_save=True)
    with torch.no_grad():
        for p in model.state_dict().values():
            p.copy_(torch.zeros_like(p))
    held_writer.set()
    handle.wait()
    fresh = Odd()
    fastckpt.load_state(fresh, input_dir=tmp_path / "c")
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k

"""CUDA staging and loading: GPU tensors reach the file through reused pinned buffers (chunked copies on a side
stream, the write of chunk k overlapping the copy of chunk k+1), and loads to a GPU go through pinned bounce
buffers, into the live tensors where they exist.

The first test runs everywhere: it drives the writer's per-chunk ``ready`` gate with simulated device copies that
only land when waited for, so any chunk written before its copy would put wrong bytes in the file. The others need
a GPU and skip cleanly without one. ``benches/cuda_check.py`` runs this file's tests on a device machine without
pytest (each ``test_*`` takes a ``tmp_path`` folder and nothing else).
"""

from __future__ import annotations

import torch
from torch import nn

import fastckpt
from fastckpt._io.async_save.host_pool import HostBufferPool
from fastckpt._io.async_save.snapshot import Snapshot, _Copy, snapshot_plan
from fastckpt._io.storage.local.commit import write_checkpoint
from fastckpt._plan.save import build_save_plan

try:
    import pytest
except ImportError:  # benches/cuda_check.py: a device machine may have no pytest
    pytest = None


def needs_cuda(fn):
    if pytest is None:
        return fn
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(fn)


class _LateCopy:
    """A stand-in for a CUDA event: the simulated device-to-host copy happens only when it is waited for."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst, self.src, self.waited = dst, src, False

    def synchronize(self) -> None:
        self.dst.copy_(self.src)
        self.waited = True


def test_ready_gate_writes_each_chunk_only_after_its_copy_landed(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 300))
    fastckpt.save_state(model, output_dir=tmp_path / "reference", model_only=True)
    plan = build_save_plan([model], [], [], model_only=True)
    snap = snapshot_plan(plan, HostBufferPool(1, pin_memory=False))
    truth = snap.slot.buffer[: snap.nbytes].clone()
    snap.slot.buffer.fill_(0xA5)  # the "device copies" have not landed yet
    chunk = 100_000  # many copies per tensor, and copies that straddle tensors
    events = [_LateCopy(snap.slot.buffer[a : a + chunk], truth[a : a + chunk]) for a in range(0, snap.nbytes, chunk)]
    late = Snapshot(snap.plan, snap.slot, snap.nbytes,
                    [_Copy(a, min(a + chunk, snap.nbytes), e) for a, e in zip(range(0, snap.nbytes, chunk), events)])
    write_checkpoint(late.plan, tmp_path / "staged", ready=late.ready)
    assert all(e.waited for e in events)
    ref = (tmp_path / "reference" / "model.safetensors").read_bytes()
    assert (tmp_path / "staged" / "model.safetensors").read_bytes() == ref


def _cuda_state(seed: int = 0, width: int = 256):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 64)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def _train(model, optimizer, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    model(torch.randn(16, model[0].in_features, device="cuda", generator=g)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _cpu_clone(model, optimizer) -> tuple[dict, dict]:
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    moments = {(i, k): v.detach().cpu().clone() for i, p in enumerate(model.parameters())
               for k, v in optimizer.state[p].items()}
    return weights, moments


def _assert_state(model, optimizer, weights: dict, moments: dict) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v.cpu(), weights[k]), k
    for i, p in enumerate(model.parameters()):
        for k, v in optimizer.state[p].items():
            assert torch.equal(v.cpu(), moments[(i, k)]), (i, k)


@needs_cuda
def test_sync_save_of_cuda_state_equals_the_values(tmp_path):
    model, optimizer = _cuda_state()
    _train(model, optimizer, 1)
    weights, moments = _cpu_clone(model, optimizer)
    fastckpt.save_state(model, optimizer, output_dir=tmp_path / "ckpt")
    fresh, fresh_opt = _cuda_state(seed=7)
    _train(fresh, fresh_opt, 2)
    fastckpt.load_state(fresh, fresh_opt, input_dir=tmp_path / "ckpt")
    _assert_state(fresh, fresh_opt, weights, moments)


@needs_cuda
def test_async_save_of_cuda_state_holds_the_values_at_the_call(tmp_path):
    model, optimizer = _cuda_state(width=1024)
    _train(model, optimizer, 1)
    weights, moments = _cpu_clone(model, optimizer)
    handle = fastckpt.save_state(model, optimizer, output_dir=tmp_path / "ckpt", async_save=True)
    for seed in (2, 3, 4):  # queued on the caller's stream behind the snapshot's copies
        _train(model, optimizer, seed)
    handle.wait()
    assert not torch.equal(model[0].weight.cpu(), weights["0.weight"])
    fresh, fresh_opt = _cuda_state(seed=7, width=1024)
    _train(fresh, fresh_opt, 5)
    fastckpt.load_state(fresh, fresh_opt, input_dir=tmp_path / "ckpt")
    _assert_state(fresh, fresh_opt, weights, moments)
    from fastckpt._io.async_save.writer import default_saver

    assert all(s.buffer is None or s.buffer.is_pinned() for s in default_saver().pool.slots)


@needs_cuda
def test_load_into_existing_cuda_state_fills_the_live_tensors(tmp_path):
    model, optimizer = _cuda_state()
    _train(model, optimizer, 1)
    weights, moments = _cpu_clone(model, optimizer)
    fastckpt.save_state(model, optimizer, output_dir=tmp_path / "ckpt")
    _train(model, optimizer, 2)
    live = {(i, k): v.data_ptr() for i, p in enumerate(model.parameters()) for k, v in optimizer.state[p].items()
            if v.numel() > 1}
    fastckpt.load_state(model, optimizer, input_dir=tmp_path / "ckpt")
    _assert_state(model, optimizer, weights, moments)
    after = {(i, k): v.data_ptr() for i, p in enumerate(model.parameters()) for k, v in optimizer.state[p].items()
             if v.numel() > 1}
    assert after == live  # read in place: the same device memory, no second copy of the state


@needs_cuda
def test_map_location_cuda_puts_fresh_optimizer_state_on_the_device(tmp_path):
    model, optimizer = _cuda_state()
    _train(model, optimizer, 1)
    weights, moments = _cpu_clone(model, optimizer)
    fastckpt.save_state(model, optimizer, output_dir=tmp_path / "ckpt")
    fresh, fresh_opt = _cuda_state(seed=9)  # no optimizer state yet
    fastckpt.load_state(fresh, fresh_opt, input_dir=tmp_path / "ckpt", map_location="cuda")
    _assert_state(fresh, fresh_opt, weights, moments)
    assert all(v.is_cuda for p in fresh.parameters() for k, v in fresh_opt.state[p].items() if k != "step")


@needs_cuda
def test_large_and_strided_cuda_tensors_round_trip(tmp_path):
    from fastckpt._io.async_save.snapshot import CUDA_CHUNK_BYTES
    from fastckpt._io.device_load import BOUNCE_BYTES

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            n = (max(BOUNCE_BYTES, CUDA_CHUNK_BYTES) * 5 // 2) // 4  # 2.5 buffers / chunks of float32
            self.big = nn.Parameter(torch.randn(n, device="cuda"))
            self.t = nn.Parameter(torch.randn(300, 500, device="cuda").t())  # non-contiguous
            self.register_buffer("small", torch.arange(7, device="cuda", dtype=torch.int64))

    src = Big()
    expected = {k: v.detach().cpu().clone() for k, v in src.state_dict().items()}
    fastckpt.save_state(src, output_dir=tmp_path / "ckpt")
    dst = Big()
    fastckpt.load_state(dst, input_dir=tmp_path / "ckpt")
    for k, v in dst.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), expected[k]), k
    from fastckpt.torch import load_file

    cpu_copy = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert torch.equal(cpu_copy["big"], expected["big"])

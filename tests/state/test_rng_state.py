"""RNG streams: every saved stream is restored by a full load (C23); CUDA states for devices the loader lacks
are skipped with a warning while the rest are restored (C24)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import safetensors.torch as official
import torch
from helpers.common import batches, make_tiny, requires_cuda, rng_draws, scramble_rngs, train
from safetensors import safe_open as official_safe_open

import fastckpt


def _setup(seed):
    model = make_tiny(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt


def _draws_with_caches():
    """Draws that also depend on the cached-Gaussian parts of the Python and numpy states."""
    return (rng_draws(), random.gauss(0, 1), float(np.random.randn()), torch.randn(2).tolist())


def test_c23_next_draws_equal_those_of_the_uninterrupted_run(tmp_path):
    model, opt = _setup(1)
    train(model, opt, None, batches(2))
    random.gauss(0, 1)  # leaves gauss_next cached in Python's state
    np.random.randn()  # leaves a cached Gaussian in numpy's legacy state
    torch.randn(5)
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "rng", step=17)
    expected = _draws_with_caches()

    scramble_rngs()
    fresh, fopt = _setup(2)
    fastckpt.load_state(fresh, fopt, input_dir=ckpt)
    assert _draws_with_caches() == expected


def test_c23_full_load_with_scheduler_only_restores_rng(tmp_path):
    model, opt = _setup(1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "rng")
    expected = rng_draws()
    scramble_rngs()
    fresh, fopt = _setup(2)
    fastckpt.load_state(fresh, scheduler=torch.optim.lr_scheduler.StepLR(fopt, 1), input_dir=ckpt)
    assert rng_draws() == expected


def test_random_states_file_holds_every_stream(tmp_path):
    model, opt = _setup(1)
    expected_torch = torch.get_rng_state()
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "rng", step=17)
    stored = official.load_file(ckpt / "random_states_0.safetensors")
    assert int(stored["step"]) == 17
    assert torch.equal(stored["torch"], expected_torch)
    assert {"step", "python", "numpy", "torch"} <= set(stored)
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert sorted(k for k in stored if k.startswith("cuda")) == sorted(f"cuda.{i}" for i in range(n_cuda))


def _add_cuda_states(ckpt, n_states: int) -> None:
    """Rewrite random_states_0.safetensors with ``n_states`` CUDA generator states (and fix the manifest)."""
    path = ckpt / "random_states_0.safetensors"
    tensors = official.load_file(path)
    with official_safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    n_real = torch.cuda.device_count() if torch.cuda.is_available() else 0
    real = torch.cuda.get_rng_state_all() if n_real else []
    g = torch.Generator().manual_seed(5)
    template = real[0] if real else torch.randint(0, 256, (16,), generator=g, dtype=torch.uint8)
    for i in range(n_states):
        tensors[f"cuda.{i}"] = real[i].clone() if i < n_real else template.clone()
    official.save_file(tensors, path, metadata=metadata)
    manifest_path = ckpt / "fastckpt.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][path.name]["bytes"] = path.stat().st_size
    manifest["files"][path.name]["crc32c"] = f"{fastckpt._core.crc32c(path.read_bytes()):08x}"  # checked on load
    manifest["files"][path.name].pop("tensors", None)
    manifest_path.write_text(json.dumps(manifest))


def test_c24_more_cuda_states_than_devices_warns_and_restores_the_rest(tmp_path):
    model, opt = _setup(1)
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "rng")
    expected = rng_draws()
    n_real = torch.cuda.device_count() if torch.cuda.is_available() else 0
    _add_cuda_states(ckpt, n_real + 3)

    scramble_rngs()
    fresh, fopt = _setup(2)
    with pytest.warns(UserWarning) as record:
        fastckpt.load_state(fresh, fopt, input_dir=ckpt)
    messages = [str(w.message) for w in record]
    assert any(str(n_real + 3) in m and "CUDA" in m.upper() for m in messages), messages
    assert rng_draws() == expected  # Python, numpy and torch CPU restored despite the missing devices


@requires_cuda
def test_c23_cuda_rng_restored(tmp_path):
    model, opt = _setup(1)
    torch.cuda.manual_seed_all(123)
    torch.randn(4, device="cuda")
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "rng")
    expected = torch.randn(8, device="cuda").cpu()
    torch.cuda.manual_seed_all(999)
    fresh, fopt = _setup(2)
    fastckpt.load_state(fresh, fopt, input_dir=ckpt)
    assert torch.equal(torch.randn(8, device="cuda").cpu(), expected)

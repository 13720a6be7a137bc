"""``fastckpt.torch`` behaves as ``safetensors.torch`` 0.8 where callers depend on it: the whole public surface
(so it can stand in for ``safetensors.torch`` under ``import transformers``), ``safe_open`` closing and its two
backends (``mmap``, ``pread``), the exception types callers catch, and lazy ``fastckpt.torch`` /
``fastckpt.accelerate`` attributes. Ideas follow safetensors' own tests (closed handles, backends, slicing).
"""

from __future__ import annotations

import inspect
import os
import sys
import types

import pytest
import safetensors
import safetensors.torch as official
import torch
from helpers.common import F4_DTYPE, assert_tensor_dicts_identical, assert_tensor_identical, run_python

import fastckpt
import fastckpt.torch as ft

# --------------------------------------------------------------------------------------------------------------
# public surface
# --------------------------------------------------------------------------------------------------------------


def _public(module) -> set[str]:
    """Names a user of ``module`` may import: not private, not a module, not a typing helper."""
    return {n for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
            and getattr(v, "__module__", None) not in ("typing", "collections")}


def test_whole_public_surface_of_safetensors_torch():
    missing = _public(official) - set(dir(ft))
    assert missing == set()
    assert {"storage_ptr", "storage_size", "TensorSpec", "serialize", "serialize_file", "deserialize"} <= set(ft.__all__)


def test_storage_ptr_and_size_equal_official():
    base = torch.arange(12, dtype=torch.float32)
    for t in (base, base[3:], base.view(3, 4).t(), torch.empty(0), torch.empty(5, device="meta")):
        assert ft.storage_ptr(t) == official.storage_ptr(t)
        assert ft.storage_size(t) == official.storage_size(t)


@pytest.mark.skipif(F4_DTYPE is None, reason="this torch has no float4_e2m1fn_x2 dtype")
def test_tensor_spec_serialize_bytes_identical_to_official(tmp_path):
    t = torch.arange(6, dtype=torch.bfloat16)
    f4 = torch.tensor([[1, 2]], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    specs = {}
    for lib in (safetensors, ft):
        specs[lib] = {"a": lib.TensorSpec(dtype="bfloat16", shape=[2, 3], data_ptr=t.data_ptr(), data_len=12),
                      "f": lib.TensorSpec(dtype="float4_e2m1fn_x2", shape=list(f4.shape), data_ptr=f4.data_ptr(),
                                          data_len=2)}
        assert (specs[lib]["a"].dtype, specs[lib]["f"].shape) == ("BF16", [1, 4])
    ours = ft.serialize(specs[ft], metadata={"k": "v"})
    assert ours == safetensors.serialize(specs[safetensors], metadata={"k": "v"})
    ft.serialize_file(specs[ft], tmp_path / "s.safetensors", metadata={"k": "v"})
    assert (tmp_path / "s.safetensors").read_bytes() == ours
    assert sorted(ft.deserialize(ours)) == sorted(safetensors.deserialize(ours))  # theirs: hash-map order


def test_aliased_as_safetensors_torch_transformers_imports_and_saves(tmp_path):
    code = f"""
import sys, fastckpt.torch
sys.modules["safetensors.torch"] = fastckpt.torch
import safetensors
safetensors.torch = fastckpt.torch
import transformers
from transformers import BertConfig, BertModel
model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                             vocab_size=99))
model.save_pretrained({str(tmp_path)!r})
again = BertModel.from_pretrained({str(tmp_path)!r})
import torch
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
print("ok", transformers.__version__)
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


def test_import_fastckpt_then_fastckpt_torch_attribute(tmp_path):
    code = f"""
import sys, torch, fastckpt
assert "fastckpt.torch" not in sys.modules
fastckpt.torch.save_file({{"a": torch.arange(3)}}, {str(tmp_path / 'a.safetensors')!r})
assert fastckpt.accelerate.save_state is sys.modules["fastckpt.accelerate"].save_state
assert "torch" in dir(fastckpt) and "accelerate" in dir(fastckpt)
try:
    fastckpt.no_such_thing
except AttributeError as exc:
    print("ok", exc)
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")
    assert torch.equal(ft.load_file(tmp_path / "a.safetensors")["a"], torch.arange(3))


# --------------------------------------------------------------------------------------------------------------
# safe_open: closing, keywords, backends
# --------------------------------------------------------------------------------------------------------------


def _file(tmp_path, name="t.safetensors"):
    tensors = {"w": torch.randn(7, 5), "b": torch.arange(4, dtype=torch.int64), "z": torch.empty(0, 3),
               "h": torch.randn(3, 2).to(torch.bfloat16), "s": torch.tensor(2.5)}
    official.save_file(tensors, tmp_path / name, metadata={"format": "pt"})
    return tmp_path / name, tensors


def _mapped(path) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_after_with_block_every_call_raises_file_is_closed(tmp_path, backend):
    path, tensors = _file(tmp_path)
    with ft.safe_open(path, framework="pt", backend=backend) as f:
        kept = f.get_tensor("w")
    for call in (lambda: f.get_tensor("w"), f.keys, f.offset_keys, f.metadata, lambda: f.get_slice("w"),
                 f.get_tensors):
        with pytest.raises(fastckpt.ClosedFileError, match="File is closed") as info:
            call()
        assert isinstance(info.value, ValueError) and str(path) in str(info.value)
    assert_tensor_identical(kept, tensors["w"])  # what was taken stays valid


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_closing_releases_the_mapping(tmp_path):
    path, tensors = _file(tmp_path)
    with ft.safe_open(path, framework="pt") as f:
        assert _mapped(path)
        assert f.keys() == sorted(tensors)
    assert not _mapped(path)
    with ft.safe_open(path, framework="pt") as f:
        kept = f.get_tensor("w")
    assert _mapped(path)  # the tensor views the mapping: it lives as long as the tensor
    assert_tensor_identical(kept, tensors["w"])
    del kept
    assert not _mapped(path)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_pread_backend_maps_nothing_and_equals_official(tmp_path):
    path, tensors = _file(tmp_path)
    with ft.safe_open(path, framework="pt", backend="pread") as f, \
            safetensors.safe_open(path, framework="pt", backend="pread") as g:
        assert not _mapped(path)
        assert (f.keys(), f.offset_keys(), f.metadata()) == (g.keys(), g.offset_keys(), g.metadata())
        assert_tensor_dicts_identical(f.get_tensors(), {k: g.get_tensor(k) for k in g.offset_keys()})
        assert not _mapped(path)
    assert_tensor_dicts_identical(ft.load_file(path, backend="pread"), official.load_file(path, backend="pread"))


@pytest.mark.parametrize("index", [
    (slice(None),), (slice(2, 5),), (slice(1, None, 2),), (3,), (-1,), (slice(None), slice(1, 3)),
    (slice(-3, None), 2), (slice(5, 2),), (slice(None, None, -1),), (Ellipsis, 1),
])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_get_slice_equals_official(tmp_path, backend, index):
    path, _ = _file(tmp_path)
    with ft.safe_open(path, framework="pt", backend=backend) as f, safetensors.safe_open(path, framework="pt") as g:
        try:
            want = g.get_slice("w")[index]
        except (ValueError, IndexError, safetensors.SafetensorError):  # the official slicer refuses negative steps
            with pytest.raises((ValueError, IndexError)):
                f.get_slice("w")[index]
            return
        assert_tensor_identical(f.get_slice("w")[index], want.contiguous())
        assert f.get_slice("w").get_shape() == g.get_slice("w").get_shape()


def test_unknown_keyword_and_backend_raise(tmp_path):
    path, _ = _file(tmp_path)
    with pytest.raises(TypeError):
        ft.safe_open(path, framework="pt", not_a_keyword=1)
    with pytest.raises(TypeError):
        ft.load_file(path, not_a_keyword=1)
    with pytest.raises(TypeError):
        ft.load_model(torch.nn.Linear(1, 1), path, not_a_keyword=1)
    for call in (lambda: ft.safe_open(path, framework="pt", backend="not_a_backend"),
                 lambda: ft.load_file(path, backend="not_a_backend"),
                 lambda: ft.load_model(torch.nn.Linear(1, 1), path, backend="not_a_backend")):
        with pytest.raises(ValueError, match="not_a_backend"):
            call()


@pytest.mark.parametrize("name", ["safe_open", "load_file", "load_model"])
def test_backend_keyword_matches_official_signature(name):
    theirs = inspect.signature(getattr(official, name) if name != "safe_open" else safetensors.safe_open)
    ours = inspect.signature(getattr(ft, name))
    assert ours.parameters["backend"].kind == inspect.Parameter.KEYWORD_ONLY
    assert ours.parameters["backend"].default == "mmap"
    assert "backend" in theirs.parameters
    assert not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in ours.parameters.values())


# --------------------------------------------------------------------------------------------------------------
# exception types: what safetensors raises, callers catch
# --------------------------------------------------------------------------------------------------------------

_BAD_INPUTS = {
    "meta tensor": ({"a": torch.empty(2, device="meta")}, NotImplementedError),
    "not a dict": ("notadict", ValueError),
    "non-str key": ({1: torch.zeros(2)}, TypeError),
    "not a tensor": ({"a": 1}, ValueError),
    "sparse": ({"a": torch.zeros(2, 2).to_sparse()}, ValueError),
}


@pytest.mark.parametrize("case", sorted(_BAD_INPUTS))
@pytest.mark.parametrize("call", ["save_file", "save"])
def test_error_types_equal_official(tmp_path, case, call):
    value, expected = _BAD_INPUTS[case]
    args = (value, tmp_path / "x.safetensors") if call == "save_file" else (value,)
    with pytest.raises(Exception) as theirs:
        getattr(official, call)(*args)
    with pytest.raises(Exception) as ours:
        getattr(ft, call)(*args)
    assert type(theirs.value) is expected or isinstance(theirs.value, expected)
    assert isinstance(ours.value, expected), (type(ours.value), ours.value)
    assert not (tmp_path / "x.safetensors").exists()
    if case == "meta tensor":
        assert isinstance(ours.value, fastckpt.MetaTensorError) and "'a'" in str(ours.value)


def test_non_contiguous_is_written_deliberately_unlike_official(tmp_path):
    t = torch.arange(6.0).view(2, 3).t()
    with pytest.raises(ValueError):
        official.save_file({"t": t}, tmp_path / "o.safetensors")
    ft.save_file({"t": t}, tmp_path / "f.safetensors")
    assert_tensor_identical(official.load_file(tmp_path / "f.safetensors")["t"], t.contiguous())


def test_alias_module_is_not_left_installed():
    assert sys.modules["safetensors.torch"] is official

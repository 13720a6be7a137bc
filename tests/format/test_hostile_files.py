"""Hostile and broken safetensors files: every malformed file is refused with the exact ``fastckpt.CheckpointError``
subclass by every loader (never a crash, a hang or another exception); the files of ``tests/fuzz_regressions/``
are replayed; hypothesis generates headers and byte mutations for the reader. Hostile checkpoint folders are in
test_hostile_checkpoints.py."""

from __future__ import annotations

import json
import os
import struct
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.common import run_python
from helpers.fault_log import record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastckpt
import fastckpt.torch as ft
from fastckpt import _core

REGRESSIONS = Path(__file__).resolve().parents[1] / "fuzz_regressions"
EXPECTED: dict[str, str] = json.loads((REGRESSIONS / "EXPECTED.json").read_text())
ERRORS = {"HeaderError": fastckpt.HeaderError, "TruncatedFileError": fastckpt.TruncatedFileError,
          "DtypeError": fastckpt.DtypeError}


def _safe_open_all(path: Path) -> dict:
    with ft.safe_open(path, "pt") as f:
        return {k: f.get_tensor(k).clone() for k in f.keys()}


LOADERS = {
    "SafetensorsFile": lambda p: {t[0]: t for t in _core.SafetensorsFile(str(p)).tensors()},
    "load_file": lambda p: ft.load_file(p),
    "safe_open": _safe_open_all,
    "load_bytes": lambda p: ft.load(p.read_bytes()),
}


# --------------------------------------------------------------------------------------------------------------
# the regression files: exact classes from every loader
# --------------------------------------------------------------------------------------------------------------


def test_every_regression_file_has_an_expectation():
    files = sorted(p.name for p in REGRESSIONS.glob("*.bin"))
    assert files == sorted(EXPECTED), "EXPECTED.json and the .bin files disagree"
    assert len(files) >= 40


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_regression_file_refused_with_its_class_by_every_loader(name):
    path = REGRESSIONS / name
    want = EXPECTED[name]
    loaded = {}
    for loader, load in LOADERS.items():
        if want == "ok":
            loaded[loader] = load(path)
            continue
        with pytest.raises(fastckpt.CheckpointError) as info:
            load(path)
        assert type(info.value) is ERRORS[want], f"{loader}: {type(info.value).__name__}: {info.value}"
        where = "<bytes>" if loader == "load_bytes" else name
        assert where in str(info.value), f"{loader}: the message names the file: {info.value}"
    if want == "ok":  # every loader sees the same tensors, bit for bit
        names = set(loaded["SafetensorsFile"])
        for loader in ("load_file", "safe_open", "load_bytes"):
            assert set(loaded[loader]) == names, loader
            for k in names:
                a, b = loaded[loader][k], loaded["load_file"][k]
                assert a.dtype == b.dtype and a.shape == b.shape and a.view(-1).view(torch.uint8).tolist() == \
                    b.view(-1).view(torch.uint8).tolist(), (loader, k)
    record("malformed", len(LOADERS))
    record("fuzz")


def test_not_a_regular_file_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        import fastckpt, fastckpt.torch as ft
        try:
            ft.load_file({str(fifo)!r})
        except fastckpt.HeaderError as exc:
            print("HeaderError", exc)
    """)
    proc = run_python(code, timeout=60)  # a reader that blocked on the FIFO would time out here
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("HeaderError ") and "not a regular file (a FIFO)" in proc.stdout, proc.stdout
    assert str(fifo) in proc.stdout
    with pytest.raises(IsADirectoryError):
        _core.SafetensorsFile(str(tmp_path))
    record("malformed", 2)


# --------------------------------------------------------------------------------------------------------------
# hypothesis: generated headers and byte mutations
# --------------------------------------------------------------------------------------------------------------

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F16": 2, "BF16": 2, "I32": 4, "F32": 4, "I64": 8, "F64": 8, "C64": 8}
HUGE = st.sampled_from([-1, 2**31, 2**32, 2**53 + 1, 2**63, 2**64 - 1, 2**64, 10**30])


def _check_reader_on(data: bytes) -> None:
    """``parse_header`` and ``load`` refuse ``data`` with a header-kind error, or accept it consistently."""
    try:
        _metadata, tensors, data_start = _core.parse_header(data)
    except (fastckpt.HeaderError, fastckpt.DtypeError) as exc:
        assert "<bytes>" in str(exc)
        with pytest.raises(type(exc)):
            ft.load(data)
        return
    at = 0
    for _name, _dtype, _shape, begin, end in sorted(tensors, key=lambda t: t[3]):
        assert begin == at and end >= begin
        at = end
    assert data_start + at == len(data)
    try:
        loaded = ft.load(data)
    except fastckpt.DtypeError:
        return  # a dtype torch cannot build here (F6): named, never a crash
    for name, _dtype, _shape, begin, end in tensors:
        raw = loaded[name].reshape(-1).view(torch.uint8).numpy().tobytes() if end > begin else b""
        assert raw == data[data_start + begin: data_start + end], name


@st.composite
def hostile_headers(draw) -> bytes:
    """A valid header of packed tensors, then zero or more corruptions of its JSON values or its data size."""
    names = draw(st.lists(st.text(min_size=1, max_size=6), max_size=4, unique=True))
    header: dict = {}
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
    at = 0
    for name in names:
        if name == "__metadata__":
            continue
        dtype = draw(st.sampled_from(sorted(DTYPE_BYTES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        n = DTYPE_BYTES[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    data_len = at
    for _ in range(draw(st.integers(0, 2))):
        keys = [k for k in header if k != "__metadata__"]
        what = draw(st.sampled_from(["dtype", "shape", "offset", "extra", "drop", "meta", "data", "type"]))
        if what == "data":
            data_len = max(0, data_len + draw(st.integers(-3, 3)))
        elif what == "meta":
            header["__metadata__"] = {"k": draw(st.one_of(st.integers(), st.none(), st.lists(st.text())))}
        elif keys:
            entry = header[draw(st.sampled_from(keys))]
            if what == "dtype":
                entry["dtype"] = draw(st.one_of(st.text(max_size=5), st.sampled_from(["F4", "F6_E2M3", "U64"])))
            elif what == "shape":
                entry["shape"] = draw(st.lists(st.one_of(st.integers(0, 9), HUGE), max_size=4))
            elif what == "offset":
                entry["data_offsets"][draw(st.integers(0, 1))] = draw(st.one_of(st.integers(0, 64), HUGE))
            elif what == "extra":
                entry[draw(st.text(max_size=3))] = 1
            elif what == "drop":
                entry.pop(draw(st.sampled_from(sorted(entry))))
            else:
                entry[draw(st.sampled_from(sorted(entry)))] = draw(st.one_of(st.none(), st.text(), st.floats()))
    raw = json.dumps(header, ensure_ascii=draw(st.booleans())).encode("utf-8")
    raw += b" " * draw(st.integers(0, 7))
    return struct.pack("<Q", len(raw)) + raw + bytes(i % 251 for i in range(data_len))


_HYPOTHESIS = settings(max_examples=400, deadline=None, derandomize=True,
                       suppress_health_check=[HealthCheck.too_slow])


@_HYPOTHESIS
@given(hostile_headers())
def test_hypothesis_generated_headers(data):
    _check_reader_on(data)
    record("malformed")
    record("fuzz")


_VALID = ft.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
                  "e": torch.zeros(0, 2)}, {"format": "pt"})


@_HYPOTHESIS
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), max_size=4),
       st.integers(0, len(_VALID)))
def test_hypothesis_byte_mutations_of_a_valid_file(edits, keep):
    data = bytearray(_VALID)
    for at, value in edits:
        data[at] = value
    _check_reader_on(bytes(data[:keep]))
    record("malformed")
    record("fuzz")


def test_hypothesis_mutants_through_the_file_reader(tmp_path):
    """The same mutations, through a file on disk (mapping + parallel reads) rather than bytes."""
    path = tmp_path / "m.safetensors"
    for k in range(0, len(_VALID), 3):
        data = bytearray(_VALID)
        data[k] ^= 0x41
        path.write_bytes(bytes(data))
        try:
            got = ft.load_file(path)
        except (fastckpt.HeaderError, fastckpt.DtypeError) as exc:
            assert path.name in str(exc)
        else:
            assert set(got) <= {"w", "b", "e"} or len(got) <= 3
    record("malformed", len(range(0, len(_VALID), 3)))

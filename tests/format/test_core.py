"""The Rust core (`fastckpt._core`) on its own: byte identity with safetensors 0.8, strided sources, every
header validation rule, read_into, the writable mapping, write_files, commit_dir, modes and the GIL."""

from __future__ import annotations

import gc
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch as official
import torch
from helpers.common import (
    F4_DTYPE,
    OFFICIAL_BYTES_LOADER_MISSES,
    SHARED_DTYPES,
    assert_calls_overlap,
    dtype_id,
    random_tensor,
    split_file,
    tensor_bytes,
)

from fastckpt import _core
from fastckpt.errors import DtypeError, HeaderError, KeyMismatchError, TruncatedFileError

NAME_OF = dict(SHARED_DTYPES)


def storage_u8(t: torch.Tensor) -> np.ndarray:
    """The tensor's whole storage as a uint8 numpy array."""
    base = torch.empty(0, dtype=torch.uint8)
    base.set_(t.untyped_storage())
    return base.numpy()


def source(name: str, t: torch.Tensor, *, strided: bool = False):
    """A TensorSource tuple for `t` (F4: shape [..., n] stored as [..., 2n])."""
    fmt = NAME_OF[t.dtype]
    shape = list(t.shape)
    if fmt == "F4":
        shape[-1] *= 2
    item = t.element_size()
    if strided:
        strides = [s * item for s in t.stride()]
        return (name, fmt, shape, storage_u8(t), t.storage_offset() * item, strides)
    return (name, fmt, shape, t.reshape(-1).view(torch.uint8).numpy(), 0, None)


def sources(tensors: dict[str, torch.Tensor]):
    return [source(k, v) for k, v in tensors.items()]


def write_both(tmp_path: Path, tensors: dict, metadata: dict | None) -> tuple[bytes, bytes]:
    """(official save_file bytes, fastckpt write_file bytes) for the same tensors and metadata."""
    official.save_file(tensors, tmp_path / "official.safetensors", metadata=metadata)
    pairs = None if metadata is None else list(metadata.items())
    size = _core.write_file(tmp_path / "ours.safetensors", sources(tensors), pairs)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert size == len(ours)
    return (tmp_path / "official.safetensors").read_bytes(), ours


# ---------------------------------------------------------------------------------------------------------------
# byte identity with safetensors 0.8
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [d for d, _ in SHARED_DTYPES], ids=dtype_id)
def test_byte_identity_per_dtype(tmp_path, dtype):
    tensors = {
        "weight": random_tensor(dtype, (3, 4), seed=1),
        "a.bias": random_tensor(dtype, (4,), seed=2),
        "scale": random_tensor(torch.float32, (2,), seed=3),
        "empty": random_tensor(dtype, (0, 2), seed=4),
    }
    ref, ours = write_both(tmp_path, tensors, {"format": "pt"})
    assert ours == ref
    assert _core.serialize(sources(tensors), [("format", "pt")]) == ref


def test_byte_identity_all_dtypes_one_file(tmp_path):
    tensors = {f"t.{dtype_id(d)}": random_tensor(d, (2, 6), seed=i) for i, (d, _) in enumerate(SHARED_DTYPES)}
    tensors["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    ref, ours = write_both(tmp_path, tensors, None)
    assert ours == ref
    _, _, header, _ = split_file(ours)
    if F4_DTYPE is not None:  # torch 2.8+
        assert header["t.float4_e2m1fn_x2"]["dtype"] == "F4"
        assert header["t.float4_e2m1fn_x2"]["shape"] == [2, 12]


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}], ids=["none", "empty", "one-key"])
def test_metadata_forms(tmp_path, metadata):
    ref, ours = write_both(tmp_path, {"x": torch.arange(5, dtype=torch.int32)}, metadata)
    assert ours == ref
    _, raw, _, _ = split_file(ours)
    assert (b'"__metadata__"' in raw) == (metadata is not None)


def test_names_needing_escapes_and_unicode(tmp_path):
    tensors = {
        'q"uote': torch.ones(1),
        "back\\slash": torch.ones(2),
        "ünïcode.権重": torch.ones(3),
        "z/slash": torch.ones(1),
        "B": torch.ones(1),
    }
    # One metadata key: the official writer emits several in hash-map order (different in every process).
    ref, ours = write_both(tmp_path, tensors, {"k\"ey\x01ключ": "va\\lue\tзначение"})
    assert ours == ref
    _, _, ours_header, _ = split_file(write_both(tmp_path, tensors, {"b": "2", "a": "1", "c": "3"})[1])
    assert list(ours_header["__metadata__"].items()) == [("b", "2"), ("a", "1"), ("c", "3")]  # order kept


def test_header_padded_to_eight(tmp_path):
    for n in range(1, 10):
        data = _core.serialize([("x" * n, "U8", [n], np.zeros(n, np.uint8), 0, None)], None)
        (hlen,) = struct.unpack("<Q", data[:8])
        assert hlen % 8 == 0
        assert data[8 : 8 + hlen].rstrip(b" ").endswith(b"}")


def test_official_reader_loads_our_bytes():
    tensors = {f"t{i}": random_tensor(d, (3, 2), seed=i) for i, (d, _) in enumerate(SHARED_DTYPES)}
    tensors = {k: v for k, v in tensors.items() if v.dtype not in OFFICIAL_BYTES_LOADER_MISSES}
    loaded = official.load(_core.serialize(sources(tensors), None))
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype
        assert tensor_bytes(loaded[k]) == tensor_bytes(v)


def test_no_tensors(tmp_path):
    data = _core.serialize([], None)
    assert data == struct.pack("<Q", 8) + b"{}      "
    assert _core.parse_header(data) == (None, [], 16)


# ---------------------------------------------------------------------------------------------------------------
# strided sources
# ---------------------------------------------------------------------------------------------------------------

STRIDED = {
    "transposed": lambda: torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),
    "channels_last": lambda: torch.arange(2 * 3 * 4 * 5, dtype=torch.bfloat16)
    .reshape(2, 3, 4, 5)
    .contiguous(memory_format=torch.channels_last),
    "expanded": lambda: torch.arange(3, dtype=torch.int64).expand(4, 3),
    "sliced": lambda: torch.arange(100, dtype=torch.int16).reshape(10, 10)[2:7:2, 1:9:3],
    "offset_contiguous": lambda: torch.arange(50, dtype=torch.float64)[7:19].reshape(3, 4),
    "complex_transposed": lambda: torch.randn(3, 5, dtype=torch.complex64).t(),
    "bool_step": lambda: (torch.arange(20) % 3 == 0)[::2],
}


@pytest.mark.parametrize("kind", sorted(STRIDED))
def test_strided_source_written_in_logical_order(tmp_path, kind):
    t = STRIDED[kind]()
    expected = {"t": t.contiguous()}
    official.save_file(expected, tmp_path / "ref.safetensors")
    # Small chunks so that chunk edges fall inside rows and inside elements.
    _core.write_file(tmp_path / "ours.safetensors", [source("t", t, strided=True)], None, chunk_bytes=7)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_strided_out_of_bounds_names_tensor_and_numbers(tmp_path):
    buf = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match=r'"w".*reads 20 bytes.*16-byte buffer'):
        _core.write_file(tmp_path / "x.safetensors", [("w", "F32", [3], buf, 0, [8])], None)
    with pytest.raises(ValueError, match=r'"w".*20 bytes at byte_offset 0.*16-byte buffer'):
        _core.write_file(tmp_path / "x.safetensors", [("w", "F32", [5], buf, 0, None)], None)
    with pytest.raises(ValueError, match=r"negative"):
        _core.write_file(tmp_path / "x.safetensors", [("w", "F32", [2], buf, 0, [-4])], None)
    assert list(tmp_path.iterdir()) == []


def test_sub_byte_dtypes_must_be_contiguous_and_whole_bytes(tmp_path):
    buf = np.zeros(8, np.uint8)
    with pytest.raises(DtypeError, match="F4"):
        _core.serialize([("w", "F4", [4], buf, 0, [1])], None)
    with pytest.raises(DtypeError, match=r"not a whole number of bytes"):
        _core.serialize([("w", "F4", [3], buf, 0, None)], None)
    assert len(_core.serialize([("w", "F6_E2M3", [4], buf, 0, None)], None)) > 3


# ---------------------------------------------------------------------------------------------------------------
# write-side argument errors, atomicity, modes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensors, exc, pattern",
    [
        ([("__metadata__", "U8", [1], b"x", 0, None)], ValueError, "__metadata__"),
        ([("a\nb", "U8", [1], b"x", 0, None)], ValueError, "control character"),
        ([("a", "U8", [1], b"x", 0, None), ("a", "U8", [1], b"y", 0, None)], ValueError, "given twice"),
        ([("a", "F128", [1], b"x", 0, None)], DtypeError, "F128"),
        ([("a", "U8", [1], b"x", 2, None)], ValueError, "byte_offset 2"),
        ([("a", "U8", [1, 1], b"x", 0, [1])], ValueError, "dims"),
    ],
    ids=["metadata-name", "control-char", "duplicate", "unknown-dtype", "offset", "stride-count"],
)
def test_write_argument_errors(tmp_path, tensors, exc, pattern):
    target = tmp_path / "t.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(exc, match=pattern):
        _core.write_file(target, tensors, None)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]


def test_duplicate_metadata_key_rejected():
    with pytest.raises(ValueError, match="given twice"):
        _core.serialize([], [("k", "1"), ("k", "2")])


def test_missing_folder_is_file_not_found(tmp_path):
    target = tmp_path / "no" / "such" / "x.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        _core.write_file(target, [], None)
    assert info.value.errno == 2
    assert "temp file" in str(info.value)
    assert str(target.parent) in info.value.filename


def test_new_file_mode_follows_umask_and_existing_mode_is_kept(tmp_path, umask022):
    target = tmp_path / "m.safetensors"
    _core.write_file(target, [], None)
    assert target.stat().st_mode & 0o7777 == 0o644
    target.chmod(0o600)
    _core.write_file(target, [("x", "U8", [1], b"z", 0, None)], None, durable=False)
    assert target.stat().st_mode & 0o7777 == 0o600
    assert _core.SafetensorsFile(target).tensors() == [("x", "U8", [1], 0, 1)]


def test_many_small_chunks_and_threads_byte_identical(tmp_path):
    tensors = {f"layer.{i}.w": random_tensor(torch.float16, (17, 3 + i), seed=i) for i in range(40)}
    official.save_file(tensors, tmp_path / "ref.safetensors")
    for threads, chunk in [(1, 1 << 20), (4, 64), (3, 1)]:
        _core.write_file(tmp_path / "o.safetensors", sources(tensors), None, threads=threads, chunk_bytes=chunk)
        assert (tmp_path / "o.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    with pytest.raises(ValueError, match="chunk_bytes"):
        _core.write_file(tmp_path / "o.safetensors", sources(tensors), None, chunk_bytes=0)


# ---------------------------------------------------------------------------------------------------------------
# write_files, commit_dir
# ---------------------------------------------------------------------------------------------------------------


def test_write_files_matches_official(tmp_path):
    shards = [
        {f"s{j}.w{i}": random_tensor(torch.float32, (5, i + 1), seed=10 * j + i) for i in range(4)} for j in range(3)
    ]
    jobs = [(tmp_path / f"model-{j}.safetensors", sources(s), [("format", "pt")]) for j, s in enumerate(shards)]
    sizes = _core.write_files(jobs, threads=3, chunk_bytes=50)
    for j, s in enumerate(shards):
        official.save_file(s, tmp_path / "ref.safetensors", metadata={"format": "pt"})
        ours = (tmp_path / f"model-{j}.safetensors").read_bytes()
        assert ours == (tmp_path / "ref.safetensors").read_bytes()
        assert sizes[j] == len(ours)


def test_write_files_failure_touches_no_target(tmp_path):
    good = tmp_path / "good.safetensors"
    good.write_bytes(b"old")
    jobs = [
        (good, [("a", "U8", [3], b"abc", 0, None)], None),
        (tmp_path / "missing" / "bad.safetensors", [("b", "U8", [1], b"b", 0, None)], None),
    ]
    with pytest.raises(FileNotFoundError):
        _core.write_files(jobs)
    assert good.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.safetensors"]


def test_commit_dir_rename_then_exchange(tmp_path):
    target = tmp_path / "ckpt"
    for version in ("v1", "v2"):
        staging = tmp_path / f"staging-{version}"
        staging.mkdir()
        (staging / "version.txt").write_text(version)
        _core.commit_dir(staging, target)
        assert not staging.exists()
        assert (target / "version.txt").read_text() == version
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        _core.commit_dir(tmp_path / "f", target, durable=False)
    with pytest.raises(FileNotFoundError):
        _core.commit_dir(tmp_path / "nope", target)


# ---------------------------------------------------------------------------------------------------------------
# reading: SafetensorsFile, read_into, the writable mapping
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def written(tmp_path):
    tensors = {
        "w": random_tensor(torch.float32, (64, 33), seed=5),
        "b": random_tensor(torch.bfloat16, (33,), seed=6),
        "i": random_tensor(torch.int8, (7,), seed=7),
        "e": random_tensor(torch.float16, (0,), seed=8),
    }
    path = tmp_path / "r.safetensors"
    official.save_file(tensors, path, metadata={"format": "pt", "a": "b"})
    return path, tensors


def test_open_reports_header(written):
    path, tensors = written
    f = _core.SafetensorsFile(path)
    data = path.read_bytes()
    n, _, header, _ = split_file(data)
    assert f.path == str(path)
    assert f.file_size == len(data)
    assert f.data_start == 8 + n
    assert f.metadata() == header["__metadata__"]
    entries = f.tensors()
    assert [e[1:] for e in entries] == [
        (header[k]["dtype"], header[k]["shape"], *header[k]["data_offsets"]) for k, *_ in entries
    ]
    assert [e[3] for e in entries] == sorted(e[3] for e in entries)
    assert _core.parse_header(data) == (f.metadata(), entries, f.data_start)


def test_read_into_fills_buffers(written):
    path, tensors = written
    f = _core.SafetensorsFile(path)
    out = {k: torch.empty_like(v) for k, v in tensors.items()}
    targets = [(k, v.reshape(-1).view(torch.uint8).numpy()) for k, v in out.items()]
    f.read_into(targets, threads=3)
    for k in tensors:
        assert tensor_bytes(out[k]) == tensor_bytes(tensors[k])
    with pytest.raises(ValueError, match=r'"w" is 8448 bytes .* 8447 bytes'):
        f.read_into([("w", np.zeros(8447, np.uint8))])
    with pytest.raises(KeyMismatchError, match='"nope"'):
        f.read_into([("nope", np.zeros(1, np.uint8))])
    with pytest.raises(ValueError, match="writable"):
        f.read_into([("i", b"1234567")])
    # Overlapping targets (aliases) are filled one after the other, in list order: the later one wins.
    whole = np.zeros(12, np.uint8)
    f.read_into([("i", whole[:7]), ("b", np.zeros(66, np.uint8)), ("i", whole[3:10]), ("i", whole[5:12])])
    i_bytes = tensor_bytes(tensors["i"])
    assert bytes(whole) == i_bytes[:3] + i_bytes[:2] + i_bytes
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.read_into([("i", np.zeros(7, np.uint8))])


def test_mapping_is_writable_private_and_outlives_the_object(written):
    path, tensors = written
    before = path.read_bytes()
    f = _core.SafetensorsFile(path)
    view = memoryview(f)
    assert not view.readonly and view.format == "B" and view.nbytes == len(before)
    mapped = torch.frombuffer(view, dtype=torch.uint8)  # no "non-writable buffer" warning (filterwarnings=error)
    assert bytes(mapped.numpy()) == before
    name, _, shape, begin, end = next(e for e in f.tensors() if e[0] == "w")
    w = mapped[f.data_start + begin : f.data_start + end].view(torch.float32).reshape(shape)
    assert tensor_bytes(w) == tensor_bytes(tensors["w"])
    w.zero_()  # copy-on-write: the file is untouched
    f.close()
    del f, view
    gc.collect()
    assert float(w.abs().sum()) == 0.0  # the mapping is still alive through the tensor
    assert path.read_bytes() == before


# ---------------------------------------------------------------------------------------------------------------
# header validation: every rule, through the file reader and the bytes parser
# ---------------------------------------------------------------------------------------------------------------


def raw_file(header, data: bytes = b"", *, pad: bool = True) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


W = json.dumps(entry()).encode()

MALFORMED = {
    "shorter-than-8": (b"\x01\x02", TruncatedFileError, "8-byte header length needs 8 bytes, found 2"),
    "header-too-large": (struct.pack("<Q", 100_000_001) + b"{}", HeaderError, "over the limit"),
    "header-past-end": (struct.pack("<Q", 64) + b"{}", TruncatedFileError, "needs 72 bytes, found 10"),
    "not-utf8": (raw_file(b'{"\xff":1}'), HeaderError, "UTF-8"),
    "not-json": (raw_file(b'{"a":'), HeaderError, "not a valid safetensors JSON"),
    "not-object": (raw_file(b"[1,2]"), HeaderError, "does not start with"),
    "leading-space": (raw_file(b' {"a":1}'), HeaderError, "does not start with"),
    "metadata-not-strings": (raw_file({"__metadata__": {"a": 1}}), HeaderError, "__metadata__"),
    "metadata-not-object": (raw_file({"__metadata__": ["a"]}), HeaderError, "__metadata__"),
    "entry-not-object": (raw_file({"w": 3}), HeaderError, 'tensor "w"'),
    "entry-extra-field": (raw_file({"w": {**entry(), "x": 1}}, bytes(8)), HeaderError, "unknown field"),
    "entry-missing-field": (raw_file({"w": {"dtype": "F32", "shape": [2]}}, bytes(8)), HeaderError, "data_offsets"),
    "shape-wrong-type": (raw_file({"w": entry(shape=("2",))}, bytes(8)), HeaderError, 'tensor "w"'),
    "offsets-three": (raw_file({"w": {**entry(), "data_offsets": [0, 4, 8]}}, bytes(8)), HeaderError, 'tensor "w"'),
    "duplicate-name": (raw_file(b'{"w":%s,"w":%s}' % (W, W), bytes(8)), HeaderError, 'duplicate key "w"'),
    "unknown-dtype": (raw_file({"w": entry(dtype="F128")}, bytes(8)), DtypeError, "F128"),
    "shape-overflow": (raw_file({"w": entry(shape=(2**40, 2**40))}, bytes(8)), HeaderError, "overflows"),
    "f4-odd": (raw_file({"w": entry("F4", (3,), (0, 2))}, bytes(2)), HeaderError, "whole number of bytes"),
    "size-mismatch": (raw_file({"w": entry(offsets=(0, 12))}, bytes(12)), HeaderError, "span 12 bytes .* needs 8"),
    "begin-after-end": (raw_file({"w": entry(offsets=(8, 0))}, bytes(8)), HeaderError, "begin after end"),
    "hole": (raw_file({"w": entry(offsets=(4, 12))}, bytes(12)), HeaderError, "hole"),
    "overlap": (raw_file({"a": entry(), "b": entry(offsets=(4, 12))}, bytes(12)), HeaderError, "overlap"),
    "data-short": (raw_file({"w": entry()}, bytes(5)), TruncatedFileError, "data section needs"),
    "data-long": (raw_file({"w": entry()}, bytes(9)), HeaderError, "1 extra bytes"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_validation_rule(tmp_path, case):
    data, exc, pattern = MALFORMED[case]
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(data)
    with pytest.raises(exc, match=pattern) as from_file:
        _core.SafetensorsFile(path)
    assert str(path) in str(from_file.value)
    with pytest.raises(exc, match=pattern):
        _core.parse_header(data)
    if case == "data-long":
        assert not isinstance(from_file.value, TruncatedFileError)


def test_json_order_is_free_and_zero_size_tensors_pack(tmp_path):
    header = {"b": entry(offsets=(8, 16)), "z": entry(shape=(0,), offsets=(8, 8)), "a": entry(), "__metadata__": {}}
    meta, tensors, start = _core.parse_header(raw_file(header, bytes(16)))
    assert meta == {}
    assert [t[0] for t in tensors] == ["a", "z", "b"]


# ---------------------------------------------------------------------------------------------------------------
# the GIL is released during write_file
# ---------------------------------------------------------------------------------------------------------------


def test_write_file_releases_the_gil(tmp_path):
    payload = np.full(200 << 20, 7, np.uint8)
    src = [("x", "U8", [payload.size], payload, 0, None)]
    assert_calls_overlap(lambda i: _core.write_file(tmp_path / f"{i}.safetensors", src, None, durable=False,
                                                    threads=1))
    for i in range(2):
        entries = _core.SafetensorsFile(tmp_path / f"{i}.safetensors").tensors()
        assert entries == [("x", "U8", [200 << 20], 0, 200 << 20)]

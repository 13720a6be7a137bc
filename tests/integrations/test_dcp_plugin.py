"""fastckpt.dcp in one process: exact round trips of every dtype and non-tensor value through DCP, a folder with no
pickle in it, TypeError for values that need pickle, atomic re-saves, the ``commit=False`` mode an outer save uses,
and loads that refuse hostile or inconsistent folders before filling anything."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dcp_state import full_state, mismatches, template
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException

import fastckpt.dcp
import fastckpt.torch
from fastckpt import _core
from fastckpt.errors import DtypeError, HeaderError, IntegrityError, MissingStateError, ShapeMismatchError

single_process = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable):UserWarning")


@pytest.fixture
def saved(tmp_path) -> Path:
    fastckpt.dcp.save(full_state(), tmp_path / "ckpt")
    return tmp_path / "ckpt"


@single_process
def test_round_trip_through_plain_dcp_calls(tmp_path):
    state = full_state()
    dcp.save(state, storage_writer=fastckpt.dcp.StorageWriter(tmp_path / "c", threads=3))
    got = template(state)
    dcp.load(got, storage_reader=fastckpt.dcp.StorageReader(tmp_path / "c", threads=2))
    assert mismatches(state, got) == []
    assert got["extra"]["t"] == (1, 2.5, None) and got["extra"]["big"] == 2**70


def test_folder_holds_no_pickle(saved):
    names = sorted(p.name for p in saved.iterdir())
    assert names == ["dcp_index.bin", "dcp_metadata.json", "fastckpt.json",
                     "shard-00000-of-00001.safetensors"]  # no .metadata
    for name in names:
        data = (saved / name).read_bytes()
        assert not data.startswith(b"\x80")  # a pickle (protocol 2+) starts with PROTO
        if name.endswith(".json"):
            json.loads(data)  # all of it is JSON text
            continue
        if name == "dcp_index.bin":  # a JSON header and int64 columns (fastckpt._format.dcp_index)
            assert data.startswith(b"FCKDCPIX")
            json.loads(data[24:24 + int.from_bytes(data[16:24], "little")])
            continue
        _, entries, data_start = _core.parse_header(data)
        with safe_open(saved / name, "pt") as f:
            assert set(f.keys()) == {e[0] for e in entries}
        assert data_start + sum(end - begin for *_, begin, end in entries) == len(data)  # nothing hidden


@pytest.mark.parametrize("value", [object(), lambda: 1, {"inner": {1, object()}}])
def test_values_that_need_pickle_are_a_type_error_naming_the_key(tmp_path, value, saved):
    before = (saved / "dcp_metadata.json").read_bytes()
    with pytest.raises(TypeError, match=r"^bad"):
        fastckpt.dcp.save({"w": torch.ones(2), "bad": value}, saved)
    assert (saved / "dcp_metadata.json").read_bytes() == before
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ckpt"]


def test_resave_replaces_the_folder_whole(saved):
    fastckpt.dcp.save({"only": torch.arange(3)}, saved)
    got = {"only": torch.zeros(3, dtype=torch.int64)}
    fastckpt.dcp.load(got, saved)
    assert torch.equal(got["only"], torch.arange(3))
    assert "w" not in json.loads((saved / "dcp_metadata.json").read_text())["state_dict"]


def test_commit_false_writes_into_a_staged_folder(tmp_path):
    staging = tmp_path / ".outer-staging" / "model"
    writer = fastckpt.dcp.StorageWriter(staging, commit=False)
    fastckpt.dcp.save(full_state(), staging, writer=writer)
    names = sorted(p.name for p in staging.iterdir())
    assert names == ["dcp_index.bin", "dcp_metadata.json",
                     "shard-00000-of-00001.safetensors"]  # no manifest, nothing renamed
    assert sorted(writer.files) == names
    for name, entry in writer.files.items():
        data = (staging / name).read_bytes()
        assert entry["bytes"] == len(data) and entry["crc32c"] == f"{_core.crc32c(data):08x}"
    got = template(full_state())
    fastckpt.dcp.load(got, staging)
    assert mismatches(full_state(), got) == []


@single_process
def test_dtype_mismatch(saved):
    got = template(full_state())
    got["bf"] = torch.zeros(9, 2)
    with pytest.raises(DtypeError, match=r"'bf' is stored as torch.bfloat16.*torch.float32"):
        fastckpt.dcp.load(got, saved)
    assert all(not v.any() for k, v in got.items() if isinstance(v, torch.Tensor) and v.dtype.is_floating_point
               and v.dtype.itemsize > 1)
    with pytest.raises(CheckpointException) as info:  # plain dcp.load: DCP wraps it
        dcp.load(got, storage_reader=fastckpt.dcp.StorageReader(saved))
    assert isinstance(fastckpt.dcp.original_error(info.value), DtypeError)


@single_process
def test_template_keys_the_checkpoint_lacks_are_a_missing_state_error_naming_them(saved):
    """pytorch#126881: DCP raises a bare RuntimeError naming one key; here every missing key and the path."""
    got = template(full_state())
    got["not_saved"] = torch.zeros(2)
    got["nor_this"] = torch.zeros(1)
    del got["bf"]
    with pytest.raises(MissingStateError) as info:
        fastckpt.dcp.load(got, saved)
    message = str(info.value)
    assert message.startswith(f"{saved}: the checkpoint has no 'nor_this', 'not_saved' (2 state_dict key(s)")
    assert "stored keys the state_dict lacks: ['bf']" in message
    assert got["not_saved"].eq(0).all() and got["w"].eq(0).all()  # nothing was read
    with pytest.raises(CheckpointException) as raw:  # plain dcp.load with fastckpt's planner: DCP wraps it
        dcp.load(got, storage_reader=fastckpt.dcp.StorageReader(saved), planner=fastckpt.dcp.LoadPlanner())
    assert type(fastckpt.dcp.original_error(raw.value)) is MissingStateError
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    with pytest.raises(MissingStateError, match=r"Missing key in checkpoint state_dict: nor_this"):
        fastckpt.dcp.load(got, saved, planner=DefaultLoadPlanner())  # DCP's planner: still not a bare RuntimeError
    partial = template(full_state())
    partial["not_saved"] = torch.zeros(2)
    fastckpt.dcp.load(partial, saved, planner=fastckpt.dcp.LoadPlanner(allow_partial_load=True))
    assert partial["not_saved"].eq(0).all()
    assert mismatches(full_state(), {k: v for k, v in partial.items() if k != "not_saved"}) == []


@single_process
def test_a_template_of_another_shape_is_a_shape_mismatch_error(saved):
    got = template(full_state())
    got["w"] = torch.zeros(8, 5)
    with pytest.raises(ShapeMismatchError, match=r"^'w' is stored with shape \[7, 5\], the state_dict entry it loads "
                                                 r"into has shape \[8, 5\]$"):
        fastckpt.dcp.load(got, saved)


def _meta(saved: Path) -> dict:
    return json.loads((saved / "dcp_metadata.json").read_text())


def _hostile(saved: Path, kind: str) -> bytes:
    doc = _meta(saved)
    chunk = doc["state_dict"]["w"]["tensor"]["chunks"][0]
    if kind == "not json":
        return b"{not json"
    if kind == "array":
        return b"[1, 2]"
    if kind == "deep":
        return b'{"format": "fastckpt-dcp", "format_version": 1, "state_dict": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    if kind == "version":
        doc["format_version"] = 99
    elif kind == "escape":
        chunk["file"] = "../../etc/passwd"
    elif kind == "past size":
        chunk["offsets"] = [5, 0]
    elif kind == "negative":
        chunk["sizes"] = [-1, 5]
    elif kind == "dims":
        chunk["sizes"] = [7]
    elif kind == "dtype":
        doc["state_dict"]["w"]["tensor"]["dtype"] = "F128"
    elif kind == "tag":
        doc["state_dict"]["step"] = {"object": {"__numpy__": ["<zz", 1]}}
    elif kind == "kind":
        doc["state_dict"]["step"] = {"pickle": "gASVAAAA"}
    elif kind == "duplicate chunk":
        doc["state_dict"]["w"]["tensor"]["chunks"].append(dict(chunk))
    elif kind == "hole":
        chunk["sizes"] = [3, 5]
    elif kind == "overlap":
        chunk["sizes"] = [4, 5]
        doc["state_dict"]["w"]["tensor"]["chunks"].append(dict(chunk, offsets=[2, 0], sizes=[3, 5], name="w2"))
    return json.dumps(doc).encode()


HOSTILE = ["not json", "array", "deep", "version", "escape", "past size", "negative", "dims", "dtype", "tag", "kind",
           "duplicate chunk", "hole", "overlap"]


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_metadata_is_a_header_error(saved, kind):
    (saved / "dcp_index.bin").unlink()  # a folder without the index (older saves, tools): the metadata is read whole
    os.chmod(saved / "dcp_metadata.json", 0o644)
    (saved / "dcp_metadata.json").write_bytes(_hostile(saved, kind))
    with pytest.raises(HeaderError, match="dcp_metadata.json"):
        fastckpt.dcp.StorageReader(saved).read_metadata()
    got = template(full_state())
    with pytest.raises(HeaderError):
        fastckpt.dcp.load(got, saved)
    assert not got["w"].any()


def test_the_reader_checks_the_manifest_entries_it_uses(saved):
    # a rank of an N-rank load opens a few of the N shard files the manifest lists: it checks those entries only
    from fastckpt._io.storage.local.layout import read_manifest

    manifest_path = saved / "fastckpt.json"
    os.chmod(manifest_path, 0o644)
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["unused.safetensors"] = {"bytes": 1, "crc32c": "not hex"}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(HeaderError, match="unused.safetensors"):
        read_manifest(saved, check_sizes=False)
    records = read_manifest(saved, check_sizes=False, check_entries=False)["files"]
    assert records.get("dcp_metadata.json")["bytes"] > 0 and records.get("missing") is None
    with pytest.raises(HeaderError, match="unused.safetensors.*crc32c.*8 hex digits"):
        records.get("unused.safetensors")
    got = template(full_state())
    fastckpt.dcp.load(got, saved)  # the entry no load uses is not this load's concern
    assert mismatches(full_state(), got) == []
    manifest["files"]["shard-00000-of-00001.safetensors"]["crc32c"] = "XYZ"
    manifest_path.write_text(json.dumps(manifest))
    got = template(full_state())
    with pytest.raises(HeaderError, match="shard-00000-of-00001.safetensors.*crc32c"):
        fastckpt.dcp.load(got, saved)
    assert not got["w"].any()


def test_a_file_that_disagrees_with_the_metadata_is_refused_before_any_read(saved):
    shard = saved / "shard-00000-of-00001.safetensors"
    with safe_open(shard, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["w"] = tensors["w"].double()
    fastckpt.torch.save_file(tensors, shard)
    (saved / "fastckpt.json").unlink()  # sizes differ now; look past the manifest at the header check
    got = template(full_state())
    with pytest.raises(HeaderError, match=r"shard-00000-of-00001.safetensors: tensor 'w' is F64 \[7, 5\]"):
        fastckpt.dcp.load(got, saved)
    assert not got["emb"].any()


def test_missing_and_truncated_files(saved, tmp_path):
    shard = saved / "shard-00000-of-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(IntegrityError, match="shard-00000-of-00001.safetensors"):
        fastckpt.dcp.load(template(full_state()), saved)
    shard.unlink()
    with pytest.raises(MissingStateError, match="shard-00000-of-00001.safetensors"):
        fastckpt.dcp.load(template(full_state()), saved)
    with pytest.raises(MissingStateError, match="dcp_metadata.json"):
        fastckpt.dcp.load(template(full_state()), tmp_path / "nothing")


@single_process
@pytest.mark.parametrize("indexed", [True, False])
def test_the_reader_parses_its_metadata_once_per_version_of_the_file(saved, tmp_path, monkeypatch, indexed):
    import fastckpt.dcp.reader as reader_module

    name = "read_dcp_index" if indexed else "read_dcp_metadata"
    parsed = []
    real = getattr(reader_module, name)
    monkeypatch.setattr(reader_module, name, lambda folder: parsed.append(folder) or real(folder))
    reader = fastckpt.dcp.StorageReader(saved)
    reader.use_index = indexed
    first = reader.read_metadata()
    state = full_state()
    got = template(state)
    dcp.load(got, storage_reader=reader)  # DCP reads the metadata again: served from the first parse
    assert mismatches(state, got) == [] and reader.read_metadata() is first and len(parsed) == 1
    changed = full_state()
    changed["w"] = changed["w"] + 1
    fastckpt.dcp.save(changed, saved)  # a new save replaces the folder (a new dcp_metadata.json)
    got = template(changed)
    dcp.load(got, storage_reader=reader)
    assert len(parsed) == 2 and mismatches(changed, got) == []


@single_process
def test_a_cached_save_plan_is_not_served_to_a_changed_state(tmp_path):
    """fastckpt.dcp.SavePlanner caches plans per key (commit=False writers); DCP's own comparison ignores dtypes, so
    a state that only changed dtype must be planned again: each save loads back bit-exact, dtypes included."""
    planned = []
    real = fastckpt.dcp.SavePlanner._create_global_plan  # fastckpt's merge (DCP's global plan, over columns)

    def counting(self, all_plans):
        planned.append(1)
        return real(self, all_plans)

    def save_and_check(state, folder):
        writer = fastckpt.dcp.StorageWriter(folder, commit=False)
        fastckpt.dcp.save(state, folder, writer=writer, planner=writer.save_planner("test-cache"))
        got = template(state)
        fastckpt.dcp.load(got, folder)
        assert mismatches(state, got) == []

    first = {"w": torch.randn(6, 4), "b": torch.randn(4), "n": 3}
    changed_values = {"w": torch.randn(6, 4), "b": torch.randn(4), "n": 4}
    changed_dtype = {"w": torch.randn(6, 4).double(), "b": torch.randn(4), "n": 4}
    changed_shape = {"w": torch.randn(7, 4).double(), "b": torch.randn(4), "n": 4}
    new_entry = {**changed_shape, "exp_avg": torch.randn(7, 4)}
    try:
        fastckpt.dcp.SavePlanner._create_global_plan = counting
        for i, (state, plans) in enumerate([(first, 1), (first, 0), (changed_values, 0), (changed_dtype, 1),
                                            (changed_shape, 1), (new_entry, 1), (new_entry, 0)]):
            before = len(planned)
            save_and_check(state, tmp_path / f"c{i}")
            assert len(planned) - before == plans, (i, planned)
    finally:
        fastckpt.dcp.SavePlanner._create_global_plan = real
    reader = fastckpt.dcp.StorageReader(tmp_path / "c3")
    assert reader.read_metadata().state_dict_metadata["w"].properties.dtype == torch.float64


def test_a_committing_writer_gives_a_planner_without_caching(tmp_path):
    assert not fastckpt.dcp.StorageWriter(tmp_path / "a").save_planner("k")._enable_plan_caching
    assert fastckpt.dcp.StorageWriter(tmp_path / "a", commit=False).save_planner("k")._enable_plan_caching

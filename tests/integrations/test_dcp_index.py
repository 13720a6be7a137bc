"""The chunk index (``dcp_index.bin``) of a fastckpt.dcp folder in one process: the index describes the same chunks
as ``dcp_metadata.json``; a load through it equals one through the full metadata (fastckpt's planner, which looks
up only the chunks its boxes overlap, and DCP's own ``DefaultLoadPlanner``, which reads them all); a damaged,
hostile or stale index is a HeaderError naming it before anything is filled."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dcp_state import full_state, mismatches, template
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

import fastckpt.dcp
from fastckpt._format.dcp_index import ChunkIndex
from fastckpt._format.dcp_index_write import build_index
from fastckpt._format.dcp_metadata import ChunkLocation
from fastckpt._io.dcp.files import read_dcp_index, read_dcp_metadata
from fastckpt.errors import HeaderError

single_process = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable):UserWarning")


@pytest.fixture
def saved(tmp_path) -> Path:
    fastckpt.dcp.save(full_state(), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _chunks(md: TensorStorageMetadata) -> list:
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)


def test_the_index_describes_the_chunks_of_the_full_metadata(saved):
    full = read_dcp_metadata(saved)
    index = read_dcp_index(saved)
    assert index.doc["metadata_crc32c"] == json.loads((saved / "fastckpt.json").read_text())["files"][
        "dcp_metadata.json"]["crc32c"]
    indexed = fastckpt.dcp.StorageReader(saved).read_metadata()
    assert set(indexed.state_dict_metadata) == set(full.metadata.state_dict_metadata)
    for fqn, md in full.metadata.state_dict_metadata.items():
        got = indexed.state_dict_metadata[fqn]
        if isinstance(md, TensorStorageMetadata):
            assert got.size == md.size and got.properties.dtype == md.properties.dtype, fqn
            assert _chunks(got) == _chunks(md), fqn
            for c in md.chunks:
                offsets = tuple(int(o) for o in c.offsets)
                assert index.find(fqn, offsets) == (full.chunks[(fqn, offsets)], [int(s) for s in c.sizes])
        else:
            assert type(got) is type(md), fqn


def _regular(world: int, rows: int = 4, cols: int = 3, ragged: bool = False) -> tuple[dict, dict]:
    """A tensor [world * rows, cols] in row blocks, one per rank (the last short when ``ragged``)."""
    size = [world * rows - (2 if ragged else 0), cols]
    chunks, locs = [], {}
    for r in range(world):
        n = min(rows, size[0] - r * rows)
        chunks.append(((r * rows, 0), (n, cols)))
        locs[("w", (r * rows, 0))] = ChunkLocation(f"shard-{r:05d}-of-{world:05d}.safetensors", f"w@{r * rows},0")
    return {"w": ("F32", size, chunks[::-1])}, locs


@pytest.mark.parametrize("ragged", [False, True])
def test_lookups_return_the_chunks_a_box_overlaps(ragged):
    tensors, locs = _regular(64, ragged=ragged)
    data = build_index(tensors, locs, 64, objects={}, planner_data=None, storage_meta=None, dcp_version=None,
                       metadata_crc32c="0")
    index = ChunkIndex(data, "idx")
    col = index.tensors["w"]["columns"][0]
    assert "a" in col  # a regular Shard(0) costs a few bytes, whatever the world size
    found = index.overlapping("w", (10, 1), (9, 1))  # rows 10..18: the blocks at 8, 12, 16
    assert found.offsets[:, 0].tolist() == [8, 12, 16]
    assert [found.location(i).file for i in range(3)] == [f"shard-{r:05d}-of-00064.safetensors" for r in (2, 3, 4)]
    assert index.covers("w", (10, 1), (9, 1), found)
    assert not index.covers("w", (10, 0), (9, 3), index.overlapping("w", (12, 0), (4, 3)))
    assert index.find("w", (252, 0))[1] == ([2, 3] if ragged else [4, 3])
    with pytest.raises(HeaderError, match="no chunk of 'w' at offsets \\[5, 0\\]"):
        index.find("w", (5, 0))
    all_rows = index.overlapping("w", (0, 0), tuple(tensors["w"][1]))
    assert len(all_rows) == 64 and index.covers("w", (0, 0), tuple(tensors["w"][1]), all_rows)


@pytest.mark.parametrize("rows", [4096, 4095, 100, 7])
def test_torch_chunks_uneven_split_is_a_run_and_a_tail_and_finds_what_a_scan_finds(rows):
    # FSDP2's Shard(0) by torch.chunk over 2816 ranks (accelerate#4099): blocks of ceil(rows / N) rows, the last
    # shorter, the ranks past the end empty at offset `rows`; the index stores no per-chunk column for it
    world, cols = 2816, 3
    per = -(-rows // world)
    chunks, locs = [], {}
    for r in range(world):
        start = min(rows, r * per)
        n = min(rows, start + per) - start
        chunks.append(((start, 0), (n, cols)))
        locs.setdefault(("w", (start, 0)), ChunkLocation(f"shard-{r:05d}-of-{world:05d}.safetensors", f"w@{start},0"))
    chunks = list({c[0]: c for c in reversed(chunks)}.values())[::-1]  # the empty ones: one chunk (DCP's dedup)
    data = build_index({"w": ("F32", [rows, cols], chunks)}, locs, world, objects={}, planner_data=None,
                       storage_meta=None, dcp_version=None, metadata_crc32c="0")
    index = ChunkIndex(data, "idx")
    assert all("e" not in c for c in index.tensors["w"]["columns"]), index.tensors["w"]["columns"]
    assert len(data) < 1024  # 2816 chunks in a few hundred bytes
    near_end = max(0, rows - per - 1)
    for lo, n in [(0, 1), (rows - 1, 1), (near_end, rows - near_end), (rows // 2, 1), (0, rows)]:
        want = sorted(o for (o, s) in chunks if s[0] and o[0] < lo + n and lo < o[0] + s[0])
        found = index.overlapping("w", (lo, 0), (n, cols))
        assert sorted(map(tuple, found.offsets.tolist())) == [tuple(o) for o in want], (lo, n)
        assert index.covers("w", (lo, 0), (n, cols), found)
        for i in range(len(found)):
            assert found.location(i) == locs[("w", tuple(found.offsets[i].tolist()))]


@single_process
@pytest.mark.parametrize("planner", ["fastckpt", "dcp_default"])
def test_a_load_through_the_index_equals_one_through_the_full_metadata(saved, planner):
    state = full_state()
    via_index = template(state)
    kind = fastckpt.dcp.LoadPlanner() if planner == "fastckpt" else DefaultLoadPlanner()
    dcp.load(via_index, storage_reader=fastckpt.dcp.StorageReader(saved), planner=kind)
    full = template(state)
    reader = fastckpt.dcp.StorageReader(saved)
    reader.use_index = False
    dcp.load(full, storage_reader=reader, planner=fastckpt.dcp.LoadPlanner())
    assert mismatches(state, via_index) == [] and mismatches(state, full) == []


@single_process
def test_fastckpt_planner_plans_with_the_chunks_of_its_boxes_only(saved):
    reader = fastckpt.dcp.StorageReader(saved)
    metadata = reader.read_metadata()
    w = metadata.state_dict_metadata["w"]
    narrow = w.narrow([ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1, 5]))])
    assert type(narrow) is TensorStorageMetadata and _chunks(narrow) == [((0, 0), (7, 5))]
    assert w._all is None  # the full chunk list was never built


def _patched(saved: Path, change) -> None:
    path = saved / "dcp_index.bin"
    data = bytearray(path.read_bytes())
    magic, version, crc, length = struct.unpack_from("<8sIIQ", data, 0)
    header = json.loads(bytes(data[24:24 + length]))
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    from fastckpt import _core

    body = bytes(data[24 + length:])
    path.chmod(0o644)
    path.write_bytes(struct.pack("<8sIIQ", magic, version, _core.crc32c(text), len(text)) + text + body)


HOSTILE = {
    "damaged": None,
    "format": lambda h: h.update(format="other"),
    "columns": lambda h: h["tensors"]["w"].update(columns=[{"x": 1}] * 6),
    "dtype": lambda h: h["tensors"]["w"].update(dtype="F128"),
    "file": lambda h: h["files"]["extra"].append("../x"),
    "past size": lambda h: h["tensors"]["w"]["columns"].__setitem__(0, {"c": 5}),
    "stale": lambda h: h.update(metadata_crc32c="00000000"),
}


@single_process
@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_or_stale_index_is_a_header_error_before_anything_is_filled(saved, kind):
    if kind == "damaged":
        path = saved / "dcp_index.bin"
        data = bytearray(path.read_bytes())
        data[40] ^= 1
        path.chmod(0o644)
        path.write_bytes(bytes(data))
    else:
        _patched(saved, HOSTILE[kind])
    got = template(full_state())
    with pytest.raises(HeaderError, match="dcp_index.bin"):
        fastckpt.dcp.load(got, saved)
    assert not got["w"].any() and not got["emb"].any()

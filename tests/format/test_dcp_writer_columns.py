"""The coordinator writes ``dcp_metadata.json`` and ``dcp_index.bin`` from columns: the same bytes as the per-chunk
writer it replaced (tests/helpers/dcp_reference_writer.py), on the same global plans and write results."""

from __future__ import annotations

import pytest
import torch
from helpers.dcp_reference_writer import reference_files_and_text
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from fastckpt._format.dcp_index import ChunkIndex, chunk_name, shard_file_name
from fastckpt._format.dcp_metadata import parse_metadata
from fastckpt.dcp.global_plan import merge_save_plans
from fastckpt.dcp.writer import StorageWriter

LLM_SHAPES = [("model.embed_tokens.weight", (128256, 4096)), ("model.layers.0.self_attn.k_proj.weight", (1024, 4096)),
              ("model.layers.0.mlp.down_proj.weight", (4096, 14336)), ("model.norm.weight", (4096,))]


def _row_block(rows: int, world: int, r: int) -> tuple[int, int]:
    per = -(-rows // world)  # torch.chunk's split (FSDP2's Shard(0)): the last blocks shorter or empty
    start = min(rows, r * per)
    return start, min(rows, start + per) - start


def _plans(world: int, shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype = torch.float32,
           objects: bool = False, reverse: bool = False) -> list[SavePlan]:
    """FSDP2 + AdamW plans: every tensor Shard(0) (param, exp_avg, exp_avg_sq), a replicated 0-dim step each
    (``reverse``: rank r holds block ``world - 1 - r``, so the chunks' plan order is not their sorted order)."""
    props = TensorProperties(dtype=dtype)
    plans = []
    for r in range(world):
        items = []
        for name, shape in shapes:
            start, n = _row_block(shape[0], world, world - 1 - r if reverse else r)
            if n:
                offsets = (start,) + (0,) * (len(shape) - 1)
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size((n,) + shape[1:]))
                for state in ("", "state.exp_avg.", "state.exp_avg_sq."):
                    items.append(WriteItem(MetadataIndex(state + name, torch.Size(offsets)), WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(chunk, props, torch.Size(shape))))
            step = ChunkStorageMetadata(torch.Size([]), torch.Size([]))
            items.append(WriteItem(MetadataIndex(f"state.step.{name}", torch.Size([])), WriteItemType.TENSOR,
                                   tensor_data=TensorWriteData(step, props, torch.Size([]))))
        if objects and r == 0:
            items.append(WriteItem(MetadataIndex("extra.épreuve"), WriteItemType.BYTE_IO))
            items.append(WriteItem(MetadataIndex("lr_%d"), WriteItemType.BYTE_IO))
        plans.append(SavePlan(items))
    return plans


def _results(world: int, plans: list[SavePlan], *, rename: dict[str, str] | None = None,
             drop_hints: bool = False, objects_per_rank: int = 1) -> list[list[WriteResult]]:
    """What the ranks send back: one file per rank, canonical chunk names (``rename``: fqn -> the fqn whose stored
    chunk it points at, a tied weight; a name with a quote appended for the others it names;
    ``objects_per_rank``: an s3 save's further objects ``shard-r-of-N.0000k.safetensors``, chunk i in object i % k)."""
    values = {"extra.épreuve": {"text": "naïve \"quoted\" \\ tab\t", "n": [1, 2.5, None, True]}, "lr_%d": 0.001}
    out = []
    for r, plan in enumerate(plans):
        file = shard_file_name(r, world)
        digests = [(file, (1 << 20, 0, [], []))]
        rank = []
        for i, item in enumerate(plan.items):
            if i % objects_per_rank:
                file = f"{shard_file_name(r, world).removesuffix('.safetensors')}.{i % objects_per_rank:05d}.safetensors"
            else:
                file = shard_file_name(r, world)
            index = MetadataIndex(item.index.fqn, item.index.offset, None) if drop_hints else item.index
            if item.type == WriteItemType.BYTE_IO:
                rank.append(WriteResult(index=index, size_in_bytes=0,
                                        storage_data={"object": values[item.index.fqn], "digests": digests}))
                continue
            chunk = item.tensor_data.chunk
            fqn = (rename or {}).get(item.index.fqn, item.index.fqn)
            name = chunk_name(fqn, chunk.offsets, chunk.sizes, item.tensor_data.size)
            if rename and fqn == item.index.fqn and "exp_avg_sq" in fqn:
                name += "'"
            rank.append(WriteResult(index=index, size_in_bytes=4,
                                    storage_data={"file": file, "name": name, "digests": digests}))
        out.append(rank)
    return out


def _new_writer(metadata, results) -> tuple[bytes, bytes]:
    text, index, _ = StorageWriter("unused", commit=False)._metadata_text(metadata, results)
    return text, index


CASES = {
    "even": (64, [(f"layers.{t}.weight", (256, 64)) for t in range(3)] + [("layers.0.bias", (256,))]),
    "uneven": (48, [("w", (100, 3)), ("b", (7,)), ("few", (5, 2, 3)), ("one", (1, 9))]),
    "llm_2816": (2816, LLM_SHAPES),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_column_writer_writes_the_reference_bytes(case):
    world, shapes = CASES[case]
    plans, metadata = merge_save_plans(_plans(world, shapes, objects=True))
    metadata.storage_meta = StorageMeta(checkpoint_id="/tmp/x", save_id="abc", modules=["m"])
    metadata.planner_data = {"w": ["w"], "nested": {"a": 1}}
    results = _results(world, plans)
    want = reference_files_and_text(metadata, results)
    assert _new_writer(metadata, results) == want
    assert _new_writer(metadata, _results(world, plans, drop_hints=True)) == want  # placed by (fqn, offsets)
    parsed = parse_metadata(want[0], "m")
    assert set(parsed.metadata.state_dict_metadata) == set(metadata.state_dict_metadata)
    ChunkIndex(want[1], "i")


def test_tied_and_renamed_chunks_and_bfloat16_write_the_reference_bytes():
    world = 24
    shapes = [("embed", (50, 8)), ("head", (50, 8)), ("%odd fqn\u2603", (30,))]
    plans, metadata = merge_save_plans(_plans(world, shapes, dtype=torch.bfloat16))
    results = _results(world, plans, rename={"head": "embed"})
    want = reference_files_and_text(metadata, results)
    assert _new_writer(metadata, results) == want
    index = ChunkIndex(want[1], "i")
    assert index.doc["aliases"] == ["embed"] and index.doc["names"]  # tied (alias) and renamed (quote) names


def test_extra_files_are_numbered_as_the_reference_numbers_them():
    # an s3 save's further objects per rank, chunks in the plans' order unlike their sorted order
    world = 12
    plans, metadata = merge_save_plans(_plans(world, [("w", (40, 3)), ("b", (30,))], reverse=True))
    results = _results(world, plans, objects_per_rank=3)
    want = reference_files_and_text(metadata, results)
    assert _new_writer(metadata, results) == want
    extra = ChunkIndex(want[1], "i").doc["files"]["extra"]
    assert len(extra) > world and extra != sorted(extra)  # numbered in the chunks' sorted order, not by name


def test_shuffled_results_and_a_missing_chunk():
    world = 8
    plans, metadata = merge_save_plans(_plans(world, [("w", (16, 2))]))
    results = _results(world, plans)
    results.reverse()  # results need not come in the plan's order: placed by their hints
    assert _new_writer(metadata, results)[0] == reference_files_and_text(metadata, results)[0]
    wrong = [[WriteResult(MetadataIndex(r.index.fqn, r.index.offset, (r.index.index or 0) + k), r.size_in_bytes,
                          r.storage_data) for r in rank] for k, rank in enumerate(results)]  # hints that lie
    assert _new_writer(metadata, wrong) == reference_files_and_text(metadata, wrong)
    del results[0][0]
    with pytest.raises(KeyError, match="no rank wrote the chunk of 'w' at offsets \\[14, 0\\]"):
        _new_writer(metadata, results)


def test_a_chunk_of_other_dimensions_is_refused_before_anything_is_written():
    world = 4
    plans, metadata = merge_save_plans(_plans(world, [("w", (8, 2))]))
    results = _results(world, plans)
    chunks = metadata.state_dict_metadata["w"].chunks
    chunks[1] = ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2]))  # sizes of one dimension
    with pytest.raises(ValueError, match="tensor 'w' of 2 dimensions has a chunk of other dimensions"):
        _new_writer(metadata, results)

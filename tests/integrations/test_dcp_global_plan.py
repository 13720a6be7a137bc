"""fastckpt.dcp.global_plan.merge_save_plans gives exactly DCP's global plan and metadata (issue 28: the
coordinator's merge over columns): compared with DCP's own ``DefaultSavePlanner._create_global_plan`` on small
worlds, by pickled bytes and index hints, for FSDP-like, replicated, 2-D, bytes, repeated and invalid plans."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from fastckpt.dcp import SavePlanner
from fastckpt.dcp.global_plan import merge_save_plans

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benches.planning_scale import llm_model, rank_plans  # noqa: E402

F32 = TensorProperties(dtype=torch.float32)
BF16 = TensorProperties(dtype=torch.bfloat16)


def item(fqn, offsets, sizes, shape, props=F32, kind=WriteItemType.SHARD):
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    return WriteItem(MetadataIndex(fqn, offsets), kind,
                     tensor_data=TensorWriteData(chunk, props, torch.Size(shape)))


def scalar(fqn, props=F32):
    return WriteItem(MetadataIndex(fqn, ()), WriteItemType.TENSOR,
                     tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([]), torch.Size([])), props,
                                                 torch.Size([])))


def blob(fqn):
    return WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(7))


def dcp_result(plans, lowest=False, flatten=False):
    planner = DefaultSavePlanner(flatten_state_dict=flatten, dedup_save_to_lowest_rank=lowest)
    return planner._create_global_plan(plans)


def assert_same(plans, lowest=False, flatten=False):
    want = dcp_result(plans, lowest, flatten)
    got = merge_save_plans(plans, save_to_lowest_rank=lowest, flatten_state_dict=flatten)
    assert pickle.dumps(got) == pickle.dumps(want)
    assert got == want
    assert [[i.index.index for i in p.items] for p in got[0]] == [[i.index.index for i in p.items] for p in want[0]]
    # through the gather's pickling too (the coordinator receives unpickled plans)
    again = pickle.loads(pickle.dumps(plans))
    assert pickle.dumps(merge_save_plans(again, save_to_lowest_rank=lowest, flatten_state_dict=flatten)) == \
        pickle.dumps(dcp_result(pickle.loads(pickle.dumps(plans)), lowest, flatten))


@pytest.mark.parametrize("world", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("lowest", [False, True])
def test_fsdp_plans_with_replicated_steps_merge_as_dcp_merges_them(world, lowest):
    assert_same(rank_plans(world, 3), lowest=lowest)


def test_an_llm_shaped_state_with_more_ranks_than_rows_merges_as_dcp(monkeypatch):
    # 2816 ranks' Llama shapes scaled down: down_proj is wider than tall (DCP's sweep then runs along the columns)
    model = [(n, s) for n, s in llm_model(8, layers=1)]
    assert_same(rank_plans(8, 0, model))


def test_replicated_shards_ties_and_mixed_dtypes_merge_as_dcp():
    plans = []
    for r in range(6):
        items = [item("rep", (0, 0), (4, 4), (4, 4)),  # a Replicate placement: the same shard on every rank
                 item(f"own{r % 3}", (r // 3 * 2,), (2,), (4,), BF16 if r % 2 else F32),
                 scalar("step"), blob("extra") if r == 0 else scalar(f"s{r}")]
        if r % 2:
            items.append(item("half", (0,), (8,), (8,)))  # held by ranks 1, 3, 5
        plans.append(SavePlan(items, planner_data={f"k{r}": (r,)}))
    assert_same(plans)
    assert_same(plans, lowest=True)
    assert_same(plans, flatten=True)


class _Walked(list):
    """A plan's items that count how often they are walked."""

    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_a_replicated_state_walks_each_plan_a_bounded_number_of_times():
    """Every key held by every rank (a replicated state) plus keys of one rank: the merge equals DCP's and walks a
    plan's items a few times, not once per shared key (it was quadratic: 8000 replicated keys on 4 ranks took
    ~20 s against DCP's 0.5 s, long enough for the other ranks' collective to time out at scale)."""
    def plan(r):
        return SavePlan(_Walked([item(f"own{r}.{i}", (0,), (3,), (3,)) for i in range(5)]
                                + [item(f"rep{i}", (0,), (4,), (4,), BF16 if i % 2 else F32) for i in range(300)]))

    want = dcp_result([plan(r) for r in range(3)])
    _Walked.walks = 0
    got = merge_save_plans([plan(r) for r in range(3)])
    assert pickle.dumps(got) == pickle.dumps(want)
    assert _Walked.walks <= 4 * 3, _Walked.walks


def test_a_key_twice_in_one_plan_merges_as_dcp():
    # rank 1 holds a[0:2] twice; rank 0 holds it too and is given it, so rank 1 drops both copies
    plans = [SavePlan([item("a", (0,), (2,), (4,)), item("b", (0,), (1,), (1,))]),
             SavePlan([item("a", (0,), (2,), (4,)), item("a", (0,), (2,), (4,)), item("a", (2,), (2,), (4,))])]
    assert_same(plans)
    kept = merge_save_plans(plans)[0]
    assert [len(p.items) for p in kept] == [2, 1]


def test_a_2d_grid_and_uneven_blocks_merge_as_dcp():
    plans = [SavePlan([item("grid", (r // 4 * 3, r % 4 * 5), (3, 5), (9, 20)),
                       item("tail", (min(10, r * 1),), (max(0, min(10, r + 1) - min(10, r)),), (10,))])
             for r in range(12)]
    assert_same(plans)


@pytest.mark.parametrize("case", ["overlap", "out of bounds", "gap", "empty inside", "overlap 2d"])
def test_an_invalid_plan_raises_dcps_error(case):
    boxes = {"overlap": [((0,), (3,)), ((2,), (2,))],
             "out of bounds": [((0,), (2,)), ((2,), (3,))],
             "gap": [((0,), (1,)), ((2,), (2,))],
             "empty inside": [((0,), (4,)), ((2,), (0,))],
             "overlap 2d": [((0, 0), (2, 4)), ((1, 2), (2, 2)), ((2, 0), (2, 2))]}[case]
    shape = (4, 4) if case == "overlap 2d" else (4,)
    plans = [SavePlan([item("t", o, s, shape)]) for o, s in boxes]
    with pytest.raises(ValueError) as want:
        dcp_result(plans)
    with pytest.raises(ValueError) as got:
        merge_save_plans(plans)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("boxes", [[((0,), (2,)), ((2,), (2,))],  # chunks of fewer dims than the tensor
                                   [((0, 0, 0), (2, 4, 1)), ((2, 0, 0), (2, 4, 1))]])  # of more
def test_chunks_with_another_number_of_dims_than_their_tensor_merge_or_fail_as_dcp(boxes):
    """A chunk whose offsets / sizes have another length than the tensor's size: DCP's own check decides (an
    IndexError for fewer dims, as DCP; the merge's columns misaligned and it raised numpy's ValueError)."""
    plans = [SavePlan([item("t", o, s, (4, 4))]) for o, s in boxes]

    def outcome(fn):
        try:
            return pickle.dumps(fn())
        except Exception as exc:  # noqa: BLE001 - compared with DCP's
            return type(exc), str(exc)

    assert outcome(lambda: merge_save_plans(plans)) == outcome(lambda: dcp_result(plans))


def test_a_non_shard_item_saved_twice_in_one_plan_is_refused_as_dcp_refuses_it():
    plans = [SavePlan([scalar("s"), scalar("s")])]
    with pytest.raises(AssertionError):
        dcp_result(plans)
    with pytest.raises(AssertionError):
        merge_save_plans(plans)


def test_fastckpt_save_planner_uses_the_merge_and_keeps_dcps_result():
    plans = rank_plans(5, 2)
    planner = SavePlanner(flatten_state_dict=False)
    assert pickle.dumps(planner.create_global_plan(plans)) == pickle.dumps(dcp_result(plans))

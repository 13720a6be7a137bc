"""A DCP save of a part whose plan every rank has cached: no planning round.

``dcp.save`` always runs DCP's planning round (a gather of every rank's local plan to the coordinator and a scatter
of the global plan back), even when plan caching makes every plan empty. A sharded save (:mod:`fastckpt._plan.
sharded_save`) makes a round of its own anyway before it writes (``state``: every rank reports whether it could
take its state), so each rank plans its parts locally first (:func:`plan_locally`: DCP's local step, which compares
the plan with the cached one: names, offsets, shapes, chunks, and fastckpt's planner dtypes too) and reports, in
that same round, whether each part's plan is unchanged. A part unchanged on every rank is then written with
:func:`write_cached`: each rank takes its cached final plan, writes, and DCP's write round (gather of the write
results, ``finish`` on the coordinator with the cached metadata, broadcast of the outcome) is the only collective.
A part that changed anywhere goes through ``dcp.save`` as before (its planning round merges the new plans).
"""

from __future__ import annotations

from typing import Any

__all__ = ["plan_locally", "write_cached"]


def _cache_key(planner: Any) -> str | None:
    return getattr(planner, "_cached_plans_key", None) if getattr(planner, "_enable_plan_caching", False) else None


def plan_locally(state: dict[str, Any], writer: Any, planner: Any, *, is_coordinator: bool) -> bool:
    """DCP's local step of a save (set up the planner and the writer, make the local plan); returns whether this
    rank can write the part from its cached plans alone (its plan is unchanged, its final plan is cached, and on
    the coordinator the global metadata too)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    key = _cache_key(planner)
    if key is None:
        return False
    storage_meta = writer.storage_meta()
    planner.set_up_planner(state_dict=state, storage_meta=storage_meta, is_coordinator=is_coordinator)
    writer.set_up_storage_writer(is_coordinator)
    local = writer.prepare_local_plan(planner.create_local_plan())
    return (not local.usable and key in SavePlanner._cached_final_save_plan
            and (not is_coordinator or key in SavePlanner._cached_metadata))


def write_cached(state: dict[str, Any], *, process_group: Any, storage_writer: Any, planner: Any) -> Any:
    """The write of a part :func:`plan_locally` found unchanged on every rank (call it on every rank, with the
    same ``state``, writer and planner): the cached final plan written, then DCP's write round. Raises DCP's
    ``CheckpointException`` on every rank when any rank failed, as ``dcp.save``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.checkpoint.utils import _DistWrapper

    key = _cache_key(planner)
    dist_wrapper = _DistWrapper(process_group, True, 0)

    def write_data() -> Any:
        final = planner.finish_plan(SavePlan([], usable=False))  # the cached final plan of this rank
        writes = storage_writer.write_data(final, planner)
        writes.wait()
        return writes.value()

    def finish(results: list[Any]) -> Any:
        metadata = SavePlanner._cached_metadata[key]
        storage_writer.finish(metadata=metadata, results=results)
        return metadata

    assert dist.is_initialized()
    return dist_wrapper.all_reduce("write", write_data, finish)

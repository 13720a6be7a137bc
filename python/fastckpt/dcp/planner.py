"""fastckpt.dcp's planners: ``LoadPlanner`` (DCP's default load planner plus the dtype check during planning) and
``SavePlanner`` (DCP's default save planner with plan caching that also notices dtype changes)."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner import SavePlan as _SavePlan
from torch.distributed.checkpoint.planner import SavePlanner as _DCPSavePlanner

from fastckpt.dcp.gc_pause import gc_paused
from fastckpt.dcp.global_plan import merge_save_plans
from fastckpt.dcp.indexed import narrowed
from fastckpt.errors import DtypeError, MissingStateError, ShapeMismatchError

__all__ = ["LoadPlanner", "SavePlanner"]


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that refuses a template of another dtype while planning.

    DCP gathers every rank's planning outcome before any rank reads, so a mismatch on one rank raises on every
    rank and nothing changes anywhere (the reader's own check runs per rank, just before that rank reads).

    Over a folder with a chunk index (``dcp_index.bin``, :mod:`fastckpt.dcp.indexed`) it plans each tensor with the
    stored chunks its local boxes overlap, found by binary search, instead of scanning every stored chunk: a
    rank's planning does not grow with the number of ranks that saved.
    :func:`fastckpt.dcp.load` uses it; pass ``planner=fastckpt.dcp.LoadPlanner()`` to ``dcp.load`` for the same.

    Raises (from ``create_local_plan``, instead of DCP's bare ``RuntimeError`` / ``ValueError``):
        MissingStateError: state_dict keys the checkpoint does not hold (all of them named, with the stored keys
            the state_dict lacks; ``allow_partial_load=True`` skips them instead, as in DCP).
        DtypeError: a state_dict tensor whose dtype differs from the stored one (names the key and both dtypes).
        ShapeMismatchError: a state_dict tensor whose global shape differs from the stored one (key, both shapes).
    """

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata
        for fqn, obj in self.state_dict.items():
            md = stored.get(fqn)
            dtype = getattr(obj, "dtype", None)
            if isinstance(md, TensorStorageMetadata) and dtype is not None and dtype != md.properties.dtype:
                raise DtypeError(f"{fqn!r} is stored as {md.properties.dtype}, the state_dict entry it loads into "
                                 f"is {dtype}; load into a {md.properties.dtype} template and cast it yourself")
            size = getattr(obj, "size", None)
            if isinstance(md, TensorStorageMetadata) and callable(size) and tuple(size()) != tuple(md.size):
                raise ShapeMismatchError(f"{fqn!r} is stored with shape {list(md.size)}, the state_dict entry it "
                                         f"loads into has shape {list(size())}")
        full = self.metadata
        narrow = narrowed(full, self.state_dict)  # an indexed folder: only the chunks this rank's boxes overlap
        if narrow is not None:
            self.metadata = narrow
        try:
            return super().create_local_plan()
        except RuntimeError as exc:
            if not str(exc).startswith("Missing key in checkpoint state_dict"):
                raise
            # super() may have re-flattened the state dict the pre-2.4 way; name what it actually looked for
            missing = sorted(k for k in self.state_dict if k not in stored)
            extra = sorted(k for k in stored if k not in self.state_dict)
            raise MissingStateError(
                f"the checkpoint has no {', '.join(map(repr, missing))} ({len(missing)} state_dict key(s) not "
                f"stored); stored keys the state_dict lacks: {extra[:20] or 'none'}; remove those keys from the "
                "state_dict, or pass LoadPlanner(allow_partial_load=True) to leave them as they are"
            ) from None
        finally:
            self.metadata = full


def _properties(plan: _SavePlan) -> list[Any]:
    return [None if item.tensor_data is None else item.tensor_data.properties for item in plan.items]


class SavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose plans are cached across saves of an unchanged state (``cache_key`` given).

    DCP's plan caching (``enable_plan_caching``) keys its class-level caches by the planner's class name, so two
    parts saved by one process (model and optimizer) would share one entry; here the key is
    ``fastckpt.dcp:{cache_key}``. On a second save whose local plan is unchanged a rank sends an empty plan and the
    coordinator reuses the merged global plan and metadata (no dedup, merge or validation). DCP compares names,
    offsets, shapes and chunks of the plans, not dtypes: a rank whose tensors changed dtype sends its full plan, so
    the metadata is rebuilt. The coordinator's merge runs with the garbage collector paused (:mod:`gc_pause`), over
    columns (:func:`fastckpt.dcp.global_plan.merge_save_plans`: DCP's global plan and metadata, object for object).

    Only for a storage writer that does not take its folder from the plan's ``storage_data`` (a cached plan holds
    the previous save's): :meth:`fastckpt.dcp.StorageWriter.save_planner` gives one where that is safe.

    Args:
        cache_key: the state this planner saves (``"model"``, ``"optimizer"``); None: no caching.
    """

    def __init__(self, cache_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(enable_plan_caching=cache_key is not None, **kwargs)
        if cache_key is not None:
            self._cached_plans_key = f"fastckpt.dcp:{cache_key}"

    def create_local_plan(self) -> _SavePlan:
        plan = super().create_local_plan()
        if self._enable_plan_caching and not plan.usable:
            cached = _DCPSavePlanner._cached_save_plan[self._cached_plans_key]
            if _properties(self.plan) != _properties(cached):  # same shapes, another dtype: not the cached plan
                self._pending_local_plan = self.plan
                return self.plan
        return plan

    def create_global_plan(self, all_plans: list[_SavePlan]) -> tuple[list[_SavePlan], Metadata]:
        with gc_paused():
            return super().create_global_plan(all_plans)

    def _create_global_plan(self, all_plans: list[_SavePlan]) -> tuple[list[_SavePlan], Metadata]:
        # DCP's dedup + merge + validation, with DCP's output, over columns (fastckpt.dcp.global_plan)
        return merge_save_plans(all_plans, save_to_lowest_rank=self.dedup_save_to_lowest_rank,
                                flatten_state_dict=self.flatten_state_dict)

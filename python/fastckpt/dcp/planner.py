"""``fastckpt.dcp.LoadPlanner``: DCP's default load planner, plus the dtype and shape check during planning."""

from __future__ import annotations

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from fastckpt.errors import DtypeError

__all__ = ["LoadPlanner"]


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that refuses a template of another dtype while planning.

    DCP gathers every rank's planning outcome before any rank reads, so a mismatch on one rank raises on every
    rank and nothing changes anywhere (the reader's own check runs per rank, just before that rank reads).
    :func:`fastckpt.dcp.load` uses it; pass ``planner=fastckpt.dcp.LoadPlanner()`` to ``dcp.load`` for the same.

    Raises (from ``create_local_plan``):
        DtypeError: a state_dict tensor whose dtype differs from the stored one (names the key and both dtypes).
    """

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            dtype = getattr(obj, "dtype", None)
            if isinstance(md, TensorStorageMetadata) and dtype is not None and dtype != md.properties.dtype:
                raise DtypeError(f"{fqn!r} is stored as {md.properties.dtype}, the state_dict entry it loads into "
                                 f"is {dtype}; load into a {md.properties.dtype} template and cast it yourself")
        return super().create_local_plan()

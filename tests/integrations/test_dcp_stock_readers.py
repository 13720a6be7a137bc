"""What DCP's own storage readers (torch 2.13) do with a fastckpt DCP folder, and what a DCP user passes instead.

- ``FileSystemReader`` needs DCP's pickled ``.metadata`` and ``torch.load``s every slice: it cannot read the folder.
- ``HuggingFaceStorageReader`` lists the folder's ``*.safetensors`` files and takes each file's tensor names as the
  keys (offsets from a ``DCP_SHARDING_INFO`` entry fastckpt does not write): it reads a folder whose tensors are all
  stored whole under their own names (a one-process save) and nothing else; a non-tensor value or a tied weight
  (``dcp_metadata.json`` only) is a missing key.
- ``dcp.load(state, storage_reader=fastckpt.dcp.StorageReader(path), planner=fastckpt.dcp.LoadPlanner())`` reads
  all of it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import fastckpt.dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable):UserWarning")

def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"a": torch.randn(4, 3, generator=g), "b": torch.arange(5, dtype=torch.int64),
            "c": torch.randn(2, 6, generator=g).to(torch.bfloat16)}


def _zeros(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


def test_fastckpts_reader_through_dcp_load_reads_everything(tmp_path):
    shared = torch.randn(3, 3)
    state = {**_tensors(), "tied.x": shared, "tied.y": shared, "step": 3}
    fastckpt.dcp.save(state, tmp_path / "c")
    got = _zeros(state)
    dcp.load(got, storage_reader=fastckpt.dcp.StorageReader(tmp_path / "c"), planner=fastckpt.dcp.LoadPlanner())
    assert all(torch.equal(got[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    assert got["step"] == 3


def test_dcps_filesystem_reader_cannot_read_the_folder(tmp_path):
    fastckpt.dcp.save(_tensors(), tmp_path / "c")
    with pytest.raises(CheckpointException, match=r"\.metadata"):
        dcp.load(_zeros(_tensors()), storage_reader=dcp.FileSystemReader(tmp_path / "c"))


def test_dcps_huggingface_reader_reads_whole_tensors_only(tmp_path):
    state = _tensors()
    fastckpt.dcp.save(state, tmp_path / "c")
    got = _zeros(state)
    dcp.load(got, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path / "c")))
    assert all(torch.equal(got[k], v) for k, v in state.items())

    fastckpt.dcp.save({**state, "step": 3}, tmp_path / "o")
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: step"):
        dcp.load(_zeros({**state, "step": 3}), storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path / "o")))

    shared = torch.randn(3, 3)  # stored once, under the first name; the second is in dcp_metadata.json only
    fastckpt.dcp.save({"x": shared, "y": shared}, tmp_path / "t")
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: y"):
        dcp.load({"x": torch.zeros(3, 3), "y": torch.zeros(3, 3)},
                 storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path / "t")))

"""One process of the DCP plugin tests (``torchrun --nproc-per-node N``, gloo, CPU).

Usage: ``torchrun --standalone --nproc-per-node N tests/helpers/dcp_worker.py OUT_DIR MODE``; each rank writes
``OUT_DIR/{MODE}-rank{r}.json`` (``{check: value}``); tests/integrations/test_dcp_multiprocess.py asserts on them.

MODE ``save`` (2 ranks):
  A: ``dcp.save`` (unchanged) of the state sharded along dim 0 -> ``OUT/A``; reload on 2 ranks along dim 1.
  I: the sharded tensors alone, saved along dim 0 -> ``OUT/I``, reloaded through the chunk index along dim 0 (each
     rank opens its own shard file only) and along dim 1.
  B / C: ``dcp.async_save`` with the thread / the process checkpointer -> ``OUT/B``, ``OUT/C``; reload.
  F: ``OUT/F`` holds seed 1; re-saves of seed 2 that fail on rank 1 (an I/O error after its file is written, a
     value that needs pickle, the same I/O error under raw ``dcp.save``) raise on both ranks and leave seed 1.
  D: loading ``OUT/A`` into a float64 ``w`` raises DtypeError on both ranks; nothing of the template changes; the
     same when only rank 1's template is wrong (fastckpt.dcp.LoadPlanner checks while planning).
  S: ``fastckpt.dcp.save`` of the state sharded along dim 0 to ``$FASTCKPT_TEST_S3_URL`` (the test's moto server:
     every rank uploads its shard, the coordinator commits the manifest object); reload on 2 ranks along dim 1.
  O: its sharded tensors alone, saved along dim 0 to ``$FASTCKPT_TEST_S3_URL-own``: reloaded along dim 0 each rank
     fetches its own object only, along dim 1 both; then rank 0 flips a byte of rank 1's object: a load raises
     IntegrityError on both ranks (rank 1 finds it while planning) and fills nothing on either.
  R (2 ranks, and 4 in MODE load): ``OUT/A`` into plain tensors on every rank (data parallel), read once in total and
     read by every rank (bytes read per rank recorded); then rank 1's reads fail: every rank raises.
MODE ``load`` (any world size): ``OUT/A`` into DTensors along dim 0 and along dim 1; R.
MODE ``kill`` (2 ranks): ``OUT/K`` holds seed 1; during the re-save of seed 2 rank 1 is SIGKILLed right after it
  wrote its file (torchrun then stops rank 0, which waits in DCP's gather): the test checks the folder afterwards.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh

import fastckpt._io.storage.local.parts as writer_module  # where a DCP rank writes its file (fault injection)
import fastckpt.dcp
from fastckpt import _core
from fastckpt._io.storage.local.staging import leftovers
from helpers.dcp_state import SHARDED, as_dtensors, full_state, mismatches, template

OUT, MODE = Path(sys.argv[1]), sys.argv[2]
checks: dict[str, object] = {}


def reload(folder: Path, mesh, dim: int, seed: int = 0, **kw) -> list[str]:
    state = full_state(seed)
    target = as_dtensors(template(state), mesh, dim, zero=True)
    fastckpt.dcp.load(target, folder, **kw)
    return mismatches(state, target, world=mesh.size(), rank=mesh.get_local_rank(), dim=dim)


def reload_fetched(url: str, state: dict, mesh, dim: int) -> tuple[list[str], list[str]]:
    """Load ``url`` into ``state``'s template sharded along ``dim``; (mismatches, objects this rank fetched)."""
    target = as_dtensors(template(state), mesh, dim, zero=True)
    reader = fastckpt.dcp.StorageReader(url)
    dcp.load(target, storage_reader=reader)
    return mismatches(state, target, world=mesh.size(), rank=mesh.get_local_rank(), dim=dim), reader.fetched


def reload_opened(folder: Path, state: dict, mesh, dim: int) -> tuple[list[str], list[str]]:
    """Load ``folder`` into ``state``'s template sharded along ``dim`` through its chunk index; (mismatches, the
    shard files this rank opened)."""
    target = as_dtensors(template(state), mesh, dim, zero=True)
    reader = fastckpt.dcp.StorageReader(folder)
    dcp.load(target, storage_reader=reader, planner=reader.load_planner())
    return mismatches(state, target, world=mesh.size(), rank=mesh.get_local_rank(), dim=dim), sorted(reader._files)


def read_once(folder: Path, rank: int) -> None:
    """``folder`` loaded into plain tensors on every rank (a data-parallel load: every box wanted by every rank),
    read once in total (``read_once=True``: each box by one rank, sent to the others) and by every rank; then the
    reading rank 1 fails: every rank raises, none hangs."""
    import fastckpt.dcp.boxes as reader_module  # the module that reads the boxes

    state = full_state()
    for once in (True, False):
        target = template(state)
        reader = fastckpt.dcp.StorageReader(folder, read_once=once)
        dcp.load(target, storage_reader=reader, planner=reader.load_planner())
        checks[f"R_{once}"] = {"mismatches": mismatches(state, target), "read": reader.read_bytes,
                               "verified": reader.verified_bytes, "received": reader.received_bytes}
    real = reader_module.read_boxes
    if rank == 1:
        def failing(*args, **kwargs):
            raise OSError(5, "injected read error", "shard")
        reader_module.read_boxes = failing
    checks["R_fail"] = error_of(lambda: fastckpt.dcp.load(template(state), folder))
    reader_module.read_boxes = real


def damaged_object(url: str, state: dict, mesh, rank: int) -> None:
    from helpers.s3_server import BUCKET, client, key_prefix, keys

    dist.barrier()
    if rank == 0:  # the last byte of rank 1's object: tensor data, the size unchanged
        key = next(k for k in keys(key_prefix(url) + "/") if k.endswith("/shard-00001-of-00002.safetensors"))
        data = bytearray(client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
        data[-1] ^= 0x01
        client().put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    dist.barrier()
    target = as_dtensors(template(state), mesh, 0, zero=True)
    try:
        dcp.load(target, storage_reader=fastckpt.dcp.StorageReader(url))
        checks["O_damaged"] = "no error"
    except CheckpointException as exc:
        inner = fastckpt.dcp.original_error(exc)
        checks["O_damaged"] = f"{type(inner).__name__}: {inner}"
    checks["O_damaged_filled"] = sorted(k for k, v in target.items() if v.to_local().reshape(-1).view(torch.uint8).any())


def error_of(fn) -> str:
    try:
        fn()
    except CheckpointException as exc:
        inner = fastckpt.dcp.original_error(exc)
        return f"CheckpointException[{type(inner).__name__}]"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class _DieAfterWrite:
    """``_core`` whose ``write_files_checked`` writes, then SIGKILLs this process (a rank dying mid-save)."""

    def __getattr__(self, name):
        return getattr(_core, name)

    def write_files_checked(self, *args, **kwargs):
        _core.write_files_checked(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)


class _FailAfterWrite:
    """``_core`` whose ``write_files_checked`` writes, then fails like a disk error (injected on one rank)."""

    def __getattr__(self, name):
        return getattr(_core, name)

    def write_files_checked(self, *args, **kwargs):
        _core.write_files_checked(*args, **kwargs)
        raise OSError(5, "injected I/O error", "shard")


def failures(mesh, rank: int) -> None:
    folder = OUT / "F"
    fastckpt.dcp.save(as_dtensors(full_state(1), mesh, 0), folder)
    fresh = as_dtensors(full_state(2), mesh, 0)
    if rank == 1:
        writer_module._core = _FailAfterWrite()
    checks["F_io"] = error_of(lambda: fastckpt.dcp.save(fresh, folder))
    checks["F_io_left"] = reload(folder, mesh, 0, seed=1)
    checks["F_io_leftovers"] = sorted(n for names in leftovers(OUT).values() for n in names)
    checks["F_raw"] = error_of(lambda: dcp.save(fresh, storage_writer=fastckpt.dcp.StorageWriter(folder)))
    checks["F_raw_left"] = reload(folder, mesh, 0, seed=1)
    writer_module._core = _core
    odd = dict(fresh, **({"opaque": SimpleNamespace(a=1)} if rank == 1 else {}))
    checks["F_pickle"] = error_of(lambda: fastckpt.dcp.save(odd, folder))
    checks["F_pickle_left"] = reload(folder, mesh, 0, seed=1)
    fastckpt.dcp.save(fresh, folder)  # a good save after the failures: seed 2, and no leftovers of theirs
    checks["F_after"] = reload(folder, mesh, 0, seed=2)
    checks["F_after_leftovers"] = sorted(n for names in leftovers(OUT).values() for n in names)


def dtype_mismatch(mesh) -> None:
    state = full_state()
    target = as_dtensors(template(state), mesh, 1, zero=True)
    target["w"] = torch.zeros(7, 5, dtype=torch.float64)
    before = {k: v.to_local().clone() if hasattr(v, "to_local") else v for k, v in target.items()}
    checks["D_error"] = error_of(lambda: fastckpt.dcp.load(target, OUT / "A"))
    checks["D_changed"] = [k for k, v in target.items() if isinstance(v, torch.Tensor) and not torch.equal(
        (v.to_local() if hasattr(v, "to_local") else v).reshape(-1).view(torch.uint8),
        (before[k].to_local() if hasattr(before[k], "to_local") else before[k]).reshape(-1).view(torch.uint8))]
    checks["D_values"] = [target["step"], target["extra"]["name"]]
    # only rank 1's template is wrong: planning fails on rank 1, so rank 0 raises too and reads nothing
    target = as_dtensors(template(state), mesh, 1, zero=True)
    if dist.get_rank() == 1:
        target["f16"] = torch.zeros(3, 3)
    checks["D1_error"] = error_of(lambda: fastckpt.dcp.load(target, OUT / "A"))
    checks["D1_changed"] = [k for k, v in target.items() if isinstance(v, torch.Tensor)
                            and (v.to_local() if hasattr(v, "to_local") else v).reshape(-1).view(torch.uint8).any()]
    # only rank 1's template has a key the checkpoint lacks: a MissingStateError on every rank, nothing read
    target = as_dtensors(template(state), mesh, 1, zero=True)
    if dist.get_rank() == 1:
        target["not_saved"] = torch.zeros(2)
    checks["M_error"] = error_of(lambda: fastckpt.dcp.load(target, OUT / "A"))
    checks["M_changed"] = [k for k, v in target.items() if isinstance(v, torch.Tensor)
                           and (v.to_local() if hasattr(v, "to_local") else v).reshape(-1).view(torch.uint8).any()]


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a crashed rank never hangs the rest
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    try:
        if MODE == "save":
            dcp.save(as_dtensors(full_state(), mesh, 0), storage_writer=fastckpt.dcp.StorageWriter(OUT / "A"))
            checks["A_dim1"] = reload(OUT / "A", mesh, 1)
            own = {k: v for k, v in full_state().items() if k in SHARDED}
            fastckpt.dcp.save(as_dtensors(own, mesh, 0), OUT / "I")
            checks["I_dim0"] = reload_opened(OUT / "I", own, mesh, 0)  # the index: its own shard file only
            checks["I_dim1"] = reload_opened(OUT / "I", own, mesh, 1)
            fut = dcp.async_save(as_dtensors(full_state(), mesh, 0), storage_writer=fastckpt.dcp.StorageWriter(OUT / "B"))
            fut.result()
            checks["B_dim0"] = reload(OUT / "B", mesh, 0)
            fut = dcp.async_save(as_dtensors(full_state(), mesh, 1), storage_writer=fastckpt.dcp.StorageWriter(OUT / "C"),
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            fut.result()
            checks["C_dim0"] = reload(OUT / "C", mesh, 0)
            failures(mesh, rank)
            read_once(OUT / "A", rank)
            dtype_mismatch(mesh)
            s3_url = os.environ["FASTCKPT_TEST_S3_URL"]
            fastckpt.dcp.save(as_dtensors(full_state(), mesh, 0), s3_url)
            checks["S_dim1"] = reload(s3_url, mesh, 1)
            own = {k: v for k, v in full_state().items() if k in SHARDED}
            fastckpt.dcp.save(as_dtensors(own, mesh, 0), s3_url + "-own")
            checks["O_dim0"] = reload_fetched(s3_url + "-own", own, mesh, 0)
            checks["O_dim1"] = reload_fetched(s3_url + "-own", own, mesh, 1)
            damaged_object(s3_url + "-own", own, mesh, rank)
        elif MODE == "kill":
            fastckpt.dcp.save(as_dtensors(full_state(1), mesh, 0), OUT / "K")
            if rank == 1:
                writer_module._core = _DieAfterWrite()
            fastckpt.dcp.save(as_dtensors(full_state(2), mesh, 0), OUT / "K")
        else:
            checks["L_dim0"] = reload(OUT / "A", mesh, 0)
            checks["L_dim1"] = reload(OUT / "A", mesh, 1)
            read_once(OUT / "A", rank)
    except BaseException:  # report, so the test shows the traceback of the rank that failed
        checks["crash"] = traceback.format_exc()
    (OUT / f"{MODE}-rank{rank}.json").write_text(json.dumps(checks, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The model files of a sharded model-only save (:mod:`fastckpt._plan.sharded_save`), on the main process: assembled
from the DCP shards in the staging folder every process shares (:func:`assemble_model_files`), or gathered whole
when the processes share no folder (:func:`full_model_states`); the save's ``commit`` then writes them with the
small files and the manifest (:class:`~fastckpt._io.storage.base.SharedSave`).

A local model-only save turns each model's DCP shards on the main process's disk into the files a one-process
model-only save writes. Over ``s3://`` the processes share no disk: the full state dict is gathered to the main
process instead (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: one all-gather per tensor, the
whole model in the main process's CPU memory) and uploaded as a one-process model-only save uploads it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from fastckpt import _core
from fastckpt._io.storage.local.integrity import digest_entry, text_entry
from fastckpt._state.sharded import tied_names

__all__ = ["assemble_model_files", "full_model_states"]


def assemble_model_files(staging: Path, parts: list[str], aliases: list[dict[str, str]], names: list[list[str]], *,
                    max_shard_size: int | None, durable: bool, threads: int) -> dict[str, dict[str, Any]]:
    """Main process, model-only saves: each model part's DCP shards in ``staging/{part}`` -> the files a one-process
    model-only save writes (``model.safetensors``, or Hugging Face shards + index), assembled by positional copies
    in the Rust core (``fastckpt consolidate``'s code); the DCP subfolders are removed. Returns their checksums."""
    from fastckpt._io.dcp.consolidate import write_model_files
    from fastckpt._io.dcp.files import read_dcp_metadata

    checksums: dict[str, dict[str, Any]] = {}
    for i, sub in enumerate(parts):
        folder = staging / sub
        parsed = read_dcp_metadata(folder)
        written = write_model_files(folder, parsed, staging, names={n: n for n in names[i]}, aliases=aliases[i],
                                    base=sub, max_shard_size=max_shard_size, durable=durable, threads=threads)
        tensor_files = [name for name, kind in written.items() if kind == "safetensors"]
        sums = _core.checksum_files([str(staging / n) for n in tensor_files], threads=threads)
        hashes = _core.hash_files([str(staging / n) for n in tensor_files], threads=threads)
        for name, (size, crc, tensors, _), (xxh3, _) in zip(tensor_files, sums, hashes):
            checksums[name] = digest_entry((size, crc, tensors or [], xxh3 or []))
        for name in written.keys() - set(tensor_files):
            checksums[name] = text_entry((staging / name).read_bytes())
        shutil.rmtree(folder)
    return checksums


def full_model_states(models: list[torch.nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Every process (collectives): each model's full state dict on the main process's CPU (ties as one tensor
    under both names, as a plain model's ``state_dict``), ``[]`` per model elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    states = []
    for m in models:
        full = dict(get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
        for dropped, kept in tied_names(m).items():
            if dropped in full and kept in full:
                full[dropped] = full[kept]
        states.append(full)
    return states

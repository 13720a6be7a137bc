"""The last step of a sharded save (:mod:`fastckpt._plan.sharded_save`), on the main process: the small files and
the manifest, committed once, into a local folder (:func:`commit_local`, with :func:`assemble_model_files` for a
model-only save) or to object storage (:func:`commit_remote`, with :func:`full_model_states` for a model-only save).

A local model-only save turns each model's DCP shards on the main process's disk into the files a one-process
model-only save writes. Over ``s3://`` the processes share no disk: the full state dict is gathered to the main
process instead (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: one all-gather per tensor, the
whole model in the main process's CPU memory) and uploaded as a one-process model-only save uploads it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from fastckpt import _core
from fastckpt._format.json_input import load_json
from fastckpt._format.tensors import tensor_sources
from fastckpt._io.files import SavePlan
from fastckpt._io.storage.local.commit import fsync_dir, write_text
from fastckpt._io.storage.local.integrity import digest_entry, text_entry
from fastckpt._io.storage.local.layout import MANIFEST, manifest_dict
from fastckpt._io.storage.object.sharded import ObjectSave
from fastckpt._state.sharded import tied_names

__all__ = ["parts_of", "assemble_model_files", "commit_local", "commit_remote", "full_model_states"]


def parts_of(folder: Path) -> set[str]:
    """The DCP part subfolders a sharded checkpoint's manifest names (never carried over as user files)."""
    try:
        sharded = load_json((folder / MANIFEST).read_text(), f"{folder / MANIFEST}", object).get("sharded", {})
        return {str(p) for p in sharded.get("parts", [])}
    except (OSError, ValueError, AttributeError):
        return set()


def _carry_user_files(target: Path, staging: Path) -> None:
    """Hard-link into ``staging`` the files the user keeps in ``target``: those its manifest does not list."""
    try:
        listed = set(load_json((target / MANIFEST).read_text(), f"{target / MANIFEST}", object)["files"]) | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        listed = {MANIFEST}
    try:
        entries = list(target.iterdir()) if target.is_dir() else []
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name in listed or (staging / entry.name).exists() or entry.name in parts_of(target):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, staging / entry.name, symlinks=True, copy_function=os.link)
            else:
                os.link(entry, staging / entry.name, follow_symlinks=False)
        except FileNotFoundError:
            continue


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


def commit_local(staging: Path, target: Path, plan: SavePlan, sharded: dict[str, Any] | None, *, durable: bool,
            threads: int, checksums: dict[str, dict[str, Any]] | None = None) -> None:
    """Main process: write ``plan``'s files and the manifest into ``staging`` (which holds DCP's), commit it.

    ``sharded``: the manifest's ``"sharded"`` entry (None: the folder holds no DCP parts); ``checksums``: those of
    files already in ``staging``."""
    jobs = [(str(staging / p.name), tensor_sources(p.tensors), p.metadata) for p in plan.parts]
    digests = _core.write_files_checked(jobs, durable=durable, threads=threads, ready=None)
    checksums = {**(checksums or {}), **{p.name: digest_entry(d) for p, d in zip(plan.parts, digests)}}
    for name, text in plan.texts.items():
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        write_text(staging / name, data, durable)
        checksums[name] = text_entry(data)
    files = {p.name: p.stat().st_size for p in staging.iterdir() if p.is_file()}
    counts = plan.counts if sharded is None else {**plan.counts, "sharded": sharded}
    manifest = manifest_dict(plan.mode, files, counts, plan.step, checksums=checksums)
    _carry_user_files(target, staging)
    write_text(staging / MANIFEST, json.dumps(manifest, indent=2), durable)
    if durable:
        fsync_dir(staging)
    _core.commit_dir(str(staging), str(target), durable=durable)


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


def commit_remote(target: ObjectSave, plan: SavePlan, sharded: dict[str, Any] | None, *, threads: int) -> None:
    """Main process: upload ``plan``'s files and commit the save, its manifest the one :func:`commit_local` writes
    (``sharded``: that entry, whose ``files`` the other processes uploaded; None: a model-only save)."""
    if sharded is None:
        target.commit(plan, objects={}, threads=threads)
    else:
        target.commit(plan, objects=sharded["files"], counts={"sharded": sharded}, threads=threads)

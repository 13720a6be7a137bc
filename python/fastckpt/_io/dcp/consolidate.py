"""Consolidation: a DCP-format folder (:class:`fastckpt.dcp.StorageWriter`'s) -> a Hugging Face model folder.

Each output tensor is assembled from its stored chunks by the Rust core (``_core.write_assembled``): a chunk at
``offsets`` with ``sizes`` fills a box of the full tensor, i.e. a set of contiguous byte runs (the box's rows, see
:mod:`fastckpt._format.dcp_boxes`) copied by positional reads and writes; peak memory is ``threads * chunk_bytes``
(8 MiB each), not the model's size. The files are the official writer's (header order and padding,
``{"format": "pt"}`` metadata); tied weights (names whose chunks are the same stored bytes) are written once under
the first name, the dropped ones recorded in the metadata as ``{dropped: kept}`` (``safetensors.torch.save_model``'s
convention); shards and ``model.safetensors.index.json`` follow ``huggingface_hub``'s split. The output folder is
built in a staging folder and committed in one step, like a checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._format.dcp_boxes import box_runs
from fastckpt._format.dcp_metadata import METADATA_FILE, ParsedMetadata
from fastckpt._format.dtypes import F4, to_torch_dtype
from fastckpt._format.json_input import load_json
from fastckpt._io.dcp.files import is_dcp_folder, open_chunk_files, read_dcp_metadata
from fastckpt._io.storage.local.commit import check_target, fsync_dir
from fastckpt._io.storage.local.shards import _assign, index_name, shard_name
from fastckpt._io.storage.local.staging import OwnedPath, clean_leftovers
from fastckpt.errors import KeyMismatchError, MissingStateError

__all__ = ["find_dcp_folder", "consolidate", "CONFIG_FILES"]

CONFIG_FILES = ("config.json", "generation_config.json")
#: subfolder names a fastckpt or accelerate checkpoint keeps its model's DCP save in, in order of preference
_MODEL_FOLDERS = ("model", "pytorch_model_fsdp_0")


def find_dcp_folder(src: Path) -> Path:
    """The DCP-format folder holding the model in ``src``: ``src`` itself, or its one DCP subfolder (``model``
    preferred when there are several).

    Raises:
        MissingStateError: no DCP-format folder there, or several and none named as the model's.
    """
    if is_dcp_folder(src):
        return src
    if not src.is_dir():
        raise MissingStateError(f"{src}: not a folder")
    found = sorted(p for p in src.iterdir() if p.is_dir() and is_dcp_folder(p))
    for name in _MODEL_FOLDERS:
        if src / name in found:
            return src / name
    if len(found) == 1:
        return found[0]
    if not found:
        model_files = [n for n in ("model.safetensors", "model.safetensors.index.json") if (src / n).is_file()]
        if model_files:  # e.g. an FSDP2 model_only save: written consolidated already
            raise MissingStateError(
                f"{src}: already a model folder ({model_files[0]}), not a DCP checkpoint: there is nothing to "
                f"consolidate (from_pretrained and load_state read it as it is); to reshard it, run "
                f"`fastckpt convert {src} OUT --to hf-model --max-shard-size 5GB`")
        raise MissingStateError(f"{src}: no {METADATA_FILE} in it or in a subfolder; not a fastckpt DCP checkpoint")
    raise MissingStateError(f"{src}: several DCP folders ({', '.join(p.name for p in found)}); name the model's")


@dataclass
class _Out:
    name: str
    fqn: str
    dtype: str
    stored_shape: list[int]
    itemsize: int
    nbytes: int

    def numel(self) -> int:  # what shards._assign sizes tensors by
        return self.nbytes

    def element_size(self) -> int:
        return 1


def _model_tensors(parsed: ParsedMetadata, key: str | None) -> dict[str, str]:
    """``{output name: fqn}`` of the tensors to write, in state-dict order (see :func:`consolidate`'s ``key``)."""
    fqns = list(parsed.dtypes)
    paths = parsed.metadata.planner_data if isinstance(parsed.metadata.planner_data, dict) else {}
    nested = {f: tuple(paths[f]) for f in fqns if isinstance(paths.get(f), (tuple, list)) and len(paths[f]) > 1}
    if key is None:
        key = "model" if any(p[0] == "model" for p in nested.values()) else None
    if key is None:
        return {f: f for f in fqns}
    chosen = {".".join(map(str, p[1:])): f for f, p in nested.items() if p[0] == key}
    chosen.update({f[len(key) + 1:]: f for f in fqns if f not in nested and f.startswith(key + ".")})
    if not chosen:
        tops = sorted({(nested[f][0] if f in nested else f.split(".")[0]) for f in fqns})
        raise KeyMismatchError(f"no tensors under {key!r}; the top-level entries are {tops[:20]}")
    return {name: chosen[name] for name in sorted(chosen, key=lambda n: fqns.index(chosen[n]))}


def _saved_aliases(src: Path, folder: Path) -> dict[str, str]:
    """``{dropped: kept}`` tied names of a fastckpt sharded checkpoint's ``model/`` part (its manifest's
    ``sharded.aliases``), written as the one-process save records them; {} for any other folder."""
    from fastckpt._io.storage.local.layout import MANIFEST

    if folder != src / "model" or not (src / MANIFEST).is_file():
        return {}
    try:
        aliases = load_json((src / MANIFEST).read_text(), f"{src / MANIFEST}", object)["sharded"]["aliases"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return {}
    return {str(k): str(v) for k, v in aliases.items()} if isinstance(aliases, dict) else {}


def consolidate(src: Path, out: Path, *, max_shard_size: int | None, key: str | None = None, threads: int = 0,
                durable: bool = True, progress: Callable[[int], Any] | None = None) -> list[str]:
    """Write the Hugging Face model folder ``out`` from the DCP-format checkpoint ``src``.

    Args:
        src: a folder :class:`fastckpt.dcp.StorageWriter` wrote, or a checkpoint holding one (see
            :func:`find_dcp_folder`); it is validated in full first (metadata, every file's header).
        out: the output folder (replaced whole, atomically).
        max_shard_size: bytes per output file (None: one file); more tensors give ``model-0000k-of-0000N.safetensors`` + the index.
        key: the top-level state-dict entry holding the model (``dcp.save({"model": sd, "optim": ...})``); None:
            ``"model"`` when there is one, else every tensor under its own name.
        threads: copy threads (0 = min(8, cores)).
        durable: fsync every file and the folders.
        progress: called with the bytes of each file once it is written.

    Returns:
        The names of the files written, in ``out``.

    Raises:
        MissingStateError, HeaderError, IntegrityError: see :func:`fastckpt._io.dcp.files.open_chunk_files`.
        KeyMismatchError: no tensor under ``key``. ValueError: stored chunks do not cover a tensor.
    """
    folder = find_dcp_folder(src)
    parsed = read_dcp_metadata(folder)
    names = _model_tensors(parsed, key)
    aliases = _saved_aliases(src, folder) if key is None else {}
    out = check_target(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out.parent)
    owner = OwnedPath(out.parent, out.name)
    try:
        owner.path.mkdir()
        written = list(write_model_files(folder, parsed, owner.path, names=names, aliases=aliases,
                                         max_shard_size=max_shard_size, durable=durable, threads=threads,
                                         progress=progress))
        for config in CONFIG_FILES:
            for where in (src, folder, folder.parent):
                if (where / config).is_file():
                    shutil.copyfile(where / config, owner.path / config)
                    written.append(config)
                    break
        if durable:
            fsync_dir(owner.path)
        _core.commit_dir(str(owner.path), str(out), durable=durable)
    finally:
        owner.release()
    return written


def write_model_files(folder: Path, parsed: ParsedMetadata, out: Path, *, names: dict[str, str],
                      aliases: dict[str, str] | None = None, base: str = "model", max_shard_size: int | None,
                      durable: bool = True, threads: int = 0,
                      progress: Callable[[int], Any] | None = None) -> dict[str, str]:
    """Write the Hugging Face model files of the DCP-format ``folder`` into the existing folder ``out`` (no commit).

    Args:
        parsed: ``folder``'s metadata (:func:`fastckpt._io.dcp.files.read_dcp_metadata`).
        names: ``{output name: fqn}`` in state-dict order (the order shards are filled in).
        aliases: ``{dropped: kept}`` tied names stored once (recorded in the metadata of the kept one's file), on
            top of the ties found as names whose chunks are the same stored bytes.
        base: ``model`` gives ``model.safetensors`` (or ``model-0000k-of-0000N.safetensors`` + the index).
        max_shard_size: bytes per file; None: one file.

    Returns:
        ``{file name: "safetensors" | "index"}`` of the files written, in order.

    Raises:
        As :func:`consolidate`.
    """
    files, _records = open_chunk_files(folder, parsed)
    sources = sorted(files)
    src_index = {name: i for i, name in enumerate(sources)}
    entries = {name: {t[0]: t for t in f.tensors()} for name, f in files.items()}
    outputs: dict[str, _Out] = {}
    kept: dict[tuple, str] = {}
    ties: dict[str, str] = {}
    for name, fqn in names.items():
        md = parsed.metadata.state_dict_metadata[fqn]
        locs = tuple(sorted((tuple(int(o) for o in c.offsets), parsed.chunks[(fqn, tuple(int(o) for o in c.offsets))])
                            for c in md.chunks))  # type: ignore[union-attr]
        if locs and locs in kept:
            ties[name] = kept[locs]
            continue
        kept[locs] = name
        dtype = parsed.dtypes[fqn]
        size = [int(s) for s in md.size]  # type: ignore[union-attr]
        itemsize = to_torch_dtype(dtype, name=fqn).itemsize
        stored = [*size[:-1], size[-1] * 2] if dtype == F4 and size else size
        outputs[name] = _Out(name, fqn, dtype, stored, itemsize, itemsize * math.prod(size))
    ties.update(aliases or {})
    groups = _assign(outputs, max_shard_size) if max_shard_size is not None else [list(outputs)]
    n = len(groups)
    file_names = [f"{base}.safetensors"] if n <= 1 else [shard_name(base, k + 1, n) for k in range(n)]
    weight_map: dict[str, str] = {}
    for file_name, group in zip(file_names, groups or [[]]):
        tensors = [_ranges(outputs[name], parsed, files, entries, src_index) for name in group]
        meta = [("format", "pt"), *((d, k) for d, k in ties.items() if k in group)]
        size = _core.write_assembled(str(out / file_name), [str(folder / s) for s in sources], tensors,
                                     meta, durable=durable, threads=threads)
        weight_map.update({name: file_name for name in group})
        if progress is not None:
            progress(size)
    written = {name: "safetensors" for name in file_names}
    if n > 1:  # the index as fastckpt._io.storage.local.shards.split_part writes it
        index = {"metadata": {"total_size": sum(o.nbytes for o in outputs.values())}, "weight_map": weight_map}
        text = json.dumps(index, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        (out / index_name(base)).write_text(text, encoding="utf-8")
        written[index_name(base)] = "index"
    return written


def _ranges(o: _Out, parsed: ParsedMetadata, files: dict[str, Any], entries: dict[str, dict[str, tuple]],
            src_index: dict[str, int]) -> tuple:
    """The ``_core.write_assembled`` tuple of one output tensor: every stored chunk's runs in the full tensor."""
    md = parsed.metadata.state_dict_metadata[o.fqn]
    size = [int(s) for s in md.size]  # type: ignore[union-attr]
    src_i: list[int] = []
    src_off: list[int] = []
    dst_off: list[int] = []
    lens: list[int] = []
    for chunk in md.chunks:  # type: ignore[union-attr]
        offsets = tuple(int(x) for x in chunk.offsets)
        loc = parsed.chunks[(o.fqn, offsets)]
        base = files[loc.file].data_start + entries[loc.file][loc.name][3]
        starts, run = box_runs(size, offsets, [int(s) for s in chunk.sizes], o.itemsize)
        k = len(starts)
        src_i += [src_index[loc.file]] * k
        src_off += [base + i * run for i in range(k)]
        dst_off += starts.tolist()
        lens += [run] * k
    return (o.name, o.dtype, o.stored_shape, src_i, src_off, dst_off, lens)


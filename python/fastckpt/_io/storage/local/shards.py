"""Sharded safetensors files in the Hugging Face layout: split on save, validate the index on load.

A part too large for ``max_shard_size`` becomes ``{base}-0000k-of-0000N.safetensors`` plus
``{base}.safetensors.index.json``::

    {"metadata": {"total_size": 123456}, "weight_map": {"encoder.weight": "model-00001-of-00002.safetensors", ...}}

(``base`` is ``model``, ``model_1``, ``optimizer``, ...; ``total_size`` is the tensor bytes of all shards). Tensors
are assigned in state-dict order exactly as ``huggingface_hub.split_torch_state_dict_into_shards`` does, so the same
state dict gives the same shards as ``save_pretrained``; one shard is written under the plain name without an index.

Loading validates the index before any tensor is read: every shard name is a plain ``.safetensors`` file name inside
the checkpoint folder, every listed shard is present (one error lists all missing ones, case C19), every tensor sits
in the shard the index names, and no tensor appears in two shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._io.storage.local.folder import open_safetensors, read_fresh
from fastckpt.errors import HeaderError, IntegrityError, KeyMismatchError, MissingStateError

__all__ = [
    "shard_name", "index_name", "split_part", "ShardedFile", "open_state_files", "open_state_file",
    "has_state_file",
]

def shard_name(base: str, k: int, n: int) -> str:
    """``shard_name("model", 1, 3) == "model-00001-of-00003.safetensors"`` (k counts from 1)."""
    return f"{base}-{k:05d}-of-{n:05d}.safetensors"


def index_name(base: str) -> str:
    """``index_name("model") == "model.safetensors.index.json"``."""
    return f"{base}.safetensors.index.json"


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _assign(tensors: dict[str, Any], max_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in huggingface_hub's order: a tensor over the limit gets a shard of its own at once;
    otherwise a shard is closed when the next tensor would push it over the limit."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, t in tensors.items():
        n = _nbytes(t)
        if n > max_bytes:
            shards.append([name])
            continue
        if size + n > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        shards.append(current)
    return shards


def split_part(part: Any, max_bytes: int | None) -> tuple[list[Any], dict[str, str]]:
    """Split a :class:`~fastckpt._io.files.FilePart` named ``{base}.safetensors`` into shards.

    Metadata entries whose value names a tensor of the part (tied-weight aliases ``{dropped: kept}``) go to the
    shard holding that tensor; every other entry (``format``, optimizer ``param_groups``...) goes to every shard,
    so each shard reads on its own.

    Args:
        part: the FilePart; ``max_bytes`` None (or a part that fits) leaves it whole.
        max_bytes: the shard size limit in bytes (from :func:`fastckpt._io.sizes.parse_size`).

    Returns:
        ``(parts, texts)``: the parts to write and ``{index file name: JSON}`` (empty when not sharded).

    Raises:
        ValueError: the index would be over ``_core.MAX_INDEX_BYTES`` (its reader's limit).
    """
    if max_bytes is None or not part.name.endswith(".safetensors"):
        return [part], {}
    groups = _assign(part.tensors, max_bytes)
    if len(groups) <= 1:
        return [part], {}
    base = part.name.removesuffix(".safetensors")
    n = len(groups)
    owner = {name: shard_name(base, k + 1, n) for k, names in enumerate(groups) for name in names}
    metadata = part.metadata
    parts = []
    for k, names in enumerate(groups):
        file = shard_name(base, k + 1, n)
        meta = None if metadata is None else [(key, v) for key, v in metadata if owner.get(v, file) == file]
        parts.append(type(part)(file, {name: part.tensors[name] for name in names}, meta))
    index = {
        "metadata": {"total_size": sum(_nbytes(t) for t in part.tensors.values())},
        "weight_map": owner,
    }
    text = json.dumps(index, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    size = len(text.encode("utf-8"))
    if size > _core.MAX_INDEX_BYTES:  # refused now, before anything is written: the reader would refuse it
        raise ValueError(f"{index_name(base)}: the shard index would be {size} bytes ({len(owner)} tensors in {n} "
                         f"shards), over the limit of {_core.MAX_INDEX_BYTES} bytes its reader accepts; nothing was "
                         "written. Save fewer, larger tensors or a larger max_shard_size")
    return parts, {index_name(base): text}


def _check_shard_name(name: Any, index: Path) -> str:
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\x00" in name or not name.endswith(".safetensors")):
        raise HeaderError(
            f"{index}: shard name {name!r} is not a plain .safetensors file name inside the checkpoint folder"
        )
    return name


def read_index(index: Path) -> dict[str, str]:
    """The validated ``weight_map`` of an index file: ``{tensor_name: shard_file_name}``.

    Raises:
        HeaderError: not JSON, no ``weight_map`` object, a shard name that is not a plain ``.safetensors`` file name.
    """
    if index.stat().st_size > _core.MAX_INDEX_BYTES:
        raise HeaderError(f"{index}: {index.stat().st_size} bytes, over the {_core.MAX_INDEX_BYTES}-byte index limit")
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HeaderError(f"{index}: not valid JSON: {exc}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise HeaderError(f"{index}: no 'weight_map' object; not a Hugging Face shard index")
    return {str(k): _check_shard_name(v, index) for k, v in weight_map.items()}


def _open_shards(folder: Path, index: Path) -> list[Any]:
    weight_map = read_index(index)
    shards = list(dict.fromkeys(weight_map.values()))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise MissingStateError(
            f"{index}: {len(missing)} of {len(shards)} shard(s) listed in the index are not in {folder}: "
            f"{missing}. Nothing was loaded."
        )
    files = [open_safetensors(folder / s) for s in shards]
    seen: dict[str, str] = {}
    for shard, file in zip(shards, files):
        for name, *_ in file.tensors():
            if name in seen:
                raise IntegrityError(f"{index}: tensor {name!r} is in both {seen[name]} and {shard}")
            seen[name] = shard
    misplaced = {n: (s, seen.get(n)) for n, s in weight_map.items() if seen.get(n) != s}
    if misplaced:
        detail = ", ".join(f"{n!r}: index says {s}, found in {f or 'no shard'}" for n, (s, f) in
                           list(misplaced.items())[:10])
        raise IntegrityError(f"{index}: {len(misplaced)} tensor(s) are not where the index says ({detail})")
    unlisted = sorted(set(seen) - set(weight_map))
    if unlisted:
        raise IntegrityError(f"{index}: the shards hold {len(unlisted)} tensor(s) the index does not list: "
                             f"{unlisted[:10]}")
    return files


def has_state_file(folder: Path, base: str) -> bool:
    """Whether ``folder`` holds ``{base}.safetensors`` or its shard index."""
    return (folder / f"{base}.safetensors").is_file() or (folder / index_name(base)).is_file()


def open_state_files(folder: Path, base: str, what: str) -> list[Any]:
    """Open ``{base}.safetensors``, or every shard its index lists (validated as the module docs say).

    Returns:
        Opened ``fastckpt._core.SafetensorsFile`` objects (one, or one per shard in index order).

    Raises:
        MissingStateError: neither file exists (names ``what`` needs it), or shards are missing (lists them all).
        HeaderError / IntegrityError: a malformed index, or shards that disagree with it.
    """
    single = folder / f"{base}.safetensors"
    if single.is_file():
        return [open_safetensors(single)]
    index = folder / index_name(base)
    if index.is_file():
        return _open_shards(folder, index)
    raise MissingStateError(
        f"{folder}: {what} needs {single.name} (or {index.name}), which the checkpoint does not hold"
    )


class ShardedFile:
    """Several shards read as one file: the subset of ``fastckpt._core.SafetensorsFile`` the optimizer reader uses.

    ``metadata()`` merges every shard's metadata; ``tensors()`` lists every shard's tensors; ``read_into`` sends
    each target to the shard holding its tensor.
    """

    def __init__(self, files: list[Any]) -> None:
        self.files = files
        self.path = files[0].path if len(files) == 1 else f"{Path(files[0].path).parent}/[{len(files)} shards]"
        self._owner = {entry[0]: f for f in files for entry in f.tensors()}

    def metadata(self) -> dict[str, str] | None:
        merged: dict[str, str] | None = None
        for f in self.files:
            meta = f.metadata()
            if meta is not None:
                merged = {**(merged or {}), **meta}
        return merged

    def tensors(self) -> list[tuple[str, str, list[int], int, int]]:
        return [entry for f in self.files for entry in f.tensors()]

    def read_into(self, targets: list[tuple[str, Any]], *, threads: int = 0) -> None:
        for file, items in self._split(targets).values():
            file.read_into(items, threads=threads)

    def read_fresh(self, targets: list[tuple[str, Any]], *, threads: int = 0) -> None:
        """:func:`fastckpt._io.storage.local.folder.read_fresh` of each shard's targets."""
        for file, items in self._split(targets).values():
            read_fresh(file, items, threads=threads)

    def _split(self, targets: list[tuple[str, Any]]) -> dict[int, tuple[Any, list]]:
        by_file: dict[int, tuple[Any, list]] = {}
        for name, buf in targets:
            file = self._owner.get(name)
            if file is None:
                raise KeyMismatchError(f"{self.path}: no tensor {name!r}")
            by_file.setdefault(id(file), (file, []))[1].append((name, buf))
        return by_file


def open_state_file(folder: Path, base: str, what: str) -> Any:
    """:func:`open_state_files` as one file object (a SafetensorsFile, or a :class:`ShardedFile` over shards)."""
    files = open_state_files(folder, base, what)
    return files[0] if len(files) == 1 else ShardedFile(files)

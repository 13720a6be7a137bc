"""``share_unchanged``: frozen tensors in shard files of their own, linked from the previous checkpoint when
unchanged (the mechanics and the safety argument are in :mod:`fastckpt._io.storage.local.sharing`).

:func:`plan_sharing` rewrites each model part of a plan: its frozen tensors (state_dict entries that are not
parameters with ``requires_grad``) are split into ``{base}-0000k-of-0000N.safetensors`` shards of at most
``max_shard_size`` bytes in state_dict order, the trainable ones go to the last shard, and
``{base}.safetensors.index.json`` maps every tensor to its shard (Hugging Face's layout, so ``from_pretrained``
and every fastckpt load read it as any sharded model). When a previous checkpoint exists, the content hashes of
the frozen tensors are taken (remembered ones are not recomputed, :mod:`fastckpt._io.tensor_hashes`) and every
frozen shard that equals a file of the previous checkpoint is linked instead of written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from fastckpt._format.json_input import load_json
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.sizes import parse_size
from fastckpt._io.storage.local.backend import LocalStagedSave, LocalStorage
from fastckpt._io.storage.local.layout import MANIFEST
from fastckpt._io.storage.local.shards import index_name, shard_name, split_part
from fastckpt._io.storage.local.sharing import share_with
from fastckpt._io.tensor_hashes import content_hashes, remember
from fastckpt._state.trainable import trainable_names

__all__ = ["DEFAULT_FROZEN_SHARD", "previous_checkpoint", "plan_sharing", "split_shared"]

#: Frozen shard size limit when ``max_shard_size`` is None: 2 GB (fewer files; a changed frozen tensor rewrites
#: at most its shard).
DEFAULT_FROZEN_SHARD = 2 * 10**9


def previous_checkpoint(project_dir: Path, target: Path) -> Path | None:
    """The checkpoint a save to ``target`` shares with
    (:meth:`~fastckpt._io.storage.local.backend.LocalStorage.previous` of the project), or None."""
    found = LocalStorage(None, project_dir).previous(LocalStagedSave(target, None))
    return None if found is None else Path(found.location)


def _groups(names: list[str], tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    groups: list[list[str]] = []
    size = 0
    for name in names:
        n = tensors[name].numel() * tensors[name].element_size()
        if not groups or (size + n > limit and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def plan_sharing(plan: SavePlan, models: list[torch.nn.Module], previous: Path | None, *,
                 max_shard_size: int | str | None, threads: int = 0) -> Callable[[Path], None]:
    """Split the model parts of ``plan`` into frozen and trainable shards and link the unchanged frozen ones
    (:func:`split_shared`, then its ``link(previous)``).

    Args:
        plan: a plan built without ``max_shard_size`` (its model parts are whole ``model*.safetensors``).
        models: the live models (which parameters train, and the objects whose hashes are remembered).
        previous: the checkpoint to share with (:func:`previous_checkpoint`), or None for a first save.
        max_shard_size: shard size limit (bytes or ``"2GB"``) for frozen shards and optimizer files; None: 2 GB for
            frozen shards, optimizer files unsharded.

    Returns:
        ``after_commit(folder)``: remembers the content hashes the writer computed for the frozen tensors, so the
        next save of unchanged tensors hashes nothing.
    """
    link, after_commit = split_shared(plan, models, max_shard_size=max_shard_size, threads=threads)
    link(previous)
    return after_commit


def split_shared(plan: SavePlan, models: list[torch.nn.Module], *, max_shard_size: int | str | None,
                 threads: int = 0) -> tuple[Callable[[Path | None], None], Callable[[Path], None]]:
    """Split the model parts of ``plan`` into frozen and trainable shards (as :func:`plan_sharing`); returns
    ``(link, after_commit)``: ``link(previous)`` hashes the frozen shards and marks those equal to a file of the
    ``previous`` checkpoint (None: a first save, nothing hashed) to be linked; ``after_commit(folder)`` remembers
    the hashes the writer computed."""
    limit = DEFAULT_FROZEN_SHARD if max_shard_size is None else parse_size(max_shard_size)
    owners: dict[str, dict[str, Any]] = {}  # shard -> {tensor name: live object}
    parts: list[FilePart] = []
    frozen_files: list[str] = []
    for part in plan.parts:
        base = part.name.removesuffix(".safetensors")
        index = int(base.split("_")[1]) if base.startswith("model_") else 0
        if not part.name.startswith("model") or index >= len(models):
            if part.name.startswith("optimizer") and max_shard_size is not None:
                pieces, texts = split_part(part, limit)
                parts += pieces
                plan.texts.update(texts)
            else:
                parts.append(part)
            continue
        module = models[index]
        train = trainable_names(module)
        live = module.state_dict(keep_vars=True)
        frozen = [n for n in part.tensors if n not in train]
        if not frozen:
            parts.append(part)
            continue
        groups = _groups(frozen, part.tensors, limit)
        trainable = [n for n in part.tensors if n in train]
        if trainable:
            groups.append(trainable)
        n = len(groups)
        aliases = [(k, v) for k, v in (part.metadata or []) if v in part.tensors]
        others = [(k, v) for k, v in (part.metadata or []) if v not in part.tensors]
        owner = {name: shard_name(base, k + 1, n) for k, names in enumerate(groups) for name in names}
        for k, names in enumerate(groups):
            name = shard_name(base, k + 1, n)
            meta = others + [(a, v) for a, v in aliases if owner[v] == name]
            parts.append(FilePart(name, {t: part.tensors[t] for t in names}, meta, part.dtype))
            if k < n - (1 if trainable else 0):
                frozen_files.append(name)
                objs = {t: live[t] if t in live and live[t].data_ptr() == part.tensors[t].data_ptr() else
                        part.tensors[t] for t in names}
                owners[name] = objs
        index_doc = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in part.tensors.values())},
                     "weight_map": owner}
        plan.texts[index_name(base)] = json.dumps(index_doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    plan.parts = parts
    plan.counts["frozen_files"] = frozen_files
    dtypes = {p.name: p.dtype for p in plan.parts}

    def link(previous: Path | None) -> None:
        candidates = {} if previous is None else {
            name: content_hashes(objs, convert_to=dtypes[name], threads=threads) for name, objs in owners.items()}
        share_with(plan, previous, candidates)

    def after_commit(folder: Path) -> None:
        try:
            files = load_json((folder / MANIFEST).read_text(encoding="utf-8"), f"{folder / MANIFEST}", object)["files"]
        except (OSError, ValueError, KeyError):
            return
        for name, objs in owners.items():
            hashes = files.get(name, {}).get("xxh3", {}) if name in dtypes else {}
            for tensor, obj in objs.items():
                if tensor in hashes:
                    remember(obj, dtypes[name], hashes[tensor])

    return link, after_commit

"""Phase 1 of loading full (unsharded) model / optimizer files into sharded (FSDP2 / DTensor) objects: every
rank reads the full tensors and checks names, global shapes and dtypes; nothing live changes. Phase 2 is
``set_model_state_dict`` / ``set_optimizer_state_dict`` with ``full_state_dict=True`` (each rank keeps its shard):
FSDP2 ``FULL_STATE_DICT`` loads under ``fastckpt.accelerate``, and :func:`fastckpt.load_state` of a model-only
folder (one process's, or an FSDP2 model-only save's) into sharded models.
"""

from __future__ import annotations

from pathlib import Path

from fastckpt.errors import MissingStateError

__all__ = ["plan_full"]


def plan_full(folder: Path, models: list, optimizers: list, *, model_only: bool, strict: bool,
               layout: str) -> list:
    """FSDP2 FULL_STATE_DICT load, phase 1: every model's and optimizer's full state, checked (nothing changes)."""
    from fastckpt._io.storage.local.layout import part_name, read_manifest
    from fastckpt._io.storage.local.shards import open_state_file, open_state_files
    from fastckpt._state.sharded import owner_model
    from fastckpt._state.sharded_full import read_full_model, read_full_optimizer

    if layout != "fastckpt":
        raise MissingStateError(f"{folder}: FSDP2 FULL_STATE_DICT loads fastckpt's layout; convert accelerate's "
                                "files first (fastckpt convert)")
    manifest = read_manifest(folder, model_files_only=model_only)
    if not model_only and optimizers and manifest.get("mode") == "model_only":
        raise MissingStateError(f"{folder}: saved with model_only=True, so it holds no optimizer.safetensors; load "
                                "it with model_only=True. Nothing was changed.")
    out: list = []
    for i, m in enumerate(models):
        base = part_name("model", i, "")
        state, missing, unexpected = read_full_model(open_state_files(folder, base, f"model {i}"), m, strict=strict,
                                                     where=f"{folder} ({base})")
        out.append(("model", m, state, missing, unexpected))
    for j, opt in enumerate([] if model_only else optimizers):
        base = part_name("optimizer", j, "")
        owner = owner_model(opt, models, base)
        osd = read_full_optimizer(open_state_file(folder, base, f"optimizer {j}"), owner, opt, strict=strict,
                                  where=f"{folder / (base + '.safetensors')}")
        out.append(("optimizer", owner, opt, osd))
    return out

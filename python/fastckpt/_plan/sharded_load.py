"""Loading a sharded checkpoint (written by :mod:`fastckpt._plan.sharded_save`) on any number of processes, into
FSDP2 / DTensor models or plain ones (one process, no process group needed).

Phase 1 (:func:`plan_sharded_load`, every rank): read the manifest and the small files, check every name, shape
and dtype against the DCP metadata, build empty destination tensors shaped like the live ones (DTensors keep their
placements, so DCP reshards from whatever world size saved them), every rank agrees (one round), and DCP fills them. A
failure on any rank raises on every rank and nothing live has changed (the optimizer is not even initialised).

Phase 2 (:meth:`ShardedLoad.apply`): ``set_model_state_dict`` and ``set_optimizer_state_dict``, called separately
(the combined ``set_state_dict(..., broadcast_from_rank0=True)`` hangs in this torch), then schedulers and RNG.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from fastckpt import _core
from fastckpt._format.json_input import decode_json
from fastckpt._io.group.distributed import Session
from fastckpt._io.storage.local.file_size import recorded_size_problem
from fastckpt._io.storage.local.folder import read_checked_json, verify_file
from fastckpt._io.storage.local.layout import MANIFEST, part_name, random_states_name, read_manifest, unlisted_files
from fastckpt._state.optimizer import param_fqns
from fastckpt._state.optimizer_checks import dropped_state_lines
from fastckpt._state.rng import RngRestoreWarning, RngState, read_rng_state
from fastckpt._state.sharded import model_destination, optimizer_destination, owner_model
from fastckpt.errors import MissingStateError

__all__ = ["is_sharded_checkpoint", "plan_sharded_load", "assemble_load", "ShardedLoad", "ReaderFactory"]

#: ``reader_factory(folder, checksums, verify=, threads=)`` -> a DCP ``StorageReader`` over one part folder
#: (``model/``, ``optimizer/``, ...); ``checksums``: that part's files as the manifest records them
ReaderFactory = Callable[..., Any]


def is_sharded_checkpoint(folder: Path, manifest: dict[str, Any] | None = None) -> bool:
    """Whether ``folder``'s manifest (``manifest``: as already read, else read here) says its tensors are a DCP
    checkpoint (a sharded save)."""
    try:
        return isinstance(read_manifest(folder, check_sizes=False, parsed=manifest).get("sharded"), dict)
    except (MissingStateError, ValueError):
        return False


@dataclass
class ShardedLoad:
    """A validated sharded load: the filled tensors and what goes where; apply it with :meth:`apply`."""

    models: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = field(default_factory=list)
    optimizers: list[tuple[torch.nn.Module, Any, dict[str, Any]]] = field(default_factory=list)
    schedulers: list[tuple[Any, dict]] = field(default_factory=list)
    rng: RngState | None = None
    step: int | None = None
    strict: bool = True
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    objects: list[tuple[Any, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # saved state not applied (strict=False), with the reason

    def apply(self) -> None:
        """Phase 2: change the live objects."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        for model, state in self.models:
            set_model_state_dict(model, state, options=StateDictOptions(strict=self.strict))
        for model, opt, state in self.optimizers:
            with saved_state_applies_to_frozen(model, opt, state):
                set_optimizer_state_dict(model, opt, state)
        for sched, state in self.schedulers:
            sched.load_state_dict(state)
        for obj, state in self.objects:
            obj.load_state_dict(state)
        if self.rng is not None:
            self.rng.restore()


@contextmanager
def saved_state_applies_to_frozen(model: torch.nn.Module, optimizer: Any, state: dict[str, Any]) -> Iterator[None]:
    """Around ``set_optimizer_state_dict``: parameters of ``optimizer`` with ``requires_grad=False`` whose state
    was saved count as trainable, so their moments are applied as the one-process path (torch's
    ``Optimizer.load_state_dict``) applies them. DCP's ``_split_optim_state_dict`` drops the state of a parameter
    that does not require grad (pytorch#192202: trained, then frozen before the resume, its moments were lost)."""
    fqns = param_fqns([model])
    saved = state.get("state", {})
    frozen = [p for g in optimizer.param_groups for p in g["params"]
              if not p.requires_grad and fqns.get(id(p)) in saved and saved[fqns[id(p)]]]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def _dcp_load(dest: dict[str, torch.Tensor], reader: Any, session: Session) -> None:
    import torch.distributed.checkpoint as dcp

    from fastckpt._plan.sharded_save import run_dcp

    planner = reader.load_planner() if hasattr(reader, "load_planner") else None  # plans with the chunk index
    run_dcp(dcp.load, dest, session, storage_reader=reader, planner=planner)


def plan_sharded_load(folder: Path, models: list, optimizers: list, schedulers: list, *, model_only: bool,
                      strict: bool, session: Session, reader_factory: ReaderFactory,
                      rng_rank: int | None, extra: Callable[[ShardedLoad], None] | None = None,
                      failed: BaseException | None = None, verify: bool = True,
                      threads: int = 0, listed: bool = False) -> ShardedLoad:
    """Phase 1 on this rank (see the module docs): validate and read; nothing live changes.

    ``verify``: every byte read (the shards' chunks this rank reads, the RNG file, the JSON files) is checked
    against the crc32c the manifest records, before DCP fills a tensor (IntegrityError naming file and tensor).
    ``listed``: ``folder`` holds the small files and each part's ``dcp_metadata.json`` of an ``s3://`` checkpoint
    whose listing was checked against its manifest (sizes included); the part readers fetch the shards they read.

    ``extra(load)``: reads and validates more state into ``load.objects`` (``fastckpt.accelerate``'s tracked
    objects), before any rank reads the shards. ``failed``: this rank's error from the caller's own checks
    (reported to every rank at the same step as the validation: one round, not two).

    Raises:
        MissingStateError: a part asked for is absent (a full load of a model-only checkpoint names them).
        KeyMismatchError, ShapeMismatchError, DtypeError, HeaderError, IntegrityError: see
            :func:`fastckpt.load_state`.
    """
    error: BaseException | None = failed
    try:
        if failed is not None:
            raise failed
        found = _validate(folder, models, optimizers, schedulers, model_only=model_only, strict=strict,
                          reader_factory=reader_factory, rng_rank=rng_rank, verify=verify, threads=threads,
                          listed=listed)
        if extra is not None and not model_only:
            extra(found[0])
    except Exception as exc:  # every rank learns of it before DCP's collectives start
        error = exc
    session.agree(error, step="validate")
    load, dest, readers, served, saved_optimizers = found
    for sub, state in dest.items():  # a failure on any rank raises on every rank (DCP's rounds): nothing applied
        _dcp_load(state, readers[sub], session)
    return assemble_load(load, dest, models, served, saved_optimizers)


def _check_count(folder: Path, manifest: dict, kind: str, objs: list) -> None:
    if len(objs) > int(manifest.get(kind, 0)):
        raise MissingStateError(f"{folder}: {len(objs)} {kind} passed but the checkpoint holds "
                                f"{manifest.get(kind, 0)}. Nothing was changed.")


def _validate(folder: Path, models: list, optimizers: list, schedulers: list, *, model_only: bool, strict: bool,
              reader_factory: ReaderFactory, rng_rank: int | None, verify: bool, threads: int,
              listed: bool = False) -> tuple:
    manifest = read_manifest(folder, check_sizes=not listed)
    records = manifest.get("files", {}) if verify else {}
    if model_only:
        optimizers, schedulers = [], []
    _check_count(folder, manifest, "models", models)
    sharded = manifest["sharded"]
    _check_part_files(folder, sharded, stat=not listed)
    aliases = sharded.get("aliases", [])
    load = ShardedLoad(strict=strict)
    dest: dict[str, dict[str, torch.Tensor]] = {}
    readers: dict[str, Any] = {}
    served: list[dict[str, str]] = []

    unlisted = unlisted_files(folder, manifest)

    def part(sub: str) -> dict[str, Any]:
        if not (folder / sub).is_dir():
            raise MissingStateError(f"{folder}: the load needs the sharded part {sub}/, which is absent")
        _refuse_unlisted(folder, [n for n in unlisted if n.startswith(sub + "/")])
        checksums = {n[len(sub) + 1:]: info for n, info in sharded.get("files", {}).items() if n.startswith(sub + "/")}
        readers[sub] = reader_factory(folder / sub, checksums, verify=verify, threads=threads)
        return readers[sub].read_metadata().state_dict_metadata

    for i, m in enumerate(models):
        sub = part_name("model", i, "")
        d, s, missing, unexpected = model_destination(m, "", part(sub), aliases[i] if i < len(aliases) else {},
                                                      strict=strict, where=f"{folder / sub}")
        dest[sub] = d
        served.append(s)
        label = f"model_{i}." if len(models) > 1 else ""
        load.missing_keys += [label + k for k in missing]
        load.unexpected_keys += [label + k for k in unexpected]
    # the model's keys first: counts of optimizers / schedulers of another model's checkpoint would hide them
    if manifest.get("mode") == "model_only" and (optimizers or schedulers):
        wanted = [part_name("optimizer", j, ".json") for j in range(len(optimizers))]
        wanted += [part_name("scheduler", k, ".json") for k in range(len(schedulers))]
        raise MissingStateError(f"{folder}: saved with model_only=True, so it holds no {', '.join(wanted)}; load it "
                                "with model_only=True, or pass no optimizer/scheduler. Nothing was changed.")
    _check_count(folder, manifest, "optimizers", optimizers)
    saved_optimizers = []
    needed = [part_name("optimizer", j, ".json") for j in range(len(optimizers))]
    needed += [part_name("scheduler", k, ".json") for k in range(len(schedulers))]
    if not model_only and manifest.get("mode") == "full" and rng_rank is not None:
        needed.append(random_states_name(rng_rank))
    _refuse_unlisted(folder, [n for n in needed if n in unlisted])
    for j, opt in enumerate(optimizers):
        base = part_name("optimizer", j, "")
        saved = read_checked_json(folder, base + ".json", f"optimizer {j}", records.get(base + ".json"))
        owner = owner_model(opt, models, base)
        d, info = optimizer_destination(owner, opt, base, saved, part(base), strict=strict,
                                        where=f"{folder / (base + '.json')}")
        fqns = param_fqns([owner])
        optimized = {fqns.get(id(p)) for g in opt.param_groups for p in g["params"]}
        names = saved.get("state_names", {})
        load.skipped += dropped_state_lines([f for f in names if f not in optimized], names,
                                            saved.get("extra_state", {}), path=str(folder / (base + ".json")),
                                            label=base)
        dest[base] = d
        saved_optimizers.append((owner, opt, base, info))
    _check_count(folder, manifest, "schedulers", schedulers)
    for k, sched in enumerate(schedulers):
        name = part_name("scheduler", k, ".json")
        where = f"{folder / name}: not a valid fastckpt scheduler state"
        load.schedulers.append((sched, decode_json(read_checked_json(folder, name, f"scheduler {k}", records.get(name)), where)))
    if not model_only and manifest.get("mode") == "full" and rng_rank is not None:
        name = random_states_name(rng_rank)
        if (folder / name).is_file():
            rng_file = _core.SafetensorsFile(str(folder / name))
            verify_file(rng_file, records.get(name), threads=threads)
            load.rng = read_rng_state(rng_file)
            load.step = load.rng.step
        else:
            warnings.warn(f"{folder}: holds no {name} (saved by {manifest.get('processes')} processes); process "
                          f"{rng_rank} keeps its RNG states", RngRestoreWarning, stacklevel=5)
    return load, dest, readers, served, saved_optimizers


def assemble_load(load: ShardedLoad, dest: dict[str, dict[str, torch.Tensor]], models: list, served: list,
                  saved_optimizers: list) -> ShardedLoad:
    """The validated ``load`` completed with what :meth:`ShardedLoad.apply` sets: each model's state (its filled
    tensors, a live name served by a stored tie given the same tensor) and each optimizer's state and
    ``param_groups`` (only parameters the live optimizer holds).

    Args:
        load: the load so far (schedulers, RNG, objects). dest: ``{part: {name: filled tensor}}``, the model parts
            ``model`` / ``model_{i}`` and optimizer parts as :func:`~fastckpt._state.sharded.model_destination` and
            ``optimizer_destination`` made them. models: the live models, in order. served: per model,
            ``{live fqn: stored fqn}`` (``model_destination``'s ties). saved_optimizers: ``(owner model,
            optimizer, part, info)`` with ``optimizer_destination``'s info (``param_groups``, ``state_names``,
            ``extra_state``).

    Returns:
        ``load`` itself, its ``models`` and ``optimizers`` filled (nothing live changed).

    Example:
        >>> plan = assemble_load(load, dest, [model], [served], [(model, opt, "optimizer", info)])  # doctest: +SKIP
        >>> plan.apply()  # doctest: +SKIP
    """
    for i, m in enumerate(models):
        state = dict(dest[part_name("model", i, "")])
        for name, source in served[i].items():
            state[name] = state[source]
        load.models.append((m, state))
    for owner, opt, base, info in saved_optimizers:
        tensors = dest[base]
        state: dict[str, dict[str, Any]] = {}
        live_fqns = {f for g in info["param_groups"] for f in g["params"]}
        for fqn, names in info["state_names"].items():
            if fqn in live_fqns:
                state[fqn] = {n: tensors[f"state.{fqn}.{n}"] for n in names if f"state.{fqn}.{n}" in tensors}
        for fqn, extra in info["extra_state"].items():
            state.setdefault(fqn, {}).update(extra)
        load.optimizers.append((owner, opt, {"state": state, "param_groups": info["param_groups"]}))
    return load


def _refuse_unlisted(folder: Path, names: list[str]) -> None:
    """IntegrityError for files the load would read that the manifest does not list (a hand-edited manifest)."""
    if names:
        from fastckpt.errors import IntegrityError

        raise IntegrityError(f"{folder}: {', '.join(names)}: not in the manifest ({MANIFEST} lists no such file), so "
                             "nothing vouches for it; nothing was changed")


def _check_part_files(folder: Path, sharded: dict[str, Any], *, stat: bool = True) -> None:
    """Every shard file the manifest lists is there with its recorded size (IntegrityError / MissingStateError;
    ``stat=False``: the names only, the sizes were checked against an object store's listing)."""
    from fastckpt.errors import HeaderError, IntegrityError

    files = sharded.get("files", {})
    if not isinstance(files, dict):
        raise HeaderError(f"{folder}: the manifest's sharded 'files' must be an object")
    for name, info in files.items():
        parts = name.split("/")
        if len(parts) != 2 or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
            raise HeaderError(f"{folder}: sharded file name {name!r} points outside its part folder")
        path = folder / name
        if not stat:
            continue
        try:
            problem = recorded_size_problem(path, info.get("bytes") if isinstance(info, dict) else info, "the manifest")
        except FileNotFoundError:
            raise MissingStateError(f"{path}: listed in the manifest but missing") from None
        if problem is not None or not isinstance(info, dict):
            raise IntegrityError(problem or f"{path}: the manifest records {info!r}, not a size")

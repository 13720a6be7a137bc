"""A sharded save (FSDP2 / DTensor): every rank writes its shards through torch.distributed.checkpoint (DCP) into the
checkpoint's staging folder, the main process adds the small files, and the folder is committed once.

Every rank calls :func:`save_sharded` with the same arguments. The steps (each a :class:`~fastckpt._io.distributed.
Session` step, so a process that died or never called it makes the others raise within ``timeout``):

1. ``arrive``: every rank's arguments on the main process, which refuses a mismatch.
2. ``staging``: the main process removes dead saves' leftovers and makes a staging folder beside the target (owned
   through a ``flock``ed lock file, see :mod:`fastckpt._io.staging`); its path goes to every rank.
3. ``state``: every rank takes its sharded state (see :mod:`fastckpt._state.sharded`); a rank that cannot stops all.
4. DCP ``save`` of each part into its subfolder of the staging folder (``model/``, ``model_1/``, ``optimizer/``,
   ...; fastckpt.dcp's ``StorageWriter(commit=False)``: safetensors shards + ``dcp_metadata.json``), on a gloo
   group whose collectives time out (DCP's own planning: each replicated tensor is written once, each shard by its
   owner). Model parts hold the fqns as keys (``fastckpt consolidate`` reads ``model/``); optimizer parts hold
   ``state.{fqn}.{name}``.
5. ``written``: every rank's outcome and RNG states to the main process, which writes the scheduler and optimizer
   JSON, ``config.json``, one ``random_states_{rank}.safetensors`` per rank and the manifest (``"sharded"`` says
   how to read it), fsyncs the folder and commits it in one step (``_core.commit_dir``). A ``model_only`` save
   first turns each model's DCP shards into the files a one-process model-only save writes (``model.safetensors``,
   or Hugging Face shards + ``model.safetensors.index.json`` over ``max_shard_size``; byte-identical, assembled by
   positional copies in the Rust core as ``fastckpt consolidate`` does) and removes the DCP subfolder, so
   ``from_pretrained`` reads the folder and :func:`fastckpt.load_state` loads it on any number of processes.
6. ``commit``: the outcome, broadcast: no rank returns before the commit, every rank raises if it failed.

A failure or a death anywhere before the commit leaves the previous checkpoint at the target exact; the staging
folder is removed (by the main process, or by the next save when the main process died).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from fastckpt import _core
from fastckpt._format.codec import encode
from fastckpt._format.tensors import tensor_sources
from fastckpt._io.commit import check_target, fsync_dir, write_text
from fastckpt._io.distributed import Session, timeout_group
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.integrity import digest_entry, text_entry
from fastckpt._io.layout import MANIFEST, manifest_dict, part_name, random_states_name
from fastckpt._io.staging import OwnedPath, clean_leftovers
from fastckpt._io.torch_compat import no_dist_kwargs
from fastckpt._state.hf_files import hf_model_files
from fastckpt._state.rng import rng_payload
from fastckpt._state.sharded import model_tensors, optimizer_tensors, owner_model

__all__ = ["save_sharded", "SHARDED_STORAGE", "WriterFactory"]

#: the manifest's ``"sharded"`` entry: each part's tensors are a fastckpt.dcp folder inside the checkpoint
SHARDED_STORAGE = "fastckpt.dcp"
#: ``writer_factory(folder, durable, threads)`` -> a DCP ``StorageWriter`` that writes into ``folder`` without
#: committing it; after the save, its ``files`` (on the coordinator) are ``{name: manifest entry}``
WriterFactory = Callable[[Path, bool, int], Any]


def parts_of(folder: Path) -> set[str]:
    """The DCP part subfolders a sharded checkpoint's manifest names (never carried over as user files)."""
    try:
        sharded = json.loads((folder / MANIFEST).read_text()).get("sharded", {})
        return {str(p) for p in sharded.get("parts", [])}
    except (OSError, ValueError, AttributeError):
        return set()


def _carry_user_files(target: Path, staging: Path) -> None:
    """Hard-link into ``staging`` the files the user keeps in ``target``: those its manifest does not list."""
    try:
        listed = set(json.loads((target / MANIFEST).read_text())["files"]) | {MANIFEST}
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


def original_error(exc: BaseException) -> BaseException:
    """The exception a rank raised inside DCP (DCP wraps it in a ``CheckpointException``, a BaseException)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    wrapped = failures.get(rank, failures[min(failures)])
    return wrapped[0] if isinstance(wrapped, tuple) else wrapped


def run_dcp(call: Any, state: dict, session: Session, **storage: Any) -> None:
    """``dcp.save`` / ``dcp.load`` of ``state`` on every process (over a gloo group with the session's timeout),
    or in this process alone without a process group; a rank's own error is raised, not DCP's wrapper. DCP
    raises on every rank when any rank failed (its planning and its read / write rounds gather every rank's
    outcome), so no extra round is needed to agree: the others raise CheckpointError naming that process."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        if session.active:
            call(state, process_group=timeout_group(session.timeout), **storage)
        else:
            with warnings.catch_warnings():  # "assuming the intent is to save/load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                call(state, **no_dist_kwargs(call, True), **storage)
    except CheckpointException as exc:
        failures = getattr(exc, "failures", None) or {}
        rank = session.rank
        if failures and rank not in failures:  # DCP raises on every rank: name the one where it happened
            from fastckpt.errors import CheckpointError

            other = min(failures)
            cause = failures[other][0] if isinstance(failures[other], tuple) else failures[other]
            raise CheckpointError(f"{session.what} failed on process {other}: {type(cause).__name__}: {cause}; "
                                  "nothing was changed on any process") from exc
        raise original_error(exc) from exc


def _dcp_save(parts: dict[str, dict[str, torch.Tensor]], staging: Path, writer_factory: WriterFactory,
              durable: bool, threads: int, session: Session) -> dict[str, Any]:
    """DCP-save every part into ``staging/{part}``; returns the written files (coordinator) as ``part/name``."""
    import torch.distributed.checkpoint as dcp

    files: dict[str, Any] = {}
    for sub, state in parts.items():
        writer = writer_factory(staging / sub, durable, threads)
        planner = writer.save_planner(sub) if hasattr(writer, "save_planner") else None  # plans cached per part
        run_dcp(dcp.save, state, session, storage_writer=writer, planner=planner)
        files.update({f"{sub}/{name}": entry for name, entry in (getattr(writer, "files", None) or {}).items()})
    return files


def _small_files(models: list, optimizer_texts: list[str], schedulers: list, *, model_only: bool) -> dict[str, str]:
    texts: dict[str, str] = hf_model_files(models[0]) if models else {}  # config.json, generation_config.json
    if model_only:
        return texts
    for j, text in enumerate(optimizer_texts):
        texts[part_name("optimizer", j, ".json")] = text
    for k, sched in enumerate(schedulers):
        texts[part_name("scheduler", k, ".json")] = json.dumps(encode(sched.state_dict(),
                                                                      path=part_name("scheduler", k, "")))
    return texts


def _hf_model_files(staging: Path, parts: list[str], aliases: list[dict[str, str]], names: list[list[str]], *,
                    max_shard_size: int | None, durable: bool, threads: int) -> dict[str, dict[str, Any]]:
    """Main process, model-only saves: each model part's DCP shards in ``staging/{part}`` -> the files a one-process
    model-only save writes (``model.safetensors``, or Hugging Face shards + index), assembled by positional copies
    in the Rust core (``fastckpt consolidate``'s code); the DCP subfolders are removed. Returns their checksums."""
    from fastckpt._io.dcp_consolidate import write_model_files
    from fastckpt._io.dcp_files import read_dcp_metadata

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


def _commit(staging: Path, target: Path, plan: SavePlan, sharded: dict[str, Any] | None, *, durable: bool,
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


def save_sharded(
    models: list[torch.nn.Module],
    optimizers: list[Any],
    schedulers: list[Any],
    *,
    target: Path,
    model_only: bool,
    step: int,
    durable: bool,
    threads: int,
    timeout: float,
    writer_factory: WriterFactory,
    max_shard_size: int | None = None,
    add_files: Callable[[SavePlan], None] | None = None,
    what: str = "save_state",
) -> Path:
    """Save a sharded training state on every rank into ``target`` (see the module docs); returns ``target``.

    Args:
        max_shard_size: ``model_only`` saves: bytes per model file (None: one ``model.safetensors``).
        add_files: main process only, before the commit: adds parts / texts to the plan of small files
            (``fastckpt.accelerate`` adds the objects the Accelerator tracks).

    Raises:
        CollectiveTimeoutError: a process did not take part within ``timeout`` s (names it and the step).
        CheckpointError: another process failed (names it and its error); this process changed nothing.
        KeyMismatchError, TypeError, OSError: as :func:`fastckpt.save_state`, on the process where it happened.
    """
    target = check_target(target)
    session = Session(f"{what} to {target}", timeout)
    if model_only:
        optimizers, schedulers = [], []
    args = (str(target), model_only, len(models), len(optimizers), len(schedulers), session.timeout)
    arrived = session.gather(args, step="arrive")
    owner: OwnedPath | None = None
    error: BaseException | None = None
    try:
        if arrived is not None and any(a != args for a in arrived):
            bad = next(r for r, a in enumerate(arrived) if a != args)
            error = ValueError(f"process {bad} called {what} with other arguments than process 0 "
                               f"({arrived[bad]} vs {args}: folder, model_only, models, optimizers, schedulers, "
                               "timeout); every process must pass the same")
        elif session.rank == 0:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                clean_leftovers(target.parent)
                owner = OwnedPath(target.parent, target.name)
                owner.path.mkdir()
            except Exception as exc:
                error = exc
        staging_name = session.broadcast((owner.path.name if owner else None,
                                          None if error is None else f"{type(error).__name__}: {error}"),
                                         step="staging")
        if error is not None:
            raise error
        if staging_name[1] is not None:
            raise _other(session, staging_name[1])
        staging = target.parent / staging_name[0]

        parts: dict[str, dict[str, torch.Tensor]] = {}
        aliases: list[dict[str, str]] = []
        optimizer_texts: list[str] = []
        try:
            for i, m in enumerate(models):
                tensors, ties = model_tensors(m, "")
                parts[part_name("model", i, "")] = tensors
                aliases.append(ties)
            for j, opt in enumerate(optimizers):
                base = part_name("optimizer", j, "")
                tensors, text = optimizer_tensors(owner_model(opt, models, base), opt, base)
                parts[base] = tensors
                optimizer_texts.append(text)
            texts = _small_files(models, optimizer_texts, schedulers, model_only=model_only) if session.rank == 0 else {}
        except Exception as exc:
            error = exc
        session.agree(error, step="state")

        dcp_files: dict[str, Any] = {}
        try:
            with session.working():
                dcp_files = _dcp_save(parts, staging, writer_factory, durable, threads, session)
        except Exception as exc:
            error = exc
        rng = None
        if not model_only:
            tensors, metadata = rng_payload(step)
            rng = ({k: v.cpu().numpy() for k, v in tensors.items()}, metadata)
        reports = session.gather((rng, None if error is None else f"{type(error).__name__}: {error}"),
                                 step="written")
        outcome: str | None = None
        if reports is not None:
            failed = next(((r, e) for r, (_, e) in enumerate(reports) if e is not None), None)
            if failed is not None:
                outcome = f"writing the shards failed on process {failed[0]}: {failed[1]}"
            else:
                try:
                    with session.working():
                        plan = SavePlan(mode="model_only" if model_only else "full", step=step, counts={
                            "models": len(models), "optimizers": len(optimizers), "schedulers": len(schedulers)})
                        plan.texts.update(texts)
                        if not model_only:
                            for r, ((arrays, metadata), _) in enumerate(reports):
                                plan.parts.append(FilePart(random_states_name(r),
                                                           {k: torch.from_numpy(a) for k, a in arrays.items()},
                                                           list(metadata.items())))
                            plan.counts["processes"] = len(reports)
                        if add_files is not None:
                            add_files(plan)
                        if model_only:  # what a one-process model-only save writes: from_pretrained reads it
                            sums = _hf_model_files(staging, list(parts), aliases, [list(t) for t in parts.values()],
                                                   max_shard_size=max_shard_size, durable=durable, threads=threads)
                            _commit(staging, target, plan, None, durable=durable, threads=threads, checksums=sums)
                        else:
                            sharded = {"storage": SHARDED_STORAGE, "world_size": session.world,
                                       "aliases": aliases, "parts": list(parts), "files": dcp_files}
                            _commit(staging, target, plan, sharded, durable=durable, threads=threads)
                except Exception as exc:
                    error = exc
                    outcome = f"{type(exc).__name__}: {exc}"
        result = session.broadcast(outcome, step="commit")
        if error is not None:
            raise error
        if result is not None:
            raise _other(session, result)
        return target
    except BaseException as exc:
        session.abandon(f"process {session.rank} failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        if owner is not None:
            owner.release()  # after the commit nothing is left there; otherwise the partial folder goes


def _other(session: Session, message: str) -> Exception:
    from fastckpt.errors import CheckpointError

    return CheckpointError(f"{session.what} failed: {message}; the previous checkpoint is untouched")

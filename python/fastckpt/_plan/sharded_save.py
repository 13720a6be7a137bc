"""A sharded save (FSDP2 / DTensor): every rank writes its shards through torch.distributed.checkpoint (DCP) into the
checkpoint's staging folder, the main process adds the small files, and the folder is committed once.

Every rank calls :func:`save_sharded` with the same arguments. The steps (each a :class:`~fastckpt._io.group.distributed.
Session` step, so a process that died or never called it makes the others raise within ``timeout``):

1. ``arrive``: every rank's arguments on the main process, which refuses a mismatch.
2. ``staging``: the main process opens the save (locally: removes dead saves' leftovers and makes a staging folder
   beside the target, owned through a ``flock``ed lock file, see :mod:`fastckpt._io.storage.local.parts`); its
   token goes to every rank.
3. ``state``: every rank takes its sharded state (see :mod:`fastckpt._state.sharded`); a rank that cannot stops all.
4. DCP ``save`` of each part into its subfolder of the staging folder (``model/``, ``model_1/``, ``optimizer/``,
   ...; fastckpt.dcp's ``StorageWriter(commit=False)``: safetensors shards, ``dcp_index.bin``,
   ``dcp_metadata.json``), on a gloo group whose collectives time out (DCP's own planning: each replicated tensor
   is written once, each shard by its owner). Each rank plans its parts locally before step 3's round and reports
   there whether each plan is the cached one of the previous save; a part unchanged on every rank is written
   without DCP's planning round (:mod:`fastckpt._plan.dcp_resave`). Model parts hold the fqns as keys (``fastckpt consolidate`` reads ``model/``); optimizer parts hold
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

The save is a :class:`~fastckpt._io.storage.base.SharedSave` of the storage the caller resolved: at ``staging``
the main process opens it (``begin_shared``: a local staging folder, or for ``s3://`` the checkpoint URL, picked
by automatic naming when asked, and the new save's ``(number, save id)``), the others join it from its token;
each part goes where ``save.part`` says (a subfolder of the staging folder, or the prefix
``{url}/{save id}/{part}/`` every rank uploads its objects under, straight from tensor memory); at ``written`` the
main process hands the small files to ``save.commit`` (the manifest last, the same manifest either way). A failure
before it: nothing committed, the staged save dropped (best effort for object storage), every rank raises. Where
the processes share no folder (``save.folder`` is None: object storage), a ``model_only`` save gathers each model's
full state dict to the main process instead of DCP (see :mod:`fastckpt._plan.sharded_commit`) and commits what a
one-process model-only save writes.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from fastckpt._format.codec import encode
from fastckpt._io.files import FilePart, SavePlan
from fastckpt._io.group.distributed import Session, timeout_group
from fastckpt._io.group.torch_compat import no_dist_kwargs
from fastckpt._io.storage.base import Committed
from fastckpt._io.storage.local.layout import part_name, random_states_name
from fastckpt._plan.dcp_resave import plan_locally, write_cached
from fastckpt._plan.save import build_save_plan
from fastckpt._plan.sharded_commit import assemble_model_files, full_model_states
from fastckpt._state.hf_files import hf_model_files
from fastckpt._state.rng import rng_payload
from fastckpt._state.sharded import model_tensors, optimizer_tensors, owner_model

__all__ = ["save_sharded", "SHARDED_STORAGE", "WriterFactory"]

#: the manifest's ``"sharded"`` entry: each part's tensors are a fastckpt.dcp folder inside the checkpoint
SHARDED_STORAGE = "fastckpt.dcp"
#: ``writer_factory(folder, durable, threads, storage_options=)`` -> a DCP ``StorageWriter`` that writes into
#: ``folder`` (a local folder, or the ``s3://`` prefix of a part inside a save) without committing it; after the
#: save, its ``files`` (on the coordinator) are ``{name: manifest entry}``
WriterFactory = Callable[[Path | str, bool, int], Any]


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
            group = timeout_group(session.timeout)
            reader = storage.get("storage_reader")
            if reader is not None and getattr(reader, "process_group", False) is None:
                reader.process_group = group  # boxes read once and shared travel over the same group
            call(state, process_group=group, **storage)
        else:
            with warnings.catch_warnings():  # "assuming the intent is to save/load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                call(state, **no_dist_kwargs(call, True), **storage)
    except CheckpointException as exc:
        failures = getattr(exc, "failures", None) or {}
        rank = session.rank
        own = failures.get(rank)
        peer = getattr(own[0] if isinstance(own, tuple) else own, "shared_read_peer", None)
        if failures and (rank not in failures or peer in failures):  # DCP raises on every rank: name the one
            from fastckpt.errors import CheckpointError  # where it happened (or the one reading for this rank)

            other = peer if peer in failures else min(failures)
            cause = failures[other][0] if isinstance(failures[other], tuple) else failures[other]
            raise CheckpointError(f"{session.what} failed on process {other}: {type(cause).__name__}: {cause}; "
                                  "nothing was changed on any process") from exc
        raise original_error(exc) from exc


def _part_writers(parts: dict[str, dict[str, torch.Tensor]], where: Callable[[str], Path | str],
                  writer_factory: WriterFactory, durable: bool, threads: int,
                  options: Any = None) -> dict[str, tuple[Any, Any]]:
    """``{part: (DCP storage writer, planner)}``: the writer into ``where(part)`` (``options``: the storage's
    settings it resolves that location with), its planner caching per part."""
    out = {}
    for sub in parts:
        writer = writer_factory(where(sub), durable, threads, storage_options=options)
        out[sub] = (writer, writer.save_planner(sub) if hasattr(writer, "save_planner") else None)
    return out


def _plan_parts(parts: dict[str, dict[str, torch.Tensor]], writers: dict[str, tuple[Any, Any]],
                session: Session) -> list[bool]:
    """Each part planned locally (several processes only): whether this rank's plan of it is the cached one."""
    if not session.active:
        return [False] * len(parts)
    return [plan_locally(state, *writers[sub], is_coordinator=session.rank == 0) for sub, state in parts.items()]


def _dcp_save(parts: dict[str, dict[str, torch.Tensor]], writers: dict[str, tuple[Any, Any]], unchanged: list[bool],
              session: Session) -> dict[str, Any]:
    """DCP-save every part with its writer (a part unchanged on every rank without a planning round, see
    :mod:`fastckpt._plan.dcp_resave`); returns the written files (coordinator) as ``part/name``."""
    import torch.distributed.checkpoint as dcp

    files: dict[str, Any] = {}
    for (sub, state), cached in zip(parts.items(), unchanged):
        writer, planner = writers[sub]
        run_dcp(write_cached if cached else dcp.save, state, session, storage_writer=writer, planner=planner)
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


def save_sharded(
    models: list[torch.nn.Module],
    optimizers: list[Any],
    schedulers: list[Any],
    *,
    storage: Any,
    name: str | None = None,
    model_only: bool,
    step: int,
    durable: bool,
    threads: int,
    timeout: float,
    writer_factory: WriterFactory,
    max_shard_size: int | None = None,
    add_files: Callable[[SavePlan], None] | None = None,
    what: str = "save_state",
) -> Committed:
    """Save a sharded training state on every rank into ``storage`` (see the module docs); returns the committed
    checkpoint (:attr:`~fastckpt._io.storage.base.Committed.named`: its folder, or its ``s3://`` URL).

    Args:
        storage: where (:func:`fastckpt._io.storage.resolve`): the main process opens the save there
            (``begin_shared``: the named checkpoint, ``name`` inside it, or its next ``checkpoint_{n}``), the
            others join it.
        max_shard_size: ``model_only`` saves: bytes per model file (None: one ``model.safetensors``).
        add_files: main process only, before the commit: adds parts / texts to the plan of small files
            (``fastckpt.accelerate`` adds the objects the Accelerator tracks).

    Raises:
        CollectiveTimeoutError: a process did not take part within ``timeout`` s (names it and the step).
        CheckpointError: another process failed (names it and its error); this process changed nothing.
        KeyMismatchError, TypeError, OSError: as :func:`fastckpt.save_state`, on the process where it happened.
        ConcurrentSaveError: (``s3://``) another save committed the same checkpoint first.
    """
    where_to = storage.location if name is None else f"{storage.location.rstrip('/')}/{name}"
    session = Session(f"{what} to {where_to}", timeout)
    if model_only:
        optimizers, schedulers = [], []
    args = (where_to, model_only, len(models), len(optimizers), len(schedulers), session.timeout)
    arrived = session.gather(args, step="arrive")
    save: Any = None  # the SharedSave: opened by the main process, joined by the others
    error: BaseException | None = None
    try:
        begun: Any = None
        if arrived is not None and any(a != args for a in arrived):
            bad = next(r for r, a in enumerate(arrived) if a != args)
            error = ValueError(f"process {bad} called {what} with other arguments than process 0 "
                               f"({arrived[bad]} vs {args}: folder, model_only, models, optimizers, schedulers, "
                               "timeout); every process must pass the same")
        elif session.rank == 0:
            try:  # a staging folder beside the target, or the URL and the save's (number, id): nothing written yet
                save = storage.begin_shared(name, model_only=model_only, step=step)
                begun = save.token
            except Exception as exc:
                error = exc
        token = session.broadcast((begun, None if error is None else f"{type(error).__name__}: {error}"),
                                  step="staging")
        if error is not None:
            raise error
        if token[1] is not None:
            raise _other(session, token[1])
        if save is None:
            save = storage.join_shared(token[0])
        session.what = f"{what} to {save.location}"
        gather_full = save.folder is None and model_only  # no shared folder to assemble on: gathered to rank 0

        parts: dict[str, dict[str, torch.Tensor]] = {}
        aliases: list[dict[str, str]] = []
        optimizer_texts: list[str] = []
        try:
            for i, m in enumerate(models):
                if gather_full:
                    continue
                tensors, ties = model_tensors(m, "")
                parts[part_name("model", i, "")] = tensors
                aliases.append(ties)
            for j, opt in enumerate(optimizers):
                base = part_name("optimizer", j, "")
                tensors, text = optimizer_tensors(owner_model(opt, models, base), opt, base)
                parts[base] = tensors
                optimizer_texts.append(text)
            texts = _small_files(models, optimizer_texts, schedulers, model_only=model_only) if session.rank == 0 else {}
            writers = _part_writers(parts, save.part, writer_factory, durable, threads, save.storage_options)
            votes = _plan_parts(parts, writers, session)  # DCP's local plans: each part's unchanged or not
        except Exception as exc:
            error = exc
            votes = [False] * len(parts)
        unchanged = session.agree(error, step="state", votes=votes)  # this round carries the votes: no extra one

        dcp_files: dict[str, Any] = {}
        full: list[dict[str, torch.Tensor]] = []
        try:
            with session.working():
                if gather_full:
                    full = full_model_states(models)
                else:
                    dcp_files = _dcp_save(parts, writers, unchanged or [False] * len(parts), session)
        except Exception as exc:
            error = exc
        rng = None
        if not model_only:
            tensors, metadata = rng_payload(step)
            rng = ({k: v.cpu().numpy() for k, v in tensors.items()}, metadata)
        reports = session.gather((rng, None if error is None else f"{type(error).__name__}: {error}"),
                                 step="written")
        outcome: Any = None
        if reports is not None:
            failed = next(((r, e) for r, (_, e) in enumerate(reports) if e is not None), None)
            if failed is not None:
                outcome = (None, f"writing the shards failed on process {failed[0]}: {failed[1]}")
            else:
                try:
                    with session.working():
                        sums = None
                        if gather_full:  # what a one-process model-only save uploads (from_pretrained reads it)
                            plan = build_save_plan(models, [], [], model_only=True, step=step, model_states=full,
                                                   max_shard_size=max_shard_size)
                        else:
                            plan = _small_plan(models, optimizers, schedulers, texts, reports, model_only=model_only,
                                               step=step)
                        if model_only and not gather_full:  # what a one-process model-only save writes
                            sums = assemble_model_files(save.folder, list(parts), aliases,
                                                        [list(t) for t in parts.values()],
                                                        max_shard_size=max_shard_size, durable=durable,
                                                        threads=threads)
                        if add_files is not None:
                            add_files(plan)
                        sharded = None if model_only else {
                            "storage": SHARDED_STORAGE, "world_size": session.world, "aliases": aliases,
                            "parts": list(parts), "files": dcp_files}
                        outcome = (save.commit(plan, sharded, durable=durable, threads=threads, checksums=sums),
                                   None)
                except Exception as exc:
                    error = exc
                    outcome = (None, f"{type(exc).__name__}: {exc}")
        result = session.broadcast(outcome, step="commit")
        if error is not None:
            raise error
        if result[1] is not None:
            raise _other(session, result[1])
        return result[0]
    except BaseException as exc:
        session.abandon(f"process {session.rank} failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        if save is not None:
            save.abort()  # after the commit nothing is left; otherwise the partial save goes (its opener's)


def _small_plan(models: list, optimizers: list, schedulers: list, texts: dict[str, str], reports: list, *,
                model_only: bool, step: int) -> SavePlan:
    """Main process: the plan of the small files (the JSON texts, one RNG file per process)."""
    plan = SavePlan(mode="model_only" if model_only else "full", step=step, counts={
        "models": len(models), "optimizers": len(optimizers), "schedulers": len(schedulers)})
    plan.texts.update(texts)
    if not model_only:
        for r, ((arrays, metadata), _) in enumerate(reports):
            plan.parts.append(FilePart(random_states_name(r), {k: torch.from_numpy(a) for k, a in arrays.items()},
                                       list(metadata.items())))
        plan.counts["processes"] = len(reports)
    return plan


def _other(session: Session, message: str) -> Exception:
    from fastckpt.errors import CheckpointError

    return CheckpointError(f"{session.what} failed: {message}; the previous checkpoint is untouched")

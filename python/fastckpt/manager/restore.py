"""Restore across tiers: the newest intact step among the own memory tier, peer replicas, the local durable tier
and the remote one; every candidate checked (crc32c) before anything is applied; a damaged tier skipped with a
:class:`~fastckpt.errors.TierSkippedWarning` naming it.

One process (:func:`restore_single`): candidates newest first (at equal steps: memory, local, remote); each is read
and checked through a pinned handle (phase 1 of a load, nothing live changes), the first that passes is applied.

Several processes (:func:`restore_multi`): each process checks what it holds (its memory tier, the replicas it
keeps for other ranks; the main process also the durable tiers) and reports the newest intact step of each; the
main process picks the newest step every rank can restore, and for each rank where from (its own memory, a peer
holding its replica, the durable tier); replicas travel over the peer group into the owner's memory tier; every
rank reads and checks its copy, they agree, and only then does any rank apply.

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fastckpt._io.group.distributed import Session
from fastckpt._io.storage.local.folder import pinned
from fastckpt._io.storage.local.integrity import verify_checkpoint
from fastckpt._io.storage.local.layout import read_manifest
from fastckpt._io.storage.local.numbering import checkpoint_numbers
from fastckpt._io.storage.memory import MemoryTier
from fastckpt._io.storage.peer import exchange, replica_sources, replica_tier
from fastckpt._state.sharded import is_sharded
from fastckpt.errors import (
    CheckpointChangedError,
    CheckpointError,
    DtypeError,
    HeaderError,
    IntegrityError,
    KeyMismatchError,
    MissingStateError,
    ShapeMismatchError,
    TierSkippedWarning,
)
from fastckpt.manager.sharded import check_sharding, plan_local_restore, snapshot_owner
from fastckpt.manager.state import plan_restore, read_objects

__all__ = ["Candidate", "restore_single", "restore_multi", "TIERS"]

logger = logging.getLogger("fastckpt")

#: at equal steps, the cheaper tier first
TIERS = ("memory", "peer", "local", "remote")
#: what makes a tier skipped instead of the restore failing: damaged, partial or unreadable bytes (a missing file
#: is a MissingStateError, an OSError); a checkpoint that is intact but differs from what this run passed
#: (:data:`MISMATCH`, found by :func:`read_checked`) is raised instead (as Orbax does on a structure mismatch)
DAMAGE = (IntegrityError, HeaderError, MissingStateError, CheckpointChangedError, OSError)
#: the checkpoint is intact but is not of the objects this run passed (other model, schedulers, registered objects)
MISMATCH = (MissingStateError, KeyMismatchError, ShapeMismatchError, DtypeError)
_NUMBER = re.compile(r"checkpoint_(\d+)/?$")


@dataclass
class Candidate:
    """One checkpoint a restore may use: its step, tier, and a local folder or an ``s3://`` URL."""

    step: int
    tier: str
    location: str
    folder: Path | None = None

    def key(self) -> tuple[int, int]:
        return (-self.step, TIERS.index(self.tier))


def skip(c: Candidate, exc: BaseException, skipped: list[str] | None = None) -> None:
    """Warn that ``c`` is skipped (names tier, place, step and error); noted in ``skipped``."""
    if getattr(exc, "_fastckpt_mismatch", False):  # intact, but not what this run passed: never skipped
        raise exc
    what = f"the {c.tier} tier's checkpoint of step {c.step} at {c.location}"
    if skipped is not None:
        skipped.append(f"{what} ({type(exc).__name__}: {exc})")
    warnings.warn(f"{what} is damaged or unreadable ({type(exc).__name__}: {exc}); skipped, trying the next one",
                  TierSkippedWarning, stacklevel=4)


def foreign(c: Candidate, project: Path | None, project_id: str | None = None) -> bool:
    """True (and a :class:`TierSkippedWarning` naming whose it is) when the memory-tier or replica snapshot ``c``
    was saved by another project (its manifest's ``"project"``, e.g. two projects sharing ``FASTCKPT_JOB_ID``) or
    by an earlier incarnation of this one (its ``"project_id"`` differs from ``project_id``: the folder was
    deleted and made again, :mod:`fastckpt.manager.incarnation`); a snapshot without these records (older
    versions) or an unreadable manifest (the restore reports it) is not."""
    if project is None or c.folder is None or c.tier not in ("memory", "peer"):
        return False
    try:
        manifest = read_manifest(c.folder)
    except (CheckpointError, OSError, ValueError):
        return False
    owner, owner_id = manifest.get("project"), manifest.get("project_id")
    mine = str(Path(project).resolve())
    what = f"the {c.tier} tier's checkpoint of step {c.step} at {c.location}"
    if owner is not None and owner != mine:
        warnings.warn(f"{what} belongs to the project {owner}, not to this one ({mine}); skipped, never applied",
                      TierSkippedWarning, stacklevel=4)
        return True
    if owner_id is not None and project_id is not None and owner_id != project_id:
        warnings.warn(f"{what} belongs to an earlier incarnation of the project {mine} (project id {owner_id}; this "
                      f"one is {project_id}: the folder was deleted and made again); skipped, never applied",
                      TierSkippedWarning, stacklevel=4)
        return True
    return False


def no_intact(skipped: list[str]) -> CheckpointError:
    """The error of a restore whose every existing candidate was damaged (starting over would overwrite them)."""
    return CheckpointError("no checkpoint could be restored, every one found is damaged or unreadable: "
                           + "; ".join(skipped) + ". Nothing was changed; repair or remove them (fastckpt verify) "
                           "to start from scratch")


def local_candidates(memory: MemoryTier | None, project: Path | None) -> list[Candidate]:
    """The own memory tier's and the local durable tier's committed checkpoints (None: that tier is skipped)."""
    out = [] if memory is None else [Candidate(c.step or 0, "memory", c.location, Path(c.location))
                                     for c in memory.list()]
    if project is not None:
        out += [Candidate(n, "local", str(f), f) for n, f in checkpoint_numbers(project, full_only=True).items()]
    return out


def remote_candidate(remote: Any, storage_options: Any) -> Candidate | None:
    """The newest committed checkpoint under the ``remote`` project (``s3://``), or None."""
    if remote is None:
        return None
    from fastckpt._io.storage.object.api import latest_remote

    url = latest_remote(remote, model_only=False, storage_options=storage_options)
    m = _NUMBER.search(url or "")
    return None if m is None else Candidate(int(m.group(1)), "remote", str(url))


@contextlib.contextmanager
def opened(c: Candidate, storage_options: Any) -> Any:
    """``c`` as a local folder (a remote one is fetched into memory, checked as it comes in)."""
    if c.tier != "remote":
        yield c.folder
        return
    from fastckpt._io.storage.object.api import fetched
    from fastckpt._io.storage.object.store import remote_url

    with fetched(remote_url(c.location, "remote"), None, model_only=False, storage_options=storage_options) as f:
        yield f


def read_checked(c: Candidate, objects: tuple, *, rank: int, threads: int, storage_options: Any,
                 verify: bool = True) -> Any:
    """Phase 1 from ``c``: every byte it reads checked (``verify=False``: ``c`` was checked whole by this process
    already); returns the load plan (nothing live changed)."""
    mismatch: BaseException | None = None
    with opened(c, storage_options) as folder:
        with pinned(folder, verify=verify, threads=threads, defer=True) as handle:
            try:
                plan = plan_restore(handle, *objects, rank=rank)
            except MISMATCH as exc:
                mismatch = exc
        if mismatch is not None:  # damage (checked whole here: raises) or this run passed other objects
            verify_checkpoint(folder, threads=threads)
            mismatch._fastckpt_mismatch = True  # type: ignore[attr-defined]
            raise mismatch
    return plan


def restore_single(candidates: list[Candidate], objects: tuple, *, threads: int, storage_options: Any,
                   project: Path | None = None, project_id: str | None = None) -> tuple[Candidate | None, Any]:
    """Try ``candidates`` newest first (another ``project``'s memory snapshots skipped); returns the one applied
    (None: there is none) and its load plan.

    Raises:
        MissingStateError / KeyMismatchError / ShapeMismatchError / DtypeError: an intact checkpoint is not of the
            objects passed (nothing changed). CheckpointError: every candidate was damaged (names them).
    """
    skipped: list[str] = []
    for c in sorted(candidates, key=Candidate.key):
        if foreign(c, project, project_id):
            continue
        try:
            plan = read_checked(c, objects, rank=0, threads=threads, storage_options=storage_options)
        except DAMAGE as exc:
            skip(c, exc, skipped)
            continue
        plan.apply(threads=threads)
        return c, plan
    if skipped:
        raise no_intact(skipped)
    return None, None


def _newest_intact(cands: list[Candidate], check: Callable[[Candidate], None], project: Path,
                   skipped: list[str], project_id: str | None = None) -> Candidate | None:
    for c in sorted(cands, key=Candidate.key):
        if foreign(c, project, project_id):
            continue
        try:
            check(c)
            return c
        except DAMAGE as exc:
            skip(c, exc, skipped)
    return None


def survey(memory: MemoryTier | None, project: Path, remote: Any, storage_options: Any, *, rank: int,
           threads: int, world: int = 1, models: list | None = None) -> dict[str, Any]:
    """What this process can restore from: ``{"memory": step|None, "held": {src: step}, "local": [steps visible],
    "remote": [step, url]|None}``; its memory tier and the replicas it holds are checked (crc32c; a snapshot of
    local shards: of this world size and rank, cut as the live sharded ``models`` are), the durable tiers only
    listed (rank 0 checks the one :func:`decide` needs)."""
    def check(c: Candidate, owner: int = rank) -> None:
        saved = snapshot_owner(c.folder)  # a rank's local shards (FSDP2): that rank of this world size only
        if saved is not None and saved[1] != world:
            raise MissingStateError(f"a snapshot of local shards saved by {saved[1]} processes, this run has {world}")
        if saved is not None and saved[0] != owner:  # e.g. one memory= path on every node, ranks placed anew
            raise MissingStateError(f"a snapshot of the local shards of rank {saved[0]}, found where rank {owner}'s "
                                    "are kept")
        verify_checkpoint(c.folder, threads=threads)
        if saved is not None and models is not None:  # another mesh or placements: the durable tier reshards
            check_sharding(c.folder, models)

    skipped: list[str] = []
    pid = None if memory is None else memory.project_id
    own = None if memory is None else _newest_intact(local_candidates(memory, None), check, project, skipped, pid)
    held: dict[int, int] = {}
    if memory is not None:
        for src in replica_sources(memory.root):
            tier = replica_tier(memory.root, src)
            c = _newest_intact([Candidate(x.step or 0, "peer", x.location, Path(x.location)) for x in tier.list()],
                               lambda c, src=src: check(c, src), project, skipped, pid)
            if c is not None:
                held[src] = c.step
    rc = remote_candidate(remote, storage_options) if rank == 0 else None
    return {"memory": None if own is None else own.step, "held": held,
            "local": sorted(c.step for c in local_candidates(None, project)),
            "remote": None if rc is None else [rc.step, rc.location], "skipped": skipped}


def decide(reports: list[dict[str, Any]], project: Path, *, threads: int, together: bool = False) -> dict[str, Any]:
    """The newest step every rank can restore and each rank's source (run on rank 0); a durable checkpoint is
    checked (crc32c) only when the step needs it, so a restore from memory and replicas never reads the durable
    tier. ``together`` (sharded states): a step some rank restores from the durable tier is restored from it by
    every rank (a sharded load is one collective)."""
    remote = reports[0]["remote"]
    durable_ok: dict[int, bool] = {}
    skipped = [s for rep in reports for s in rep.get("skipped", [])]

    def durable(s: int) -> bool:
        if s not in durable_ok:
            folder = project / "checkpoints" / f"checkpoint_{s}"
            try:
                verify_checkpoint(folder, threads=threads)
                durable_ok[s] = True
            except DAMAGE as exc:
                skip(Candidate(s, "local", str(folder), folder), exc, skipped)
                durable_ok[s] = False
        return durable_ok[s]

    steps: set[int] = set(reports[0]["local"])
    for rep in reports:
        steps |= {s for s in (rep["memory"], *rep["held"].values()) if s is not None}
    if remote is not None:
        steps.add(remote[0])
    for s in sorted(steps, reverse=True):
        sources: list[Any] = []
        for r, rep in enumerate(reports):
            holder = next((p for p, other in enumerate(reports) if p != r and other["held"].get(r) == s), None)
            if rep["memory"] == s:
                sources.append(["memory"])
            elif holder is not None:
                sources.append(["peer", holder])
            elif s in rep["local"] and s in reports[0]["local"] and durable(s):
                sources.append(["local"])
            elif remote is not None and s == remote[0]:
                sources.append(["remote", remote[1]])
            else:
                break
        else:
            kinds = {src[0] for src in sources}
            if together and kinds & {"local", "remote"} and len(kinds) > 1:
                if s in reports[0]["local"] and durable(s):
                    sources = [["local"]] * len(reports)
                elif remote is not None and s == remote[0]:
                    sources = [["remote", remote[1]]] * len(reports)
                else:
                    continue
            return {"step": s, "sources": sources}
    return {"step": None, "sources": [], "skipped": skipped}


def restore_multi(memory: MemoryTier | None, project: Path, remote: Any, storage_options: Any, objects: tuple, *,
                  group: Any, timeout: float, threads: int) -> tuple[Candidate | None, Any]:
    """The agreed restore of several processes (see the module docs); returns this rank's source and plan."""
    session = Session("CheckpointManager.restore", timeout)
    rank = session.rank
    sharded = is_sharded(objects[0])
    report = survey(memory, project, remote, storage_options, rank=rank, threads=threads, world=session.world,
                    models=objects[0] if sharded else None)
    reports = session.gather(report, step="survey")
    choice = session.broadcast(decide(reports, project, threads=threads, together=sharded) if rank == 0 else None,
                               step="decide")
    if choice["step"] is None:
        if choice.get("skipped"):  # every rank raises: checkpoints exist, but none intact
            raise no_intact(choice["skipped"])
        return None, None
    step = choice["step"]
    error: BaseException | None = None
    try:  # replicas travel to the ranks that lost their memory tier (every rank walks the same list)
        for r, src in enumerate(choice["sources"]):
            if src[0] != "peer" or memory is None:
                continue
            holder = src[1]
            if rank == holder:
                folder = replica_tier(memory.root, r).folder / f"checkpoint_{step}"
                exchange(folder, [r], [], group)
            elif rank == r:
                exchange(None, [], [(holder, memory)], group)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = exc
    mine = choice["sources"][rank]
    own = memory.folder if memory is not None else project / "checkpoints"  # memory / peer need a memory tier
    where = {"memory": own / f"checkpoint_{step}", "peer": own / f"checkpoint_{step}",
             "local": project / "checkpoints" / f"checkpoint_{step}"}
    c = Candidate(step, mine[0], mine[1] if mine[0] == "remote" else str(where[mine[0]]),
                  None if mine[0] == "remote" else where[mine[0]])
    if sharded and c.tier in ("local", "remote"):  # every rank (decide: together): one collective sharded load
        plan = durable_sharded(c, objects, session, failed=error, threads=threads)
        plan.apply()
        return c, plan
    plan = None
    if error is None:
        try:
            # the own memory tier was summed whole by survey() in this process, and only this process writes it
            # (MemoryTier.claim): not summed twice; a replica received from a peer or a durable one is summed here
            verify = c.tier != "memory"
            if sharded:
                with pinned(c.folder, verify=verify, threads=threads, defer=True) as handle:
                    plan = plan_local_restore(handle, *objects, rank=rank, world=session.world, threads=threads)
            else:
                plan = read_checked(c, objects, rank=rank, threads=threads, storage_options=storage_options,
                                    verify=verify)
        except Exception as exc:  # noqa: BLE001 - every rank raises below
            error = exc
    if error is not None and not isinstance(error, CheckpointError):
        error = CheckpointError(f"restoring step {step} from the {c.tier} tier at {c.location}: "
                                f"{type(error).__name__}: {error}")
    session.agree(error, step="checked")
    if sharded:
        plan.apply()
    else:
        plan.apply(threads=threads)
    return c, plan


def durable_sharded(c: Candidate, objects: tuple, session: Session, *, failed: BaseException | None,
                    threads: int) -> Any:
    """Phase 1 of every rank's sharded load of the durable checkpoint ``c`` (DCP reshards; ``failed``: this
    rank's error so far, reported to every rank in the load's one validation round)."""
    from fastckpt._plan.sharded_load import plan_sharded_load
    from fastckpt.checkpoint_sharded import dcp_storage_reader

    assert c.folder is not None, "remote= is refused for sharded states"
    models, optimizers, schedulers, registered = objects

    def extra(load: Any) -> None:
        load.objects += read_objects(c.folder, registered, rank=session.rank)

    return plan_sharded_load(c.folder, models, optimizers, schedulers, model_only=False, strict=True,
                             session=session, reader_factory=dcp_storage_reader, rng_rank=session.rank, extra=extra,
                             failed=failed, verify=True, threads=threads)


def log_restore(c: Candidate | None, started: float) -> None:
    """INFO: where the restore came from (or that there was nothing)."""
    if c is None:
        logger.info("CheckpointManager: no intact checkpoint in any tier; starting at step 0")
    else:
        logger.info("CheckpointManager: restored step %d from the %s tier (%s) in %.3f s", c.step, c.tier,
                    c.location, time.perf_counter() - started)

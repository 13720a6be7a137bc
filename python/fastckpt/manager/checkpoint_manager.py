"""``fastckpt.CheckpointManager``: the object a training loop holds to never lose more than a step.

One copy per save: at a due ``step(n)`` the state is written by the Rust writer, straight from tensor memory and in
parallel, into the memory tier (:mod:`fastckpt._io.storage.memory`, a folder under ``/dev/shm``) and committed
there before ``step()`` returns; that copy is the host snapshot. The durable tier
(``{project_dir}/checkpoints/checkpoint_{n}``, a normal checkpoint folder) is copied from it in the background
(:mod:`fastckpt.manager.durable`), uploaded with ``remote=``, and the peers get their replicas
(:mod:`fastckpt.manager.replicas`). A preemption signal is recorded and acted on at the next ``step()``
(:mod:`fastckpt.manager.preemption`); :meth:`CheckpointManager.restore` takes the newest intact step across tiers
(:mod:`fastckpt.manager.restore`).

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from fastckpt._io.group.distributed import DEFAULT_TIMEOUT, Session, check_timeout, is_distributed
from fastckpt._io.storage.local.layout import CHECKPOINTS_DIR
from fastckpt._io.storage.memory import MemoryTier
from fastckpt.errors import CheckpointError, DurableSaveError, OptionError, OptionTypeError
from fastckpt.manager.ending import Ending
from fastckpt.manager.options import (
    check_budget,
    check_count,
    check_exit_code,
    check_project,
    check_remote,
    check_replicas,
    check_signals,
    check_step,
    memory_root,
    typed_option,
)
from fastckpt.manager.preemption import Preempted, SignalRecorder
from fastckpt.manager.restore import local_candidates, log_restore, remote_candidate, restore_multi, restore_single
from fastckpt.manager.saving import save_durably, save_memory
from fastckpt.manager.schedule import Schedule
from fastckpt.manager.sharded import save_step
from fastckpt.manager.starting import start, undo_start
from fastckpt.manager.state import Registered, build_plan, gather_rank_states

__all__ = ["CheckpointManager"]

logger = logging.getLogger("fastckpt")
_managers = 0  # managers made by this process: the same sequence on every rank (their store keys differ)


class CheckpointManager(Ending):
    """Periodic, preemption and crash-safe checkpoints of a training loop, with a memory tier and peer replicas.

    Args:
        project_dir: a local folder, the durable tier: ``{project_dir}/checkpoints/checkpoint_{step}``, folders
            :func:`fastckpt.load_state` reads (every manifest records its step).
        model: a module or a list (DDP / DataParallel are unwrapped).
        optimizer: an optimizer, a list, or None.
        scheduler: an LR scheduler, a list, or None.
        every_n_steps: a save is due at ``step(n)`` when ``n % every_n_steps == 0``.
        every_seconds: a save is due at the first step boundary ``every_seconds`` (float seconds) after the last.
        continuous: a save is due as soon as the previous one is durable.
        mtbf: mean time between failures in seconds: saves every ``sqrt(2 * save_cost * mtbf)`` seconds
            (Young/Daly), ``save_cost`` measured (:attr:`interval_seconds`).
        memory: True: the memory tier at ``/dev/shm/fastckpt-{job}/rank{r}`` (``job``: ``FASTCKPT_JOB_ID``, else
            the project folder's name and a hash of its path, so a restart on the same machine finds it); a path:
            this rank's memory tier there (apart from ``project_dir``; ``close()`` removes only what the tier
            wrote in it); False: no memory tier (each save is written durably in ``step()``).
        replicas: peers (other machines first, by ``LOCAL_WORLD_SIZE``) holding a copy of each rank's memory
            snapshot (int >= 0; several processes and ``memory`` only).
        keep: durable checkpoints kept (int >= 1, or None for all); the memory tier keeps the newest.
        remote: an ``s3://`` project URL: each durable checkpoint is uploaded there in the background.
        storage_options: S3 settings for ``remote`` (see :func:`fastckpt.save_state`).
        preemption_signals: the signals that ask for a save and exit (installed on the main thread only; one
            number, or None / ``()`` for none; not SIGKILL / SIGSTOP, which cannot be caught).
        preemption_exit_code: the :class:`Preempted` exit code (int 0-255, default 0).
        host_memory_budget: bytes (int or ``"8GB"``) the memory tier may hold; a state larger than that is refused,
            and a save that would hold two snapshots over it waits for the durable copy of the older first.
        threads: writer / reader threads (0: min(8, cores)).
        timeout: seconds a process waits for the others at a save, a restore or a preemption (float).

    Raises:
        OptionError: (a ValueError) a bad option value, named with the value, before anything is installed,
            claimed or started: a non-finite or non-positive interval, ``keep=0``, ``replicas`` without peers
            (one process) or without a memory tier, a ``memory`` folder this process cannot write, a ``remote``
            that is not ``s3://``, ``storage_options`` without ``remote``.
        OptionTypeError: (an OptionError and a TypeError) an option of the wrong type (``continuous="no"``,
            ``every_n_steps=True``), ``model=[]``. TypeError: a model that is not a module.
        CheckpointError: another process holds the memory tier (names its pid).

    A constructor that fails after the option checks (a collective timing out, another process failing) leaves
    nothing behind: the memory tier's claim, the folders and the project id file it made, its gloo group and its
    signal handlers are undone before the error propagates.

    Example:
        >>> mgr = fastckpt.CheckpointManager("run", model, optimizer, scheduler, every_n_steps=100)
        >>> start = mgr.restore()
        >>> for step in range(start, total_steps):
        ...     train_one_step()
        ...     mgr.step(step + 1)
        >>> mgr.close()
    """

    def __init__(self, project_dir: str | os.PathLike[str], model: Any, optimizer: Any = None,
                 scheduler: Any = None, *, every_n_steps: int | None = None, every_seconds: float | None = None,
                 continuous: bool = False, mtbf: float | None = None, memory: bool | str | os.PathLike[str] = True,
                 replicas: int = 0, keep: int | None = 3, remote: str | None = None,
                 storage_options: Any = None,
                 preemption_signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1),
                 preemption_exit_code: int = 0, host_memory_budget: int | str | None = None, threads: int = 0,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        from fastckpt.checkpoint import _as_list as checked_list

        global _managers
        self.project = check_project(project_dir)
        self.models = checked_list(model, "model")
        if not self.models:
            raise OptionTypeError(f"model={model!r} holds no module; pass the torch.nn.Module (or a non-empty list "
                                  "of them) to checkpoint")
        from fastckpt._state.sharded import is_sharded

        if (sharded := is_sharded(self.models)) and remote is not None:  # FSDP2 / DTensor: manager/sharded.py
            raise OptionError(f"remote={remote!r}: a remote tier is not supported for sharded (FSDP2 / DTensor) "
                              "models yet; pass remote=None")
        self.sharded = sharded
        self.optimizers = checked_list(optimizer, "optimizer")
        self.schedulers = checked_list(scheduler, "scheduler")
        self.objects: list[Registered] = []
        self.schedule = Schedule(every_n_steps=every_n_steps, every_seconds=every_seconds, continuous=continuous,
                                 mtbf=mtbf)
        check_count("replicas", replicas, 0)
        self.keep = check_count("keep", keep, 1, none=True)
        self.threads = check_count("threads", threads, 0)
        self.timeout = typed_option(check_timeout, timeout)
        self.exit_code = check_exit_code(preemption_exit_code)
        signals = check_signals(preemption_signals)
        self.storage_options = storage_options
        self.remote = check_remote(remote, storage_options)
        self.budget = check_budget(host_memory_budget)
        self.distributed = is_distributed()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        check_replicas(replicas, memory, self.world if self.distributed else None)
        root, self._memory_default = memory_root(memory, self.project, self.rank)
        _managers += 1  # every option checked: the same sequence on every rank
        self.memory: MemoryTier | None = None
        self.durable = self.group = self.replicator = self._finalizer = None
        self.signals = SignalRecorder(signals)
        self._made: list[Path] = []  # folders and files this constructor made: removed if it fails
        self.project_id: str | None = None  # the project folder's incarnation (manager/incarnation.py)
        try:
            start(self, root, memory, replicas, keep, storage_options, _managers)
        except BaseException:  # a failed constructor leaves nothing: no claim, handler, folder or group
            undo_start(self)
            raise
        self._failure: DurableSaveError | None = None  # rank 0: a durable failure to raise at the agreed step
        self.restored_from: str | None = None
        self.restored_step: int | None = None
        self._handed: int | None = None  # a restored step handed to the durable tier (see _hand_restored)
        self.last_saved: int | None = None
        self.preempt_seconds: float | None = None
        #: the :class:`Preempted` of a preemption save (set before it is raised; see ``exit_on_preemption``)
        self.preempted: Preempted | None = None
        self._closed = False
        self._step_seen: int | None = None  # the last step passed to step() / save_now() (or restored)

    # -- extra state ---------------------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any, per_rank: bool = False) -> None:
        """Checkpoint ``objects`` too: anything with ``state_dict()`` / ``load_state_dict()`` (a sampler, a
        ``StatefulDataLoader``, counters, a ``GradScaler``, an EMA model), stored pickle-free as
        ``custom_checkpoint_{i}.safetensors`` in registration order (register the same objects in the same order
        before :meth:`restore`). Every process restores the saving process's state (replicated objects, as
        accelerate saves the main process's). ``per_rank=True``: the object differs across processes (a
        per-rank data order, a counter of local tokens): its state is gathered from every process at each save
        (through the store: keep it small) and each process restores its own
        (``custom_checkpoint_{i}_rank{r}.safetensors``).

        Raises:
            TypeError: an object without ``state_dict`` / ``load_state_dict``.
        """
        for obj in objects:
            if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
                raise TypeError(f"{type(obj).__name__} has no state_dict() / load_state_dict(); it cannot be "
                                "registered for checkpointing")
            self.objects.append(Registered(obj, per_rank=bool(per_rank)))

    @property
    def _state(self) -> tuple:
        return self.models, self.optimizers, self.schedulers, self.objects

    # -- restore -------------------------------------------------------------------------------------------
    def restore(self) -> int:
        """Restore the newest intact step across tiers (own memory, peer replicas, local durable, remote); every
        candidate is checked (crc32c) before anything is applied, a damaged one is skipped with a
        :class:`~fastckpt.errors.TierSkippedWarning`; every rank restores the same step (the newest every rank
        can). A memory snapshot saved by another project (a shared ``FASTCKPT_JOB_ID``) is skipped with a warning
        naming it. Sets :attr:`restored_from` (``"memory"``, ``"peer"``, ``"local"``, ``"remote"`` or None) and
        logs it.

        Returns:
            The restored step (int), 0 when no tier holds a checkpoint (nothing is changed then).

        Raises:
            MissingStateError / KeyMismatchError / ShapeMismatchError / DtypeError: the newest intact checkpoint is
                not of the objects passed (another model, schedulers or registered objects added or removed);
                nothing changed, nothing deleted. CollectiveTimeoutError: another process did not take part within
                ``timeout``. CheckpointError: every checkpoint found is damaged (names each; starting over would
                overwrite them), or another process failed (names it); nothing changed on any process.
        """
        started = time.perf_counter()
        if self.distributed or self.sharded:  # a sharded state (one process included): its own readers
            c, _ = restore_multi(self.memory, self.project, self.remote, self.storage_options, self._state, group=self.group,
                                 timeout=self.timeout, threads=self.threads)
        else:
            cands = local_candidates(self.memory, self.project)
            rc = remote_candidate(self.remote, self.storage_options)
            c, _ = restore_single(cands + ([rc] if rc else []), self._state, threads=self.threads,
                                  storage_options=self.storage_options, project=self.project,
                                  project_id=self.project_id)
        self.restored_from = None if c is None else c.tier
        self.restored_step = self._step_seen = None if c is None else c.step
        log_restore(c, started)
        self._hand_restored(self.restored_from, self.restored_step)  # newer than the durable tier: made durable
        return 0 if c is None else c.step

    # -- the loop ------------------------------------------------------------------------------------------
    @property
    def preemption_requested(self) -> bool:
        """A preemption signal arrived on this process (the save happens at the next :meth:`step`)."""
        return self.signals.pending

    def request_preemption(self, signum: int = signal.SIGTERM) -> None:
        """Act as if ``signum`` arrived: the next :meth:`step` saves durably and raises :class:`Preempted`."""
        self.signals.trigger(signum)

    def should_save(self, step: int) -> bool:
        """Whether :meth:`step` would save at ``step`` by the ``every_n_steps`` schedule."""
        return self.schedule.due_by_steps(step)

    def step(self, step: int, *, exit_on_preemption: bool = True) -> bool:
        """Call after each optimizer step with the number of steps done: saves when due (committed in the memory
        tier when it returns, durable in the background); after a preemption signal saves ``step`` durably and
        raises :class:`Preempted`.

        Args:
            step: optimizer steps done (int >= 0; the same on every process).
            exit_on_preemption: False (a framework callback that stops training its own way): after the
                preemption save, return True and set :attr:`preempted` (the :class:`Preempted` it would raise)
                instead of raising.

        Returns:
            Whether a save was made at ``step``.

        Raises:
            Preempted: (a ``SystemExit``) a preemption signal arrived and ``step`` is durable.
            Exception: a background save (durable copy, upload, replica) failed; raised once, here.
            TypeError / ValueError: ``step`` not an int >= 0, or lower than the previous one (since restore()).
        """
        if self._closed:
            raise CheckpointError("CheckpointManager.step() after close(): make a new manager")
        self._step_seen = check_step(step, self._step_seen, "CheckpointManager.step")
        self._check_background()
        event = self.board.poll()
        ahead = 1 if self.distributed else 0  # the others may be at this boundary already: propose the next
        if event is None and self.signals.pending:
            event = self.board.propose(step + ahead, "preempt")
        if event is None and self._failure is not None:  # every rank raises it at the same step
            event = self.board.propose(step + ahead, f"failed {self._failure}")
        if event is None and self.schedule.timed and self.rank == 0 and step != self.last_saved:
            busy = self.durable.busy if self.durable is not None else False
            if self.schedule.due_by_time(durable_busy=busy):
                event = self.board.propose(step + ahead, "save")
        act = None
        if event is not None and event[0] <= step:
            act = event[1]
            self.board.consume()
        if act is not None and act.startswith("failed "):
            self._raise_failure(act[len("failed "):])
        if act == "preempt":
            self.preempted = self._preempt(step)
            if exit_on_preemption:
                raise self.preempted
            return True
        if act == "save" or self.schedule.due_by_steps(step):
            self.save_now(step)
            return True
        return False

    def preemption_due(self, step: int) -> bool:
        """For integrations that write checkpoints in their own format (the Trainer's ``checkpoint-N``, Lightning's
        ``last.ckpt``): call instead of :meth:`step` at every step boundary, on every process. True at the step
        every process agreed to stop at after a preemption signal (the same agreement as :meth:`step`: this step
        with one process, the next boundary with several); the caller then saves that step durably and calls
        :meth:`exit_preempted`. Saves nothing itself; a time-based save event, if any, is passed over.

        Returns:
            Whether this process must save ``step`` and stop now.
        """
        if self._closed:
            raise CheckpointError("CheckpointManager.preemption_due() after close(): make a new manager")
        event = self.board.poll()
        if event is None and self.signals.pending:
            event = self.board.propose(step + (1 if self.distributed else 0), "preempt")
        if event is None or event[0] > step:
            return False
        self.board.consume()
        return event[1] == "preempt"

    def exit_preempted(self, step: int, path: str | os.PathLike[str]) -> None:
        """After a preemption save made outside the manager (see :meth:`preemption_due`): log the signal-to-durable
        time, close the manager (the memory tier is kept) and raise :class:`Preempted` naming ``step`` and ``path``.

        Raises:
            Preempted: always (a ``SystemExit`` with the manager's ``preemption_exit_code``).
        """
        signum = self.signals.signum or signal.SIGTERM
        self.signals.keep_until_exit()
        self.preempt_seconds = time.monotonic() - (self.signals.at or time.monotonic())
        logger.warning("CheckpointManager: %s: step %d durable at %s %.3f s after the signal; exiting",
                       self._cause(), step, path, self.preempt_seconds)
        self.close(clear_memory=False)
        raise Preempted(self.exit_code, step=step, signum=signum, path=Path(path))

    def save_now(self, step: int) -> Path:
        """Save ``step`` now (every process calls it at the same step): committed in the memory tier when it
        returns (or durably without one), durable and replicated in the background.

        Returns:
            The committed memory-tier folder (the durable folder without a memory tier).

        Raises:
            TypeError: state that cannot be stored without pickle (names its path); nothing is committed.
            ValueError: the state is larger than ``host_memory_budget``.
            OSError: the tier cannot be written; the previous checkpoint stays. A memory tier without room
                (``ENOSPC``) is no error: the partial snapshot goes, a :class:`~fastckpt.errors.MemoryTierFullWarning`
                names the folder and the bytes needed, and the step is saved durably instead
                (:mod:`fastckpt.manager.saving`).
        """
        if self._closed:
            raise CheckpointError("CheckpointManager.save_now() after close(): make a new manager")
        self._step_seen = check_step(step, self._step_seen, "CheckpointManager.save_now")
        started, clock = time.perf_counter(), time.monotonic()
        if self.replicator is not None:
            self.replicator.wait()
        states = gather_rank_states(step, self.objects, self.timeout)
        if self.sharded:  # local shards in memory, then the durable sharded checkpoint (every rank)
            path = save_step(self, states, step)
        else:
            plan = build_plan(*self._state, step=step, rank_states=states)
            path = save_durably(self, plan, step) if self.memory is None else self._save_memory(plan, step)
            path = path or self.project / CHECKPOINTS_DIR / f"checkpoint_{step}"  # memory full: process 0 writes it
        self.last_saved = step
        self.schedule.saved(step, clock, time.perf_counter() - started)
        return path

    def _save_memory(self, plan: Any, step: int) -> Path | None:  # also sharded.save_step's
        return save_memory(self, plan, step)

    def _cause(self) -> str:
        """What asked for the preemption save, for the log: this process's signal, or another process's."""
        signum = self.signals.signum
        return "a preemption another process asked for" if signum is None else f"signal {signum}"

    def _preempt(self, step: int) -> Preempted:
        self.signals.keep_until_exit()  # a second signal, now or while the process exits, changes nothing
        signum = self.signals.signum or signal.SIGTERM
        at = self.signals.at or time.monotonic()
        if self._failure is not None:  # an older step's durable copy failed; this one supersedes it
            logger.error("%s; superseded by the preemption save of step %d", self._failure, step)
            self._failure = None
        if self.last_saved != step:
            self.save_now(step)
        path = self.project / CHECKPOINTS_DIR / f"checkpoint_{step}"
        if self.memory is not None and not self.sharded:  # a sharded save is durable when save_now returns
            def wait() -> Path:
                assert self.durable is not None
                self.durable.wait(step)
                return path

            Session(f"CheckpointManager preemption save of step {step}", self.timeout).on_main(wait)
        if self.replicator is not None:
            self.replicator.wait()
        self.preempt_seconds = time.monotonic() - at
        logger.warning("CheckpointManager: %s: step %d durable at %s %.3f s after the signal; exiting",
                       self._cause(), step, path, self.preempt_seconds)
        self.close(clear_memory=False)
        return Preempted(self.exit_code, step=step, signum=signum, path=path)

    # -- the end -------------------------------------------------------------------------------------------
    @property
    def interval_seconds(self) -> float | None:
        """The seconds between time-based saves (``every_seconds``, or Young/Daly's from the measured cost)."""
        return self.schedule.interval_seconds


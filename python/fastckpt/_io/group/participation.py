"""Who takes part in a save: every process, or the main process alone (the diffusers pattern).

The diffusers examples save with ``if accelerator.is_main_process: accelerator.save_state(path)``: the other
processes never call, and stock accelerate writes the main process's files alone. A save that every process calls
is one atomic commit of all their files (:mod:`fastckpt._io.group.distributed`). The processes that do not call never
touch the store, so the main process decides alone, in the process group's key-value store:

- rank 0 opens a round: ``fastckpt/participation/round`` += 1 (round ``g``);
- every other rank that calls the save joins the newest round not yet decided (``.../{g}/joined`` += 1), or, when
  the newest one is decided, waits for the next one; a round of another save (rank 0 names its operation and
  target in ``.../{g}/what``) is an error on that rank at once, never a save of mixed calls;
- rank 0 decides once, in ``.../{g}/decision``: ``"all"`` as soon as every other rank joined; after
  :data:`GRACE` seconds (at most ``timeout``) ``"all"`` if some joined (the missing ones may still join that
  round, within the normal ``timeout``, after which a CollectiveTimeoutError names them), ``"main"`` if none did.
  Every rank follows that one key, so no two ranks disagree, whatever the timing: a rank that joins just after
  ``"main"`` waits for the next round.

A save the others take part in costs them nothing extra (they are there within milliseconds of each other, since
data-parallel training steps are in lock step); a save of the main process alone waits :data:`GRACE` seconds first,
never ``timeout``. A rank other than 0 that calls a save the main process never calls still gets
:class:`~fastckpt.errors.CollectiveTimeoutError` after ``timeout``.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from fastckpt._io.group.distributed import is_distributed
from fastckpt.errors import CheckpointError, CollectiveTimeoutError

__all__ = ["GRACE", "participants"]

#: seconds the main process waits for the others to join a save before saving alone
GRACE = 3.0
_PREFIX = "fastckpt/participation"


def _store():
    return dist.distributed_c10d._get_default_store()


def _poll(done, timeout: float) -> bool:
    """Call ``done()`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


def _counter(store, key: str) -> int:
    return int(store.add(key, 0))


def _decide(store, what: str, world: int, grace: float) -> str:
    g = int(store.add(f"{_PREFIX}/round", 1))
    store.set(f"{_PREFIX}/{g}/what", what)
    joined = f"{_PREFIX}/{g}/joined"
    everyone = _poll(lambda: _counter(store, joined) >= world - 1, grace)
    decision = "all" if everyone or _counter(store, joined) > 0 else "main"
    store.set(f"{_PREFIX}/{g}/decision", decision)
    # every rank is past round g - 2; its decision key stays (a few bytes), so a rank can never take it for open
    for old in (f"{_PREFIX}/{g - 2}/{k}" for k in ("what", "joined")):
        try:
            store.delete_key(old)
        except Exception:  # a store without delete_key: the keys are a few bytes
            pass
    return decision


def _open(store, g: int, world: int) -> bool:
    """Whether this rank may join round ``g``: not yet decided, or decided ``"all"`` with a place still free (a
    rank that comes after the others joined and the grace ended, in a world of more than two)."""
    key = f"{_PREFIX}/{g}/decision"
    if not store.check([key]):
        return True
    return store.get(key).decode() == "all" and _counter(store, f"{_PREFIX}/{g}/joined") < world - 1


def _join(store, what: str, world: int, timeout: float) -> str:
    seen = -1
    deadline = time.monotonic() + timeout
    while True:
        g = _counter(store, f"{_PREFIX}/round")
        if g > seen and g > 0 and _open(store, g, world):
            key = f"{_PREFIX}/{g}/what"
            if not _poll(lambda key=key: store.check([key]), max(0.0, deadline - time.monotonic())):
                break
            theirs = store.get(key).decode()
            if theirs != what:  # process 0 is in another save: this one is not the same call
                raise CheckpointError(
                    f"{what}: process {dist.get_rank()} called it while process 0 is in {theirs}; every process "
                    "must make the same save calls (or only the main process saves)")
            place = int(store.add(f"{_PREFIX}/{g}/joined", 1))
            key = f"{_PREFIX}/{g}/decision"
            if not _poll(lambda key=key: store.check([key]), max(0.0, deadline - time.monotonic())):
                break
            if store.get(key).decode() == "all" and place <= world - 1:
                return "all"
        seen = max(seen, g)  # decided without this process: wait for the main process's next save
        if not _poll(lambda seen=seen: _counter(store, f"{_PREFIX}/round") > seen, max(0.0, deadline - time.monotonic())):
            break
    raise CollectiveTimeoutError(
        f"{what}: process {dist.get_rank()} waited {timeout:g} s for process 0 to start the same save, and it did "
        "not (it died, or only some processes called it); call it on every process, or on the main process only")


def participants(what: str, timeout: float, grace: float | None = None) -> str:
    """``"all"`` (every process takes part: the collective save) or ``"main"`` (rank 0 saves alone; only rank 0
    gets it). Every rank that calls the save calls this first; see the module docs.

    Args:
        what: the operation, as messages name it.
        timeout: seconds a rank other than 0 waits for rank 0's decision.
        grace: seconds rank 0 waits for the others to join (default :data:`GRACE`, at most ``timeout``).

    Raises:
        CollectiveTimeoutError: (ranks other than 0) rank 0 did not start the save within ``timeout``.
        CheckpointError: (ranks other than 0) rank 0 is in another save (``what`` differs); the process group's
            store is gone (a process died).
    """
    if not is_distributed():
        return "all"
    store = _store()
    try:
        if dist.get_rank() == 0:
            return _decide(store, what, dist.get_world_size(), min(GRACE if grace is None else grace, timeout))
        return _join(store, what, dist.get_world_size(), timeout)
    except CheckpointError:
        raise
    except RuntimeError as exc:  # the store's server went away
        raise CheckpointError(f"{what}: lost the process group's store ({type(exc).__name__}: {exc}); another "
                              "process probably died") from None

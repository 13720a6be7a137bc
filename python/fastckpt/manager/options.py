"""The checks of :class:`~fastckpt.CheckpointManager`'s folder and signal options, made before the manager installs
anything or writes anything: a wrong option is an error naming it at construction, never a failure at the first
save (or, for ``memory=``, a ``close()`` that removes the wrong folder).

May import: every private layer (layer 5, public package).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Callable, TypeVar

from fastckpt._io.location import check_location
from fastckpt._io.storage.memory import default_memory_root
from fastckpt.errors import OptionError, OptionTypeError

__all__ = ["check_budget", "check_count", "check_exit_code", "check_project", "check_remote",
           "check_replicas", "check_signals", "check_writable", "memory_root", "typed_option"]

T = TypeVar("T")

#: signals no process can catch (``signal.signal`` raises a bare ``OSError: [Errno 22]`` for them)
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def _path(value: Any, what: str) -> Path:
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise OptionTypeError(f"{what} must be a folder (str or os.PathLike), got {type(value).__name__} {value!r}")
    if os.fspath(value) in ("", b""):
        raise OptionError(f"{what}='' names no folder; pass the folder's path")
    return Path(value).absolute()


def check_project(project_dir: Any) -> Path:
    """The absolute durable-tier folder.

    Raises:
        TypeError: not a str / os.PathLike. ValueError: an empty path, a URL (``s3://`` goes to ``remote=``), or a
            path that is a file.
    """
    if isinstance(project_dir, (str, os.PathLike)):
        try:
            check_location(project_dir, "project_dir")
        except ValueError as exc:
            raise OptionError(f"{exc}. CheckpointManager's project_dir is a local folder (the durable tier); "
                             "pass an s3:// project as remote=") from None
    project = _path(project_dir, "project_dir")
    if project.exists() and not project.is_dir():
        raise OptionError(f"project_dir={os.fspath(project_dir)!r} is a file, not a folder")
    return project


def memory_root(memory: Any, project: Path, rank: int) -> tuple[Path | None, bool]:
    """This rank's memory-tier folder and whether it is the default one (``/dev/shm/fastckpt-{job}/rank{r}``).

    Raises:
        TypeError: not a bool, None, str or os.PathLike. ValueError: an empty path, a URL, a file, or a folder
            inside the durable tier or holding it (the tiers must be apart: a restore compares them, and
            ``close()`` empties the memory tier).
    """
    if memory is None or memory is False:
        return None, False
    if memory is True:
        return default_memory_root(project, rank), True
    if isinstance(memory, (str, os.PathLike)):
        typed_option(check_location, memory, "memory")
    root = _path(memory, "memory")
    if root.exists() and not root.is_dir():
        raise OptionError(f"memory={os.fspath(memory)!r} is a file, not a folder")
    resolved, durable = root.resolve(), project.resolve()
    if resolved == durable or durable in resolved.parents or resolved in durable.parents:
        raise OptionError(f"memory={os.fspath(memory)!r} and project_dir={str(project)!r} overlap; the memory tier "
                         "needs a folder of its own, apart from the durable tier (e.g. under /dev/shm)")
    return root, False


def check_signals(signals: Any) -> tuple[int, ...]:
    """The preemption signals as ints: a sequence of signal numbers (or one; None or ``()``: none).

    Raises:
        TypeError: not a signal number. ValueError: a number that is no signal here, or SIGKILL / SIGSTOP (which
            no process can catch: schedulers send them after the catchable warning signal).
    """
    if signals is None:
        return ()
    if isinstance(signals, int):
        signals = (signals,)
    if isinstance(signals, (str, bytes)):  # "TERM" is no sequence of signals: name it whole, not its letters
        raise OptionTypeError(f"preemption_signals must be a sequence of signal numbers (signal.SIGTERM, ...), got "
                              f"{type(signals).__name__} {signals!r}")
    try:
        items = tuple(signals)
    except TypeError:
        raise OptionTypeError(f"preemption_signals must be a sequence of signal numbers, got {signals!r}") from None
    valid = signal.valid_signals()
    out = []
    for s in items:
        if isinstance(s, bool) or not isinstance(s, int):
            raise OptionTypeError(f"preemption_signals: {s!r} is not a signal number (use signal.SIGTERM, ...)")
        if s not in valid:
            raise OptionError(f"preemption_signals: {s} is not a signal number on this system")
        if s in _UNCATCHABLE:
            raise OptionError(f"preemption_signals: {signal.Signals(s).name} cannot be caught by any process; a "
                             "scheduler sends it after the catchable one (SIGTERM, SIGUSR1): pass that")
        out.append(int(s))
    return tuple(out)


def check_exit_code(code: Any) -> int:
    """The :class:`~fastckpt.Preempted` exit code.

    Raises:
        TypeError: not an int. ValueError: outside 0-255 (what a process can exit with).
    """
    if isinstance(code, bool) or not isinstance(code, int):
        raise OptionTypeError(f"preemption_exit_code must be an int (0-255), got {type(code).__name__} {code!r}")
    if not 0 <= code <= 255:
        raise OptionError(f"preemption_exit_code must be in 0-255 (a process's exit status), got {code}")
    return code


def typed_option(check: Callable[..., T], *args: Any) -> T:
    """``check(*args)`` (a checker of a lower layer that raises a bare ``ValueError`` / ``TypeError`` naming the
    option), its errors raised as :class:`~fastckpt.errors.OptionError` / ``OptionTypeError`` (same message)."""
    try:
        return check(*args)
    except OptionError:
        raise
    except TypeError as exc:
        raise OptionTypeError(str(exc)) from None
    except ValueError as exc:
        raise OptionError(str(exc)) from None


def check_count(name: str, value: Any, low: int, *, none: bool = False) -> int | None:
    """An int option >= ``low`` (``keep``, ``replicas``, ``threads``); None allowed when ``none``.

    Raises:
        OptionTypeError: not an int (a bool included). OptionError: below ``low``.
    """
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(f"{name} must be an int >= {low}{' or None' if none else ''}, got "
                              f"{type(value).__name__} {value!r}")
    if value < low:
        raise OptionError(f"{name} must be an int >= {low}{' or None' if none else ''}, got {value!r}")
    return value


def check_remote(remote: Any, storage_options: Any) -> Any:
    """The remote durable tier's ``ObjectUrl`` (None without ``remote``).

    Raises:
        OptionTypeError: not a str. OptionError: not an ``s3://`` URL (a local path, another scheme, a malformed
            URL), or ``storage_options`` without ``remote`` (they would be ignored).
    """
    if remote is None:
        if storage_options is not None:
            raise OptionError(f"storage_options={storage_options!r} without remote=: they configure the s3:// "
                              "remote tier only; pass remote='s3://bucket/prefix' or drop storage_options")
        return None
    from fastckpt._io.storage.object.store import remote_url

    if not isinstance(remote, str):
        raise OptionTypeError(f"remote must be an s3:// URL (str), got {type(remote).__name__} {remote!r}")
    url = typed_option(remote_url, remote, "remote")
    if url is None:
        raise OptionError(f"remote={remote!r} is not an s3:// URL; the local durable tier is project_dir")
    return url


def check_budget(budget: Any) -> int | None:
    """``host_memory_budget`` in bytes (None: no bound).

    Raises:
        OptionTypeError: neither int nor str. OptionError: not a positive size (names the accepted units).
    """
    if budget is None:
        return None
    from fastckpt._io.sizes import parse_size

    return typed_option(parse_size, budget, "host_memory_budget")


def check_replicas(replicas: int, memory: Any, world: int | None) -> None:
    """``replicas`` (already an int >= 0) against the run: ``world`` processes (None: not distributed).

    Raises:
        OptionError: replicas without peers (one process, or not fewer replicas than processes), or without a
            memory tier to copy.
    """
    if not replicas:
        return
    if world is None:
        raise OptionError(f"replicas={replicas} needs several processes (torch.distributed initialised); this run "
                          "has one, with no peer to hold a replica: pass replicas=0")
    if replicas >= world:
        raise OptionError(f"replicas={replicas} needs more than {replicas} processes; this run has {world}")
    if memory is False or memory is None:
        raise OptionError(f"replicas={replicas} copies the memory tier to peers; memory={memory!r} has none")


def check_writable(root: Path, given: Any) -> None:
    """Make sure this process can hold its memory tier at ``root``: the folder made (with its parents) if missing,
    and a file created and removed in it and beside it (where the tier's owner lock goes). Called after every
    other option is checked; on failure nothing is left behind but folders ``mkdir`` made (which the manager's
    failed constructor removes).

    Raises:
        OptionError: the folder cannot be made or written (names ``memory``, the value and the OS error).
    """
    import tempfile

    try:
        root.mkdir(parents=True, exist_ok=True)
        for folder in (root, root.parent):
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".fastckpt-probe-"):
                pass
    except OSError as exc:
        raise OptionError(f"memory={os.fspath(given)!r}: this process cannot write its memory tier there "
                          f"({type(exc).__name__}: {exc.strerror or exc}); pass a writable folder (e.g. under "
                          "/dev/shm), memory=True for the default, or memory=False") from None


def check_step(step: Any, last: int | None, what: str) -> int:
    """``step`` as passed to :meth:`~fastckpt.CheckpointManager.step` / ``save_now``: optimizer steps done.

    Raises:
        TypeError: not an int. ValueError: negative (a manifest records steps >= 0), or lower than the step passed
            before (``last``) since the manager was made or restored: the tiers name and order checkpoints by step,
            so a smaller one would be taken for an older save.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"{what}: step must be an int (optimizer steps done), got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"{what}: step must be >= 0, got {step}")
    if last is not None and step < last:
        raise ValueError(f"{what}({step}) after step {last}: steps must not go back (checkpoints are named and "
                         "ordered by step); call restore() to go back to a saved step, or use a new project_dir")
    return int(step)

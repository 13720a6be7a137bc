"""The ``fastckpt`` command line: ``fastckpt COMMAND [flags]`` (also ``python -m fastckpt COMMAND``).

Each subcommand lives in its own module, listed in :data:`SUBCOMMANDS`, which provides:

- ``HELP``: one line for ``fastckpt --help``;
- ``add_arguments(parser)``: adds the subcommand's flags to its ``argparse`` parser;
- ``run(args) -> int``: does the work and returns the exit status;
- optionally ``EPILOG``: text after the flags in ``fastckpt COMMAND --help`` (the exit statuses).

Usage errors (bad flags) exit 2, as ``argparse`` does. When stdout is closed early (``fastckpt inspect H | head``),
the command stops quietly with exit status 141 (128 + SIGPIPE, what a shell reports for a killed writer).

Adding ``convert``, ``verify`` or ``inspect`` is one module plus one line here.

Layer 5 (public). May import every private layer and the public modules; the subcommands import lazily.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

#: subcommand name -> module implementing it
SUBCOMMANDS: dict[str, str] = {
    "demo": "fastckpt.demo",
    "convert": "fastckpt.cli.convert",
    "verify": "fastckpt.cli.verify",
    "inspect": "fastckpt.cli.inspect",
    "consolidate": "fastckpt.cli.consolidate",
}


def _version() -> str:
    """This package's version: ``fastckpt-rs``'s (``fastckpt._version``); ``fastckpt`` on the package index is an
    unrelated project, whose version this used to print when it was installed (and "unknown" when it was not)."""
    from fastckpt._version import DISTRIBUTION, __version__

    return f"{__version__} ({DISTRIBUTION})"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per entry of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="fastckpt", description="Fast, pickle-free PyTorch checkpoints with a Rust core."
    )
    parser.add_argument("--version", action="version", version=f"fastckpt {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP,
                                  epilog=getattr(module, "EPILOG", None))
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


#: the path arguments of the subcommands (checked before a subcommand runs)
PATH_ARGUMENTS = ("path", "src", "dst", "out")
#: subcommands that also read a checkpoint in any storage ``fastckpt._io.storage.resolve`` serves (an ``s3://`` one is
#: fetched and checked against its manifest first): the argument
REMOTE_COMMANDS = {"verify": "path", "inspect": "path", "consolidate": "src", "convert": "src"}


def _refused_location(args: argparse.Namespace) -> str | None:
    """The message for a path argument whose URL scheme the command line does not serve, else None."""
    from fastckpt._io.location import check_location
    from fastckpt._io.storage.schemes import remote_scheme

    for name in PATH_ARGUMENTS:
        check = remote_scheme if REMOTE_COMMANDS.get(args.command) == name else check_location
        try:
            check(getattr(args, name, None), name.upper())
        except ValueError as exc:
            return str(exc)
    return None


def _run_on_copy(args: argparse.Namespace) -> int | None:
    """Run a :data:`REMOTE_COMMANDS` subcommand on its checkpoint's files: a local path is handed on as given
    (None: the caller runs the subcommand), a fetched copy (``view.copy``: an ``s3://`` checkpoint, every object's
    size and crc32c checked against the manifest while downloaded) is read from memory and named by its URL."""
    from fastckpt._io.storage import resolve
    from fastckpt.errors import CheckpointError

    name = REMOTE_COMMANDS.get(args.command)
    if name is None:
        return None
    with contextlib.ExitStack() as stack:
        try:
            view = stack.enter_context(resolve(getattr(args, name), what=name.upper()).as_local())
            if not view.copy:
                return None
            print(f"{view.location}: every object matches its manifest (sizes, crc32c); reading it from memory",
                  file=sys.stderr)
            setattr(args, name, str(view.path))
            with contextlib.redirect_stdout(_Renaming(sys.stdout, str(view.path), view.location)):
                return args.run(args)
        except CheckpointError as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, FileNotFoundError) else 1
        except (OSError, ValueError) as exc:
            print(f"fastckpt {args.command}: {exc}", file=sys.stderr)
            return 2


class _Renaming:
    """A text stream that writes ``old`` as ``new`` (a subcommand's output names the URL, not the fetched copy)."""

    def __init__(self, stream: Any, old: str, new: str) -> None:
        self._stream, self._old, self._new = stream, old, new

    def write(self, text: str) -> int:
        return self._stream.write(text.replace(self._old, self._new))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the chosen subcommand, return its exit status.

    Example:
        >>> main(["demo", "--size", "tiny", "--steps", "2"])  # doctest: +SKIP
        0
    """
    args = build_parser().parse_args(argv)
    refused = _refused_location(args)
    if refused is not None:
        print(f"fastckpt {args.command}: error: {refused}", file=sys.stderr)
        return 2
    try:
        status = _run_on_copy(args)
        status = args.run(args) if status is None else status
        sys.stdout.flush()  # surface a closed pipe here, not in the interpreter's shutdown
        return status
    except BrokenPipeError:
        # the reader went away (e.g. ``| head``): point stdout at devnull so the final flush cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a real file (captured): nothing to redirect
            pass
        finally:
            os.close(devnull)
        return 141

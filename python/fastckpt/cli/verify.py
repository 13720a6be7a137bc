"""``fastckpt verify DIR|FILE``: read every byte of a checkpoint and check it against what was recorded.

For a checkpoint folder, every file ``fastckpt.json`` lists is read (in one parallel pass of the Rust core, GIL
released) and its size, crc32c, and each tensor's crc32c are compared with the manifest; every damaged file and
tensor is named. For a lone ``.safetensors`` file, which records no checksums, the header is validated and every
byte read (a truncated or malformed file is reported), and its crc32c printed.

Exit status: 0 intact, 1 damaged (an ``IntegrityError`` or a malformed file), 2 not a checkpoint, unreadable, or a
usage error (e.g. ``--threads -3``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastckpt import _core
from fastckpt._io.integrity import check_checkpoint, crc_hex
from fastckpt.errors import CheckpointError, HeaderError, MissingStateError

__all__ = ["HELP", "EPILOG", "add_arguments", "run", "non_negative_int"]

HELP = "check a checkpoint folder (sizes, crc32c per file and per tensor) or a safetensors file, naming any damage"
EPILOG = ("exit status: 0 intact; 1 damaged (an IntegrityError, or a malformed file); "
          "2 not a checkpoint, unreadable, or a usage error")


def non_negative_int(text: str) -> int:
    """``argparse`` type for counts such as ``--threads``: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fastckpt verify`` flags (see :mod:`fastckpt.cli`)."""
    parser.add_argument("path", metavar="DIR|FILE", help="a checkpoint folder, or one .safetensors file")
    parser.add_argument("--threads", type=non_negative_int, default=0, help="reader threads (default 0: min(8, cores))")
    parser.add_argument("--quiet", "-q", action="store_true", help="print only problems and the summary line")


def _verify_folder(folder: Path, args: argparse.Namespace) -> int:
    report = check_checkpoint(folder, threads=args.threads)
    if not args.quiet:
        for name, status in report.files.items():
            tag = "ok  " if status == "ok" else "NOTE" if status.startswith("no checksum") else "BAD "
            print(f"  {tag} {name}" + (f": {status}" if tag == "NOTE" else ""))
    if report.ok:
        print(f"{folder}: intact: {len(report.files)} files, {report.tensors_checked} tensors "
              f"({report.hashes_checked} with xxh3-128 content hashes), {report.bytes_checked:,} bytes checked")
        return 0
    print(f"IntegrityError: {report.message()}", file=sys.stderr)
    print(f"{folder}: DAMAGED: {len(report.problems)} problem(s) in {len(report.files)} files")
    return 1


def _verify_file(path: Path, args: argparse.Namespace) -> int:
    file = _core.SafetensorsFile(str(path))  # full header validation
    ((size, crc, tensors, header_error),) = _core.checksum_files([str(path)], threads=args.threads)
    if header_error is not None:  # the file changed since it was opened
        raise HeaderError(header_error)
    if not args.quiet:
        for name, tcrc in tensors or []:
            print(f"  ok   {name}  crc32c {crc_hex(tcrc)}")
    print(f"{path}: valid safetensors file: {len(file.tensors())} tensors, {size:,} bytes read, crc32c {crc_hex(crc)} "
          "(a lone file records no checksums to compare with)")
    return 0


def run(args: argparse.Namespace) -> int:
    """Verify ``args.path``; returns the exit status (see the module docs)."""
    path = Path(args.path)
    try:
        if path.is_dir():
            return _verify_folder(path, args)
        return _verify_file(path, args)
    except MissingStateError as exc:
        print(f"fastckpt verify: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"fastckpt verify: {exc}", file=sys.stderr)
        return 2

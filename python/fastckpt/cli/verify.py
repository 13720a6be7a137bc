"""``fastckpt verify DIR|FILE``: read every byte of a checkpoint and check it against what was recorded.

For a checkpoint folder, every file ``fastckpt.json`` lists is read (in one parallel pass of the Rust core, GIL
released) and its size, crc32c, and each tensor's crc32c are compared with the manifest; every damaged file and
tensor is named. A ``.safetensors`` file of such a folder is checked against the manifest beside it. A lone
``.safetensors`` file, which records no checksums, and a stock accelerate folder (no manifest) have their headers
validated and every byte read (a truncated or malformed file is reported), and the crc32c printed. On a terminal a
progress bar shows for folders of 256 MiB or more.

Exit status: 0 intact, 1 damaged (an ``IntegrityError`` or a malformed file), 2 not a checkpoint, unreadable, or a
usage error (e.g. ``--threads -3``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastckpt import _core
from fastckpt._io.storage.local.integrity import VerifyReport, check_checkpoint, crc_hex
from fastckpt._io.storage.local.layout import MANIFEST, checkpoint_layout, read_manifest
from fastckpt.cli.progress import Progress
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
    if not (folder / MANIFEST).is_file() and checkpoint_layout(folder) == "accelerate":
        return _verify_accelerate(folder, args)
    with Progress(f"verify {folder.name}") as progress:
        report = check_checkpoint(folder, threads=args.threads, progress=progress)
    return _print_report(folder, report, args)


def _print_report(folder: Path, report: VerifyReport, args: argparse.Namespace) -> int:
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


def _verify_accelerate(folder: Path, args: argparse.Namespace) -> int:
    """A stock accelerate folder records no checksums: validate its safetensors headers and read every byte."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    tensor_files = [p for p in files if p.name.endswith(".safetensors")]
    for p in tensor_files:
        _core.SafetensorsFile(str(p))  # full header validation
    sums = _core.checksum_files([str(p) for p in files], threads=args.threads)
    if not args.quiet:
        for p, (size, crc, _tensors, _err) in zip(files, sums):
            print(f"  read {p.name}: {size:,} bytes, crc32c {crc_hex(crc)}")
    print(f"{folder}: an accelerate checkpoint (no {MANIFEST}), so it records no checksums to compare with: "
          f"{len(files)} files read, {len(tensor_files)} safetensors headers valid")
    return 0


def _verify_file(path: Path, args: argparse.Namespace) -> int:
    manifest = path.parent / MANIFEST
    if manifest.is_file() and path.name in read_manifest(path.parent, check_sizes=False).get("files", {}):
        report = check_checkpoint(path.parent, threads=args.threads, only=[path.name])  # use its recorded sums
        return _print_report(path, report, args)
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

"""Checksums of a checkpoint: recorded in the manifest as it is written, checked by ``verify``.

Every tensor also gets its xxh3-128 content hash (``"xxh3": {tensor: 32 hex digits}``, see ``_core.hash_tensors``),
the key by which unchanged tensors are recognised across checkpoints (:mod:`fastckpt._io.storage.local.sharing`); ``verify``
checks both. Every file of a checkpoint gets a crc32c (Castagnoli) of all its bytes in ``fastckpt.json``; every tensor of a
safetensors file also gets the crc32c of its data bytes, so a report names the damaged tensor::

    "files": {"model.safetensors": {"bytes": 1234, "crc32c": "8a9136aa",
                                    "tensors": {"fc1.weight": "0c1f6e2d", ...}},
              "scheduler.json": {"bytes": 310, "crc32c": "e3069283"}}

The Rust writer sums the bytes while it writes them (per chunk, by the thread that writes it; the chunks are
combined with ``crc32c_combine``), so recording costs no second pass. :func:`check_checkpoint` sums the files on
disk in one parallel pass in Rust (GIL released) and compares.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fastckpt import _core
from fastckpt._io.location import check_location
from fastckpt._io.storage.local.file_size import recorded_size_problem
from fastckpt._io.storage.local.layout import MANIFEST, count_problems, listed_files, read_manifest, unlisted_files
from fastckpt.errors import IntegrityError

__all__ = ["crc_hex", "digest_entry", "text_entry", "VerifyReport", "check_checkpoint", "verify_checkpoint"]


def crc_hex(value: int) -> str:
    """A crc32c as the manifest stores it: 8 lowercase hex digits."""
    return f"{value:08x}"


def digest_entry(digest: tuple) -> dict[str, Any]:
    """The manifest's checksum fields for a safetensors file from ``_core.write_files_checked``'s digest: the
    crc32c of the file and of each tensor, and each tensor's xxh3-128 content hash (``"xxh3"``)."""
    _size, crc, tensors, *rest = digest
    entry = {"crc32c": crc_hex(crc), "tensors": {name: crc_hex(t) for name, t in tensors}}
    if rest:
        entry["xxh3"] = dict(rest[0])
    return entry


def text_entry(data: bytes) -> dict[str, Any]:
    """The manifest's checksum fields for a small file written from ``data``."""
    return {"crc32c": crc_hex(_core.crc32c(data))}


@dataclass
class VerifyReport:
    """What :func:`check_checkpoint` found.

    Attributes:
        folder: the checkpoint folder (for an ``s3://`` checkpoint, its URL).
        files: ``{file name: "ok" | "no checksum recorded" | a problem}`` for every file the manifest lists.
        problems: one line per damage, each naming the file (and the tensor when one is known) and the numbers.
        tensors_checked: how many tensors had their crc32c compared.
        bytes_checked: bytes read and summed.
        hashes_checked: how many tensors had their xxh3-128 content hash compared (after their crc32c matched).
    """

    folder: Path | str
    files: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    tensors_checked: int = 0
    bytes_checked: int = 0
    hashes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def message(self) -> str:
        """The :class:`IntegrityError` message: every problem, one per line."""
        n = len(self.problems)
        return f"{self.folder}: {n} integrity problem{'s' if n != 1 else ''}:\n  " + "\n  ".join(self.problems)


def _compare(report: VerifyReport, name: str, info: dict, actual: tuple) -> None:
    path = report.folder / name
    size, crc, tensors, header_error = actual
    report.bytes_checked += size
    problems: list[str] = []
    want = info.get("crc32c")
    recorded = info.get("tensors")
    if isinstance(recorded, dict) and tensors is not None:
        got = dict(tensors)
        for tensor, want_t in recorded.items():
            if tensor not in got:
                problems.append(f"{path}: tensor {tensor!r} is recorded in {MANIFEST} but absent from the file")
            elif crc_hex(got[tensor]) != want_t:
                problems.append(
                    f"{path}: tensor {tensor!r}: crc32c {crc_hex(got[tensor])} on disk, {want_t} recorded in {MANIFEST}"
                )
            report.tensors_checked += 1
        for tensor in got.keys() - recorded.keys():
            problems.append(f"{path}: tensor {tensor!r} is in the file but not recorded in {MANIFEST}")
    elif isinstance(recorded, dict) and header_error is not None:
        problems.append(f"{path}: its header is damaged, so no tensor can be checked: {header_error}")
    if want is not None and crc_hex(crc) != want and not problems:
        where = " (outside every tensor: the header or its padding)" if isinstance(recorded, dict) else ""
        problems.append(f"{path}: crc32c {crc_hex(crc)} on disk, {want} recorded in {MANIFEST}{where}")
    if problems:
        report.files.setdefault(name, problems[0])
        report.problems += problems
    else:
        report.files.setdefault(name, "ok" if want is not None else "no checksum recorded")


def check_checkpoint(folder: str | os.PathLike[str], *, threads: int = 0, only: list[str] | None = None,
                     progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Read every file ``folder/fastckpt.json`` lists (a sharded save's part files under ``sharded.files`` too) and
    compare sizes and crc32c checksums; raise nothing for damage, return it in the report. A file a load would open
    (``model*`` / ``optimizer*`` / ``random_states_*`` safetensors, shard indexes, ``scheduler*.json``, part files)
    that the manifest does not list is a problem too ("not in the manifest").

    Args:
        folder: a checkpoint folder written by :func:`fastckpt.save_state`.
        threads: reader threads (0 = min(8, cores)); the files are summed in one parallel pass.
        only: check only these files of the manifest (e.g. the one file ``fastckpt verify FILE`` names).
        progress: ``progress(bytes_done, bytes_total)``, called after each file (the files are then summed one
            after the other, each in parallel); for progress bars.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` when nothing is damaged. Files written before checksums were
        recorded are reported as ``"no checksum recorded"`` (their sizes are still checked).

    Raises:
        MissingStateError: no manifest. HeaderError: a malformed manifest. OSError: a file cannot be read.
    """
    check_location(folder, "folder")
    folder = folder if isinstance(folder, Path) else Path(folder)
    manifest = read_manifest(folder, check_sizes=False, check_counts=False)
    report = VerifyReport(folder)

    present: list[str] = []
    files = listed_files(manifest)  # a sharded save's part files (``model/shard-...``) included
    for name in unlisted_files(folder, manifest):
        if only is None or name in only:
            problem = f"{folder / name}: not in the manifest ({MANIFEST} lists no such file), so nothing vouches for it"
            report.files[name] = problem
            report.problems.append(problem)
    if only is None:  # the files the counts promise and the manifest does not list (each named once)
        named = {str(folder / n) for n in report.files}
        report.problems += [p for p in count_problems(folder, manifest) if p.split(": ")[0] not in named]
    for name, info in files.items():
        if only is not None and name not in only:
            continue
        path = folder / name
        try:
            problem = recorded_size_problem(path, info["bytes"], MANIFEST)
        except FileNotFoundError:
            problem = f"{path}: listed in {MANIFEST} ({info['bytes']} bytes) but missing"
            report.files[name] = problem
            report.problems.append(problem)
            continue
        if problem is not None:
            report.files[name] = problem
            report.problems.append(problem)
            if not path.is_file():
                continue  # a folder (or pipe, ...) in its place: nothing to sum
        present.append(name)
    if progress is None:
        sums = _core.checksum_files([os.fspath(folder / n) for n in present], threads=threads)
    else:
        sums, done, total = [], 0, sum(files[n]["bytes"] for n in present)
        for name in present:
            sums += _core.checksum_files([os.fspath(folder / name)], threads=threads)
            done += files[name]["bytes"]
            progress(done, total)
    for name, actual in zip(present, sums):
        _compare(report, name, files[name], actual)
    hashed = [n for n in present if isinstance(files[n].get("xxh3"), dict) and report.files.get(n) == "ok"]
    for name, (tensors, _error) in zip(hashed, _core.hash_files([str(folder / n) for n in hashed], threads=threads)):
        got = dict(tensors or [])
        for tensor, want in files[name]["xxh3"].items():
            report.hashes_checked += 1
            if got.get(tensor) != want:
                problem = (f"{folder / name}: tensor {tensor!r}: xxh3-128 {got.get(tensor)} on disk, {want} recorded "
                           f"in {MANIFEST}")
                report.files[name] = problem
                report.problems.append(problem)
    return report


def verify_checkpoint(folder: str | os.PathLike[str], *, threads: int = 0,
                      progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """:func:`check_checkpoint`, raising when anything is damaged.

    Raises:
        IntegrityError: a file is missing, has another size, or a file or tensor has another crc32c than recorded;
            the message lists every problem with the file, the tensor and both values.
        MissingStateError, HeaderError, OSError: as :func:`check_checkpoint`.

    Example:
        >>> fastckpt.verify_checkpoint("checkpoints/checkpoint_3").tensors_checked
        42
    """
    report = check_checkpoint(folder, threads=threads, progress=progress)
    if not report.ok:
        raise IntegrityError(report.message())
    return report

"""Reading one checkpoint folder while other processes save over it: every file of a load comes from one save.

A save commits by putting a whole new folder in place (:mod:`fastckpt._io.storage.local.commit`), so a reader that opened files
one by one *by path* could take the model from one save and the optimizer from the next. :func:`pinned` opens the
folder once and returns a :class:`PinnedPath` for it: every path under it opens its file relative to that folder
handle (``/proc/self/fd/N/name``), so all files come from the folder inode the load started with, while messages
still name the real path. On top of that each file is tied to the manifest read first:

- safetensors files of an in-place commit (:mod:`fastckpt._io.storage.local.in_place`, whose files are renamed into the folder one
  by one) carry the manifest's ``save_id`` in their metadata; every safetensors file has its size compared with the
  manifest's record on open, and (unless the load passed ``verify=False``) every byte of it summed by the Rust core
  (:meth:`fastckpt._core.SafetensorsFile.verify`: the crc32c of each tensor and of the whole file) before any of
  its bytes reaches a live object. A load whose phase 1 writes nothing live pins with ``defer=True``: tensors read
  into fresh memory (:func:`read_fresh`) are summed as they are read, in the one pass, and the rest of each file
  (the tensors bound for live memory, read again in phase 2 from the page cache, and the header) is summed when
  the block ends, before phase 2;
- small files read whole (JSON: scheduler, shard index, object states) have size and crc32c compared likewise;
- a file the manifest does not list (a hand-edited manifest) is refused: :class:`~fastckpt.errors.IntegrityError`;
- the folder removed under the reader (the previous checkpoint deleted after the commit), a manifest that changed
  since it was read, or a file that no longer matches it: :class:`~fastckpt.errors.CheckpointChangedError`, raised
  before anything is applied (``load_state`` retries).

A mismatch in a folder that nobody changed is damage, not a race: :class:`~fastckpt.errors.IntegrityError`.
Without ``/proc/self/fd`` (not Linux) paths are used as given and only the manifest checks apply.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path, PosixPath
from typing import Any, Iterator

from fastckpt import _core
from fastckpt._format.json_input import load_json
from fastckpt._io.log import log_file
from fastckpt._io.storage.local.in_place import LOCK_NAME
from fastckpt._io.storage.local.layout import MANIFEST, SAVE_ID_KEY
from fastckpt.errors import (
    CheckpointChangedError,
    CheckpointError,
    DtypeError,
    HeaderError,
    IntegrityError,
    MissingStateError,
)

__all__ = ["PinnedPath", "pinned", "open_safetensors", "opened_files", "verify_file", "read_checked_json", "read_fresh",
           "RETRIES"]

#: How many times ``load_state`` starts over when another save changed the folder under it.
RETRIES = 5

_PROC_FD = "/proc/self/fd"
_pins: dict[str, _Pin] = {}  # "/proc/self/fd/N" -> its pin
_pins_lock = threading.Lock()


class _Pin:
    """An opened folder: its fd, the name to show, and the manifest as first read through it."""

    def __init__(self, fd: int, shown: str, *, verify: bool = True, threads: int = 0, defer: bool = False) -> None:
        self.fd = fd
        self.verify = verify  # sum every safetensors file opened (see the module docs)
        self.defer = defer  # sum at the end of the pin what :func:`read_fresh` did not sum as it read
        self.threads = threads
        # id(file) -> (file, record, {tensor: crc32c summed as read}): files whose sums are still owed
        self.pending: dict[int, tuple[Any, dict, dict[str, int]]] = {}
        self.shown = shown
        self.prefix = f"{_PROC_FD}/{fd}"
        self.manifest_bytes: bytes | None = None
        self.files: dict[str, Any] = {}
        self.listed = False  # whether the manifest lists the files a load may open (fastckpt's layouts)
        self.save_id: str | None = None
        self.opened: dict[str, int] = {}  # file -> bytes, for the load's log line

    def note_manifest(self, data: bytes) -> None:
        if self.manifest_bytes is None:
            self.manifest_bytes = data
            try:
                manifest = load_json(data, "fastckpt.json", object)
            except (ValueError, RecursionError):  # a later, typed read names what is wrong
                return
            if isinstance(manifest, dict):
                files = manifest.get("files")
                self.files = files if isinstance(files, dict) else {}
                self.listed = isinstance(files, dict) and manifest.get("layout") != "dcp"
                save_id = manifest.get("save_id")
                self.save_id = save_id if isinstance(save_id, str) else None
        elif data != self.manifest_bytes:
            raise CheckpointChangedError(
                f"{self.shown}/{MANIFEST}: changed while the checkpoint was being read (another save committed "
                "into the folder); nothing was changed, retry the load"
            )

    def replaced(self) -> bool:
        """Whether another save changed the folder since it was opened."""
        try:
            st = os.fstat(self.fd)
            if st.st_nlink == 0:
                return True  # removed: a newer checkpoint took its place
            now = os.stat(self.shown)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return True  # another folder sits at the path now (ours is being removed)
        except OSError:
            return True
        if _save_in_progress(self.prefix):
            return True
        if self.manifest_bytes is None:
            return False  # no manifest was read (a stock accelerate folder): nothing to compare with
        try:
            with open(f"{self.prefix}/{MANIFEST}", "rb") as f:
                return f.read() != self.manifest_bytes
        except OSError:
            return True

    def mismatch(self, name: str, what: str) -> CheckpointError:
        where = f"{self.shown}/{name}"
        if self.replaced():
            return CheckpointChangedError(f"{where}: {what}: another save replaced the checkpoint while it was being "
                                          "read; nothing was changed, retry the load")
        return IntegrityError(f"{where}: {what} (the file is damaged)")

    def check(self, name: str, size: int, data: Any = None, save_id: str | None = None) -> None:
        """``name``'s size (and crc32c of ``data``, save id) against the manifest read first."""
        if self.save_id is not None and save_id is not None and save_id != self.save_id:
            raise self.mismatch(name, f"holds save {save_id}, {MANIFEST} records save {self.save_id}")
        info = self.files.get(name)
        if info is None and self.listed:
            raise self.mismatch(name, f"not in the manifest ({MANIFEST} lists no such file), so nothing vouches for "
                                      "it; it is not loaded")
        if not isinstance(info, dict):
            return
        if info.get("bytes") != size:
            raise self.mismatch(name, f"{size} bytes, {info.get('bytes')} recorded in {MANIFEST}")
        want = info.get("crc32c")
        if data is not None and isinstance(want, str):
            got = f"{_core.crc32c(data):08x}"
            if got != want:
                raise self.mismatch(name, f"crc32c {got}, {want} recorded in {MANIFEST}")


def _save_in_progress(folder: str) -> bool:
    """Whether an in-place save holds the folder's lock (:mod:`fastckpt._io.storage.local.in_place`) right now."""
    try:
        fd = os.open(f"{folder}/{LOCK_NAME}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _pin_of(raw: str) -> tuple[_Pin, str] | None:
    """(pin, rest of the path) for a ``/proc/self/fd/N[/...]`` path of an open pin."""
    if not raw.startswith(_PROC_FD + "/"):
        return None
    head, _, rest = raw[len(_PROC_FD) + 1:].partition("/")
    pin = _pins.get(f"{_PROC_FD}/{head}")
    return (pin, rest) if pin is not None else None


class PinnedPath(PosixPath):
    """A path under a pinned folder: opens ``/proc/self/fd/N/...`` (``os.fspath``), prints the real path (``str``).

    Everything pathlib does through ``os.fspath`` (``open``, ``stat``, ``is_file``, ``iterdir``) goes through the
    folder handle; :meth:`read_bytes` / :meth:`read_text` also check the file against the manifest read first.
    """

    def __fspath__(self) -> str:
        return super().__str__()

    def __str__(self) -> str:
        raw = super().__str__()
        found = _pin_of(raw)
        if found is None:
            return raw
        pin, rest = found
        return f"{pin.shown}/{rest}" if rest else pin.shown

    def __repr__(self) -> str:
        return f"PinnedPath({str(self)!r})"

    @property
    def name(self) -> str:  # type: ignore[override]
        return Path(str(self)).name  # the pinned folder's own name, not the fd number

    def read_bytes(self) -> bytes:
        try:
            with open(os.fspath(self), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            found = _pin_of(os.fspath(self))
            if found is not None and found[0].replaced():
                raise found[0].mismatch(found[1], "vanished") from None
            raise
        found = _pin_of(os.fspath(self))
        if found is not None and "/" not in found[1]:
            pin, name = found
            if name == MANIFEST:
                pin.note_manifest(data)
            else:
                pin.check(name, len(data), data)
            pin.opened[name] = len(data)
        log_file("read", self, len(data))
        return data

    def read_text(self, encoding: str | None = None, errors: str | None = None) -> str:  # type: ignore[override]
        return self.read_bytes().decode(encoding or "utf-8", errors or "strict")


def open_safetensors(path: Path) -> Any:
    """``fastckpt._core.SafetensorsFile`` of ``path``: through the folder handle for a :class:`PinnedPath`, checked
    against its manifest (see the module docs)."""
    found = _pin_of(os.fspath(path)) if isinstance(path, PinnedPath) else None
    if found is None:
        file = _core.SafetensorsFile(str(path))
    else:
        pin, name = found
        try:
            file = _core.SafetensorsFile(str(path), open_path=os.fspath(path))
        except FileNotFoundError:
            if pin.replaced():
                raise pin.mismatch(name, "vanished") from None
            raise
        if "/" not in name:
            pin.check(name, file.file_size, None, (file.metadata() or {}).get(SAVE_ID_KEY))
            if pin.verify:
                record = pin.files.get(name)
                if pin.defer and _sums(record) is not None:
                    pin.pending[id(file)] = (file, record, {})
                else:
                    verify_file(file, record, threads=pin.threads)
            pin.opened[name] = file.file_size
    log_file("opened", path, file.file_size)
    return file


def opened_files(path: Path) -> dict[str, int]:
    """``{file name: bytes}`` of the parts read so far through the pinned folder ``path`` (the manifest not
    counted; empty for a plain path)."""
    found = _pin_of(os.fspath(path)) if isinstance(path, PinnedPath) else None
    return {k: v for k, v in found[0].opened.items() if k != MANIFEST} if found is not None else {}


def _sums(record: Any) -> tuple[int | None, dict[str, int]] | None:
    """(whole-file crc32c, {tensor: crc32c}) of a manifest record, None when it records neither."""
    if not isinstance(record, dict):
        return None
    crc, tensors = record.get("crc32c"), record.get("tensors")
    if not (isinstance(crc, str) or isinstance(tensors, dict)):
        return None
    return (int(crc, 16) if isinstance(crc, str) else None,
            {n: int(h, 16) for n, h in (tensors or {}).items()})


def verify_file(file: Any, record: Any, *, threads: int = 0, summed: dict[str, int] | None = None) -> None:
    """Sum every byte of the opened ``file`` and compare with its manifest ``record`` (``{"crc32c", "tensors"}``;
    nothing is checked for a record without them). ``summed``: ``{tensor: crc32c}`` already summed as
    :func:`read_fresh` read them (not read again).

    Raises:
        IntegrityError: a tensor (named, with both crc32c values) or the header differs from the record.
    """
    sums = _sums(record)
    if sums is None:
        return
    file_crc, tensors = sums
    done = summed or {}
    file.verify([(n, c) for n, c in tensors.items() if n not in done], file_crc32c=file_crc, recorded_in=MANIFEST,
                threads=threads, summed=list(done.items()))


def read_checked_json(folder: Path, name: str, what: str, record: Any = None) -> Any:
    """The JSON file ``name`` of the checkpoint ``folder`` (a pinned handle or a plain folder), parsed, its bytes
    checked against its manifest ``record`` (``{"crc32c"}``; nothing checked without one) before they are parsed.

    Args:
        folder: the checkpoint folder. name: the file in it (``"optimizer.json"``). what: what needs it, for the
            message (``"optimizer 0"``). record: the manifest's entry of the file, or None.

    Returns:
        The parsed JSON value (``dict``, ``list``, ...).

    Raises:
        MissingStateError: the file is absent (names ``what`` and the file). IntegrityError: its crc32c differs
            from the record (both values). HeaderError: not valid JSON.

    Example:
        >>> state = read_checked_json(folder, "optimizer.json", "optimizer 0", manifest["files"].get("optimizer.json"))  # doctest: +SKIP
    """
    path = folder / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise MissingStateError(f"{folder}: {what} needs {name}, which the checkpoint does not hold") from None
    want = record.get("crc32c") if isinstance(record, dict) else None
    got = f"{_core.crc32c(data):08x}"
    if isinstance(want, str) and got != want:
        raise IntegrityError(f"{path}: crc32c {got} read, {want} recorded in {MANIFEST} (the file is damaged); "
                             "nothing was changed")
    return load_json(data, f"{path}: not a valid fastckpt JSON file")


def read_fresh(file: Any, targets: list[tuple[str, Any]], *, threads: int = 0) -> None:
    """``file.read_into(targets)`` for buffers of fresh memory (no live object sees them before the load applies):
    a file whose sums a pinned load still owes has each target summed as it is read (one pass over the bytes), and
    those tensors are not read again by the pin's final check.

    Raises:
        IntegrityError: a target's bytes differ from the manifest's crc32c (the targets hold what was read).
        As ``SafetensorsFile.read_into`` otherwise.
    """
    if hasattr(file, "read_fresh"):  # several shards read as one (fastckpt._io.storage.local.shards.ShardedFile)
        file.read_fresh(targets, threads=threads)
        return
    found = next((pin.pending[id(file)] for pin in list(_pins.values()) if id(file) in pin.pending), None)
    if found is None:
        file.read_into(targets, threads=threads)
        return
    _, record, summed = found
    want = (_sums(record) or (None, {}))[1]
    expect = [want.get(name) for name, _ in targets]
    file.read_into(targets, threads=threads, expect=expect, recorded_in=MANIFEST)
    summed.update((name, crc) for (name, _), crc in zip(targets, expect) if crc is not None)


def _finish(pin: _Pin) -> None:
    """Sum what the pin's files still owe (every byte :func:`read_fresh` did not sum, the headers included)."""
    while pin.pending:
        _, (file, record, summed) = pin.pending.popitem()
        verify_file(file, record, threads=pin.threads, summed=summed)


@contextlib.contextmanager
def pinned(folder: Path, *, verify: bool = True, threads: int = 0, defer: bool = False) -> Iterator[Path]:
    """Open ``folder`` once; yield a :class:`PinnedPath` for it (``folder`` itself without ``/proc/self/fd``).

    ``verify``: sum every safetensors file opened through it against the manifest (see the module docs);
    ``threads``: for those sums (0 = min(8, cores)). ``defer``: sum each file when the block ends instead of when
    it is opened, except the tensors :func:`read_fresh` summed as it read them; only for a block that writes
    nothing live (phase 1 of a load), since its reads are checked only when it ends. Without ``/proc/self/fd``
    every file is summed when opened.

    An error raised inside, when another save changed the folder meanwhile, becomes
    :class:`~fastckpt.errors.CheckpointChangedError` (the error it replaced is its cause).
    """
    if not os.path.isdir(_PROC_FD):
        yield folder
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    pin = _Pin(fd, str(folder), verify=verify, threads=threads, defer=defer)
    with _pins_lock:
        _pins[pin.prefix] = pin
    try:
        yield PinnedPath(pin.prefix)
        _finish(pin)
    except CheckpointChangedError:
        raise
    except (CheckpointError, OSError) as exc:
        if pin.replaced():
            raise CheckpointChangedError(
                f"{folder}: another save replaced the checkpoint while it was being read ({exc}); nothing was "
                "changed, retry the load"
            ) from exc
        if isinstance(exc, (DtypeError, HeaderError)) and pin.pending:
            # What a header says (a dtype, a shape, an offset) may be a damaged byte: the sums the block still owes
            # come first, so a damaged file is reported as such, not as a mismatch a cast would "fix".
            try:
                _finish(pin)
            except IntegrityError as damaged:
                raise damaged from exc
        raise
    finally:
        with _pins_lock:
            del _pins[pin.prefix]
        os.close(fd)

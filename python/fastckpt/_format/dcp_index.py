"""``dcp_index.bin``: the chunk index of a DCP-format folder, so that a rank reads only the chunks its boxes overlap.

``dcp_metadata.json`` lists every chunk of every tensor (N chunks per tensor at N ranks), and every rank of a load
used to parse all of it. The coordinator of a save also writes this index (listed in the manifest with its
crc32c); a reader parses its small header (one entry per tensor, not per chunk) and looks up, by binary search,
the chunks a box overlaps, so one rank's work does not grow with the world size. The full metadata stays in the
folder for tools (``fastckpt consolidate``, ``fastckpt verify``) and for readers that do not know the index.

Layout (little-endian)::

    b"FCKDCPIX"  u32 version (1)  u32 crc32c of the header  u64 header bytes  header (JSON)  body

The header::

    {"format": "fastckpt-dcp-index", "format_version": 1, "metadata_crc32c": "<crc32c of dcp_metadata.json>",
     "dcp_version": ..., "planner_data": ..., "storage_meta": ..., "objects": {fqn: codec value},
     "files": {"world": N, "extra": [name, ...]}, "names": [name, ...], "aliases": [fqn, ...],
     "tensors": {fqn: {"dtype": "F32", "size": [8, 4], "n": 2, "sweep": 0, "reach": 4, "columns": [...]}}}

A tensor's chunks are sorted by their offset along ``sweep`` (the dimension with the most distinct offsets), then
by the other offsets; ``reach`` is their largest size along ``sweep``. ``columns`` describe, in order, each
dimension's offsets, each dimension's sizes, the file and the name of the n chunks; each column is
``{"c": v}`` (every chunk v), ``{"a": [v0, d]}`` (chunk i: v0 + i*d), ``{"t": [v0, d, [w0, ...]]}`` (chunk i:
v0 + i*d, except the last k chunks, which are w0, ... ; k <= 16: torch.chunk's uneven split, whose last blocks are
shorter) or ``{"e": [byte offset, crc32c]}`` (n int64 in the body at that offset, with their crc32c), so a regular
sharding (FSDP2's ``Shard(0)``, even or not) costs a few bytes per tensor whatever the world size. A file column value f < N is ``shard-{f:05d}-of-{N:05d}.safetensors``, f >= N is
``extra[f - N]``. A name column value -1 is the chunk's canonical name (:func:`chunk_name`), -2 - k the canonical
name of ``aliases[k]`` at the same offsets (a tied weight stored once), k >= 0 is ``names[k]``.

This module reads it (:class:`ChunkIndex`); :mod:`fastckpt._format.dcp_index_write` writes it.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from fastckpt import _core
from fastckpt._format.dcp_metadata import ChunkLocation, is_plain_file_name
from fastckpt._format.dtypes import to_torch_dtype
from fastckpt._format.json_input import load_json
from fastckpt.errors import DtypeError, HeaderError

__all__ = ["INDEX_FILE", "chunk_name", "shard_file_name", "shard_rank", "ChunkIndex", "Found"]

INDEX_FILE = "dcp_index.bin"
FORMAT = "fastckpt-dcp-index"
MAGIC = b"FCKDCPIX"
_PREFIX = struct.Struct("<8sIIQ")
#: values a column may list after its arithmetic run (``{"t": ...}``)
MAX_TAIL = 16
#: header bytes a reader accepts (one entry per tensor: megabytes for the largest models)
MAX_HEADER_BYTES = 256 << 20



def shard_file_name(rank: int, world_size: int) -> str:
    """``shard-00000-of-00002.safetensors``: the chunks rank ``rank`` writes (ranks count from 0)."""
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def shard_rank(file: str, world_size: int) -> int | None:
    """The rank r whose :func:`shard_file_name` ``file`` is (``0 <= r < world_size``), else None."""
    suffix = f"-of-{world_size:05d}.safetensors"
    if file.startswith("shard-") and file.endswith(suffix):
        digits = file[len("shard-"):-len(suffix)]
        if digits.isdigit() and int(digits) < world_size and shard_file_name(int(digits), world_size) == file:
            return int(digits)
    return None


def chunk_name(fqn: str, offsets: Any, sizes: Any, full: Any) -> str:
    """The tensor name a chunk has in its shard file: ``fqn`` for a whole tensor, else ``fqn@o0,o1,...``."""
    offs = [int(o) for o in offsets]
    if list(sizes) == list(full) and not any(offs):
        return fqn
    return f"{fqn}@{','.join(map(str, offs))}"


class Found:
    """Chunks of one tensor an index lookup returned: ``offsets`` and ``sizes`` (int64, ``[k, ndim]``) and
    :meth:`location` of each."""

    def __init__(self, index: ChunkIndex, fqn: str, offsets: np.ndarray, sizes: np.ndarray, files: np.ndarray,
                 names: np.ndarray) -> None:
        self.index, self.fqn = index, fqn
        self.offsets, self.sizes, self.files, self.names = offsets, sizes, files, names

    def __len__(self) -> int:
        return len(self.files)

    def location(self, i: int) -> ChunkLocation:
        return ChunkLocation(self.index.file_name(int(self.files[i])),
                             self.index.chunk_name(self.fqn, int(self.names[i]), self.offsets[i], self.sizes[i]))


class ChunkIndex:
    """A parsed ``dcp_index.bin`` (hostile input: anything malformed is a HeaderError naming ``where``).

    The header is parsed and checked whole; a tensor's stored columns are read (and their crc32c checked) the first
    time a lookup needs them. :attr:`bytes_read` counts the bytes looked at.

    Args:
        data: the file's bytes (an ``mmap`` or bytes: only the header and the columns used are touched).
        where: the file's path, for messages.
    """

    def __init__(self, data: Any, where: str) -> None:
        self.where = where
        self._data = memoryview(data).cast("B")
        if len(self._data) < _PREFIX.size:
            raise HeaderError(f"{where}: {len(self._data)} bytes, too short for a {FORMAT} file")
        magic, version, crc, length = _PREFIX.unpack_from(self._data, 0)
        if magic != MAGIC or version != 1:
            raise HeaderError(f"{where}: not a {FORMAT} version 1 file (magic {bytes(magic)[:8]!r}, version {version})")
        if length > min(MAX_HEADER_BYTES, len(self._data) - _PREFIX.size):
            raise HeaderError(f"{where}: a header of {length} bytes in a file of {len(self._data)}")
        text = self._data[_PREFIX.size:_PREFIX.size + length]
        if _core.crc32c(text) != crc:
            raise HeaderError(f"{where}: header crc32c {_core.crc32c(text):08x}, {crc:08x} recorded (the file is "
                              "damaged)")
        self._body = _PREFIX.size + length
        self.bytes_read = _PREFIX.size + length
        doc = load_json(bytes(text), where)
        if doc.get("format") != FORMAT or doc.get("format_version") != 1:
            raise HeaderError(f"{where}: not a {FORMAT} version 1 header")
        self.doc = doc
        files = doc.get("files")
        if not isinstance(files, dict) or not isinstance(files.get("world"), int) or files["world"] < 0 \
                or not isinstance(files.get("extra"), list) or not all(is_plain_file_name(f) for f in files["extra"]):
            raise HeaderError(f"{where}: 'files' must be {{'world': int, 'extra': [file names]}}")
        self.world, self._extra = files["world"], files["extra"]
        self._names, self._aliases = doc.get("names"), doc.get("aliases")
        if not isinstance(self._names, list) or not all(isinstance(n, str) for n in self._names) \
                or not isinstance(self._aliases, list) or not all(isinstance(n, str) for n in self._aliases):
            raise HeaderError(f"{where}: 'names' and 'aliases' must be lists of str")
        self.tensors: dict[str, dict[str, Any]] = {}
        entries = doc.get("tensors")
        if not isinstance(entries, dict):
            raise HeaderError(f"{where}: 'tensors' must be an object")
        for fqn, entry in entries.items():
            self.tensors[fqn] = self._check_entry(fqn, entry)
        objects = doc.get("objects")
        if not isinstance(objects, dict) or set(objects) & set(entries):
            raise HeaderError(f"{where}: 'objects' must be an object naming no tensor")
        self._columns: dict[str, list[np.ndarray | None]] = {}

    def _check_entry(self, fqn: str, entry: Any) -> dict[str, Any]:
        at = f"{self.where}: tensors[{fqn[:200]!r}]"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "size", "n", "sweep", "reach", "columns"}:
            raise HeaderError(f"{at}: needs exactly dtype, size, n, sweep, reach, columns")
        try:
            to_torch_dtype(entry["dtype"], name=fqn, path=self.where)
        except (DtypeError, TypeError) as exc:
            raise HeaderError(f"{at}: {exc}") from None
        size, n, sweep, cols = entry["size"], entry["n"], entry["sweep"], entry["columns"]
        ints = (size if isinstance(size, list) else [None]) + [n, sweep, entry["reach"]]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints) \
                or len(size) > _core.MAX_DCP_RANK or (size and sweep >= len(size)):
            raise HeaderError(f"{at}: size, n, sweep and reach must be non-negative integers (sweep a dimension)")
        if not size and n != 1:
            raise HeaderError(f"{at}: a 0-d tensor has one chunk, {n} recorded")
        if not isinstance(cols, list) or len(cols) != 2 * len(size) + 2:
            raise HeaderError(f"{at}: {2 * len(size) + 2} columns expected")
        for c in cols:
            ok = isinstance(c, dict) and len(c) == 1 and (
                ("c" in c and isinstance(c["c"], int)) or ("a" in c and isinstance(c["a"], list) and len(c["a"]) == 2
                                                            and all(isinstance(v, int) for v in c["a"]))
                or ("e" in c and isinstance(c["e"], list) and len(c["e"]) == 2 and isinstance(c["e"][0], int)
                    and c["e"][0] >= 0 and c["e"][0] % 8 == 0 and isinstance(c["e"][1], str))
                or ("t" in c and isinstance(c["t"], list) and len(c["t"]) == 3
                    and all(isinstance(v, int) for v in c["t"][:2]) and isinstance(c["t"][2], list)
                    and 0 < len(c["t"][2]) <= min(n, MAX_TAIL) and all(isinstance(v, int) for v in c["t"][2])))
            if not ok:
                raise HeaderError(f"{at}: a malformed column {str(c)[:100]}")
        return entry

    # -- the header --------------------------------------------------------------------------------------------
    @property
    def objects(self) -> dict[str, Any]:
        return self.doc["objects"]

    def file_name(self, file_id: int) -> str:
        if 0 <= file_id < self.world:
            return shard_file_name(file_id, self.world)
        if self.world <= file_id < self.world + len(self._extra):
            return self._extra[file_id - self.world]
        raise HeaderError(f"{self.where}: file id {file_id} names no file")

    def chunk_name(self, fqn: str, name_id: int, offsets: Any, sizes: Any) -> str:
        size = self.tensors[fqn]["size"]
        if name_id == -1:
            return chunk_name(fqn, offsets, sizes, size)
        if name_id <= -2 and -2 - name_id < len(self._aliases):
            return chunk_name(self._aliases[-2 - name_id], offsets, sizes, size)
        if 0 <= name_id < len(self._names):
            return self._names[name_id]
        raise HeaderError(f"{self.where}: name id {name_id} of {fqn!r} names nothing")

    # -- the columns -------------------------------------------------------------------------------------------
    def _column(self, fqn: str, k: int) -> Any:
        """Column ``k`` of ``fqn``: an int64 array, or a ("c", v) / ("a", v0, d) description."""
        spec = self.tensors[fqn]["columns"][k]
        if "c" in spec:
            return ("c", spec["c"])
        if "a" in spec:
            return ("a", *spec["a"])
        if "t" in spec:
            v0, step, tail = spec["t"]
            return ("t", v0, step, np.array(tail, dtype=np.int64), self.tensors[fqn]["n"] - len(tail))
        cached = self._columns.setdefault(fqn, [None] * len(self.tensors[fqn]["columns"]))
        if cached[k] is None:
            n = self.tensors[fqn]["n"]
            start = self._body + spec["e"][0]
            raw = self._data[start:start + 8 * n]
            if len(raw) != 8 * n:
                raise HeaderError(f"{self.where}: column {k} of {fqn!r} reaches past the end of the file")
            if f"{_core.crc32c(raw):08x}" != spec["e"][1]:
                raise HeaderError(f"{self.where}: column {k} of {fqn!r}: crc32c {_core.crc32c(raw):08x}, "
                                  f"{spec['e'][1]} recorded (the file is damaged)")
            self.bytes_read += 8 * n
            cached[k] = np.frombuffer(raw, dtype="<i8")
        return cached[k]

    def _slice(self, fqn: str, k: int, lo: int, hi: int) -> np.ndarray:
        col = self._column(fqn, k)
        if isinstance(col, tuple):
            if col[0] == "c":
                return np.full(hi - lo, col[1], dtype=np.int64)
            out = col[1] + col[2] * np.arange(lo, hi, dtype=np.int64)
            if col[0] == "t" and hi > col[4]:  # the rows from the tail's start on are the tail's
                start = max(lo, col[4])
                out[start - lo:] = col[3][start - col[4]:hi - col[4]]
            return out
        return col[lo:hi]

    def _search(self, fqn: str, k: int, value: int) -> int:
        """The first chunk whose column ``k`` (sorted ascending) is >= ``value``."""
        n = self.tensors[fqn]["n"]
        col = self._column(fqn, k)
        if isinstance(col, tuple):
            run = col[4] if col[0] == "t" else n  # rows of the arithmetic run (a "t" column's tail follows)
            if col[0] == "c" or col[2] == 0:
                found = 0 if value <= col[1] else run
            elif col[2] < 0:
                raise HeaderError(f"{self.where}: {fqn!r}: chunks not sorted along their sweep dimension")
            else:
                found = min(run, max(0, -(-(value - col[1]) // col[2])))
            if found < run or col[0] != "t":
                return found
            tail = col[3]
            if (np.diff(tail) < 0).any() or (run and tail[0] < col[1] + col[2] * (run - 1)):
                raise HeaderError(f"{self.where}: {fqn!r}: chunks not sorted along their sweep dimension")
            return run + int(np.searchsorted(tail, value, side="left"))
        return int(np.searchsorted(col, value, side="left"))

    def _window(self, fqn: str, lo: int, hi: int) -> Found:
        ndim = len(self.tensors[fqn]["size"])
        cols = [self._slice(fqn, k, lo, hi) for k in range(2 * ndim + 2)]
        offs = np.stack(cols[:ndim], axis=1) if ndim else np.zeros((hi - lo, 0), dtype=np.int64)
        sizes = np.stack(cols[ndim:2 * ndim], axis=1) if ndim else np.zeros((hi - lo, 0), dtype=np.int64)
        return Found(self, fqn, offs, sizes, cols[2 * ndim], cols[2 * ndim + 1])

    def _check_found(self, fqn: str, found: Found) -> None:
        size = np.asarray(self.tensors[fqn]["size"], dtype=np.int64)
        if len(found) and ((found.offsets < 0).any() or (found.sizes < 0).any()
                           or (found.offsets + found.sizes > size).any()):
            raise HeaderError(f"{self.where}: a chunk of {fqn!r} reaches past its size {size.tolist()}")

    def all_chunks(self, fqn: str) -> Found:
        """Every chunk of ``fqn`` (what a reader that does not narrow its boxes needs; reads every column)."""
        found = self._window(fqn, 0, self.tensors[fqn]["n"])
        self._check_found(fqn, found)
        return found

    def overlapping(self, fqn: str, offsets: Any, lengths: Any) -> Found:
        """The non-empty chunks of ``fqn`` that a box ``[offsets, offsets + lengths)`` overlaps (a binary search
        along the sweep dimension, then a test of the chunks in reach of the box)."""
        entry = self.tensors[fqn]
        ndim = len(entry["size"])
        if not ndim:
            found = self._window(fqn, 0, entry["n"])
        else:
            s = entry["sweep"]
            lo = self._search(fqn, s, int(offsets[s]) - entry["reach"] + 1)
            hi = self._search(fqn, s, int(offsets[s]) + int(lengths[s]))
            found = self._window(fqn, lo, max(lo, hi))
            box_lo = np.asarray([int(o) for o in offsets], dtype=np.int64)
            box_hi = box_lo + np.asarray([int(n) for n in lengths], dtype=np.int64)
            keep = ((found.offsets < box_hi) & (found.offsets + found.sizes > box_lo) & (found.sizes > 0)).all(axis=1)
            found = Found(self, fqn, found.offsets[keep], found.sizes[keep], found.files[keep], found.names[keep])
        self._check_found(fqn, found)
        return found

    def find(self, fqn: str, offsets: Any) -> tuple[ChunkLocation, list[int]]:
        """The location and sizes of the chunk of ``fqn`` stored at ``offsets``.

        Raises:
            HeaderError: the index has no such chunk.
        """
        entry = self.tensors.get(fqn)
        offs = [int(o) for o in offsets]
        if entry is not None and len(offs) == len(entry["size"]):
            if offs:
                s = entry["sweep"]
                lo, hi = self._search(fqn, s, offs[s]), self._search(fqn, s, offs[s] + 1)
            else:
                lo, hi = 0, entry["n"]
            found = self._window(fqn, lo, max(lo, hi))
            hits = np.flatnonzero((found.offsets == np.asarray(offs, dtype=np.int64)).all(axis=1))
            if len(hits):
                i = int(hits[0])
                return found.location(i), found.sizes[i].tolist()
        raise HeaderError(f"{self.where}: no chunk of {fqn!r} at offsets {offs}")

    def covers(self, fqn: str, offsets: Any, lengths: Any, found: Found) -> bool:
        """Whether the chunks ``found`` fill the box exactly (no two overlap inside it, no element left out)."""
        box_lo = np.asarray([int(o) for o in offsets], dtype=np.int64)
        box_hi = box_lo + np.asarray([int(n) for n in lengths], dtype=np.int64)
        lo = np.maximum(found.offsets, box_lo)
        hi = np.minimum(found.offsets + found.sizes, box_hi)
        volume = int(np.prod(np.maximum(hi - lo, 0), axis=1).sum()) if len(found) else 0
        if volume != math.prod(int(n) for n in lengths):
            return False
        boxes = sorted((lo[i].tolist(), hi[i].tolist()) for i in range(len(found)) if (hi[i] > lo[i]).all())
        active: list[tuple[list[int], list[int]]] = []  # a sweep along dim 0, as dcp_metadata's cover check
        for a_lo, a_hi in boxes:
            active = [(b_lo, b_hi) for b_lo, b_hi in active if not a_lo or b_hi[0] > a_lo[0]]
            if any(all(x < v and y < u for x, u, y, v in zip(a_lo, a_hi, b_lo, b_hi)) for b_lo, b_hi in active):
                return False
            active.append((a_lo, a_hi))
        return True

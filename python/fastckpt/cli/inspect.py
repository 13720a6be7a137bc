"""``fastckpt inspect DIR|FILE``: what a checkpoint holds, without loading any tensor.

For a checkpoint folder: the manifest's mode, step, versions and part counts; every file with its size and crc32c
(a sharded save's part files too, as ``model/shard-...safetensors``);
then, for every safetensors file, its tensors (name, dtype, shape, bytes) in file order and its metadata keys.
For a lone ``.safetensors`` file: its tensors and metadata. Only headers are read (each is fully validated).
``--json`` prints the same as one JSON object. In the tables, names holding control or other non-printable characters
are printed escaped (``a\x1b[31m`` as ``a\\x1b[31m``), so a hostile file cannot drive the terminal.

Exit status: 0 shown; 1 a malformed checkpoint or file; 2 not a checkpoint, unreadable, or a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from fastckpt import _core
from fastckpt._io.storage.local.layout import MANIFEST, checkpoint_layout, listed_files, read_manifest
from fastckpt.cli.progress import Progress
from fastckpt.errors import CheckpointError

__all__ = ["HELP", "EPILOG", "add_arguments", "run", "describe"]

HELP = "show what a checkpoint folder or safetensors file holds: parts, tensors, dtypes, shapes, sizes, mode"
EPILOG = "exit status: 0 shown; 1 a malformed checkpoint or file; 2 not a checkpoint, unreadable, or a usage error"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fastckpt inspect`` flags (see :mod:`fastckpt.cli`)."""
    parser.add_argument("path", metavar="DIR|FILE", help="a checkpoint folder, or one .safetensors file")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--limit", type=int, default=0, metavar="N",
                        help="show at most N tensors per file (default 0: all)")


#: Folders with this many safetensors files show a progress bar on a terminal.
BIG_FOLDER_FILES = 16


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def _safe(text: str) -> str:
    """``text`` for a terminal: unchanged when printable, else with every non-printable character escaped."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _describe_file(path: Path) -> dict[str, Any]:
    f = _core.SafetensorsFile(str(path))
    tensors = [{"name": n, "dtype": d, "shape": s, "bytes": e - b} for n, d, s, b, e in f.tensors()]
    return {"file": path.name, "bytes": f.file_size, "metadata": f.metadata(), "tensors": tensors}


def describe(path: str | os.PathLike[str], progress: Any = None) -> dict[str, Any]:
    """What ``path`` (a checkpoint folder or a safetensors file) holds, as a JSON-ready dict.

    ``progress``: ``progress(files_done, files_total)`` after each safetensors file's header (a progress bar).

    Raises:
        MissingStateError: a folder that is not a checkpoint (or an unfinished save).
        HeaderError, TruncatedFileError, DtypeError: a malformed manifest or file. OSError: unreadable.
    """
    path = Path(path)
    if not path.is_dir():
        return {"kind": "safetensors file", "path": str(path), **_describe_file(path)}
    layout = checkpoint_layout(path)
    out: dict[str, Any] = {"kind": "checkpoint", "path": str(path), "layout": layout}
    if (path / MANIFEST).is_file():
        manifest = read_manifest(path, check_sizes=False)
        out.update({k: v for k, v in manifest.items() if k not in ("files", "format")})
        listed = listed_files(manifest)  # a sharded save's part files (``model/shard-...``) too
        out["files"] = [{"file": name, "bytes": info["bytes"], "crc32c": info.get("crc32c")}
                        for name, info in listed.items()]
    else:
        out["files"] = [{"file": p.name, "bytes": p.stat().st_size, "crc32c": None}
                        for p in sorted(path.iterdir()) if p.is_file()]
    names = [f["file"] for f in out["files"] if f["file"].endswith(".safetensors") and (path / f["file"]).is_file()]
    out["tensor_files"] = []
    for i, name in enumerate(names):
        out["tensor_files"].append({**_describe_file(path / name), "file": name})
        if progress is not None:
            progress(i + 1, len(names))
    if (path / MANIFEST).is_file():
        out["parts"] = _parts(manifest)
    return out


_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "U16": 2}


def _parts(manifest: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Bytes per part of a checkpoint: ``trainable`` (model files holding trainable tensors), ``frozen`` (frozen
    shards written by this save), ``shared`` (frozen shards hard-linked from an earlier checkpoint: no bytes
    written), ``optimizer``, ``other``; and ``frozen_not_stored`` (the frozen tensors a trainable-only save only
    recorded). Each as ``{"files": n, "bytes": b}`` (``"tensors"`` for the last)."""
    shared = manifest.get("shared") if isinstance(manifest.get("shared"), dict) else {}
    frozen_files = set(manifest.get("frozen_files") or [])
    parts = {k: {"files": 0, "bytes": 0} for k in ("trainable", "frozen", "shared", "optimizer", "other")}
    for name, info in listed_files(manifest).items():
        if name in shared:
            kind = "shared"
        elif name in frozen_files:
            kind = "frozen"
        elif name.startswith(("model", "adapter_")) and name.endswith(".safetensors"):
            kind = "trainable"
        elif name.startswith("optimizer"):
            kind = "optimizer"
        else:
            kind = "other"
        parts[kind]["files"] += 1
        parts[kind]["bytes"] += int(info.get("bytes", 0))
    record = manifest.get("frozen") if isinstance(manifest.get("frozen"), dict) else {}
    tensors = [t for per_model in record.values() if isinstance(per_model, dict) for t in per_model.values()]
    nbytes = 0
    for t in tensors:
        n = _ITEM_BYTES.get(t.get("dtype"), 1)
        for d in t.get("shape", []):
            n *= d
        nbytes += n
    parts["frozen_not_stored"] = {"tensors": len(tensors), "bytes": nbytes}
    return parts


def _print_tensors(desc: dict[str, Any], limit: int) -> None:
    tensors = desc["tensors"]
    total = sum(t["bytes"] for t in tensors)
    print(f"\n{_safe(desc['file'])}: {len(tensors)} tensors, {total:,} bytes of data ({_human(total)})")
    if desc["metadata"]:
        keys = ", ".join(_safe(k) for k in sorted(desc["metadata"]))
        print(f"  metadata keys: {keys if len(keys) < 200 else keys[:200] + '...'}")
    shown = tensors if limit <= 0 else tensors[:limit]
    if shown:
        names = [_safe(t["name"]) for t in shown]
        width = max(map(len, names))
        for name, t in zip(names, shown):
            shape = "[" + ", ".join(map(str, t["shape"])) + "]"
            print(f"  {name:<{width}}  {t['dtype']:<11} {shape:<18} {t['bytes']:>14,} B")
    if len(shown) < len(tensors):
        print(f"  ... and {len(tensors) - len(shown)} more (--limit 0 shows all)")


def run(args: argparse.Namespace) -> int:
    """Print ``describe(args.path)``; returns 0, 1 for a malformed checkpoint, 2 when it is not one."""
    try:
        with Progress("inspect", unit="files", min_total=BIG_FOLDER_FILES) as progress:
            desc = describe(args.path, progress)
    except CheckpointError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, FileNotFoundError) else 1
    except OSError as exc:
        print(f"fastckpt inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(desc, indent=2))
        return 0
    if desc["kind"] == "safetensors file":
        print(f"{_safe(desc['path'])}: safetensors file, {desc['bytes']:,} bytes ({_human(desc['bytes'])})")
        _print_tensors(desc, args.limit)
        return 0
    print(f"{_safe(desc['path'])}: checkpoint, layout {desc['layout']}")
    facts = [f"{k} {desc[k]}" for k in ("mode", "step", "models", "optimizers", "schedulers", "format_version",
                                         "fastckpt_version") if k in desc]
    if facts:
        print("  " + ", ".join(facts))
    if "parts" in desc:
        p = desc["parts"]
        written = sum(p[k]["bytes"] for k in ("trainable", "frozen", "optimizer", "other"))
        print(f"\nparts: {written:,} bytes written by this save ({_human(written)}), {p['shared']['bytes']:,} "
              f"shared with an earlier checkpoint")
        for kind in ("trainable", "frozen", "shared", "optimizer", "other"):
            if p[kind]["files"]:
                print(f"  {kind:<10} {p[kind]['files']:>3} files  {p[kind]['bytes']:>14,} B  ({_human(p[kind]['bytes'])})")
        if p["frozen_not_stored"]["tensors"]:
            f = p["frozen_not_stored"]
            print(f"  frozen, recorded only (trainable_only): {f['tensors']} tensors, {f['bytes']:,} B "
                  f"({_human(f['bytes'])}), checked by name, dtype, shape and xxh3-128 on load")
    width = max((len(_safe(f["file"])) for f in desc["files"]), default=4)
    print(f"\n{len(desc['files'])} files:")
    for f in desc["files"]:
        crc = f"crc32c {f['crc32c']}" if f["crc32c"] else "no checksum"
        print(f"  {_safe(f['file']):<{width}}  {f['bytes']:>14,} B  {crc}")
    for tf in desc["tensor_files"]:
        _print_tensors(tf, args.limit)
    return 0

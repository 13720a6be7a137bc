"""``fastckpt consolidate SRC OUT [--max-shard-size 5GB]``: a sharded DCP checkpoint -> a Hugging Face model folder.

``SRC`` is a folder written by :class:`fastckpt.dcp.StorageWriter` (``dcp_metadata.json`` in it) or a checkpoint
holding one (``model/`` preferred). ``OUT`` gets ``model.safetensors`` (or ``model-0000k-of-0000N.safetensors`` +
``model.safetensors.index.json`` over ``--max-shard-size``) and the ``config.json`` / ``generation_config.json``
found beside the save, so ``AutoModel*.from_pretrained(OUT)`` and the official safetensors reader load it bit-exact.
Each tensor is assembled from its chunks by positional reads and writes in the Rust core: memory stays at a few
chunk buffers (8 MiB per thread). A progress bar (tqdm) is drawn only on a terminal.

Exit status: 0 written; 1 a damaged or inconsistent checkpoint (a ``CheckpointError``); 2 not a DCP checkpoint,
an I/O error, or a usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastckpt.cli.verify import non_negative_int
from fastckpt.errors import CheckpointError, MissingStateError

__all__ = ["HELP", "EPILOG", "add_arguments", "run"]

HELP = "write a Hugging Face model folder (safetensors shards + index, config) from a sharded DCP checkpoint"
EPILOG = "exit status: 0 written; 1 a damaged or inconsistent checkpoint; 2 not a DCP checkpoint, I/O or usage error"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fastckpt consolidate`` flags (see :mod:`fastckpt.cli`)."""
    parser.add_argument("src", metavar="SRC", help="a fastckpt DCP folder, or a checkpoint holding one")
    parser.add_argument("out", metavar="OUT", help="the Hugging Face model folder to write (replaced whole)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest output file: bytes, or e.g. 5GB (5 * 10**9 bytes), 4GiB (default 5GB)")
    parser.add_argument("--key", default=None,
                        help="top-level state_dict entry holding the model (default: 'model' when present)")
    parser.add_argument("--threads", type=non_negative_int, default=0, help="copy threads (default 0: min(8, cores))")


def run(args: argparse.Namespace) -> int:
    """Consolidate ``args.src`` into ``args.out``; returns the exit status (see the module docs)."""
    from fastckpt._io.dcp.consolidate import consolidate
    from fastckpt._io.sizes import parse_size

    try:
        text = args.max_shard_size.strip()
        max_bytes = parse_size(int(text) if text.isdigit() else text)
    except ValueError as exc:
        print(f"fastckpt consolidate: --max-shard-size: {exc}", file=sys.stderr)
        return 2
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit="B", unit_scale=True, desc="consolidate", file=sys.stderr)
    try:
        written = consolidate(Path(args.src), Path(args.out), max_shard_size=max_bytes, key=args.key,
                              threads=args.threads, progress=None if bar is None else bar.update)
    except MissingStateError as exc:
        print(f"fastckpt consolidate: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, ValueError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"fastckpt consolidate: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    print(f"{args.out}: {', '.join(written)}")
    return 0

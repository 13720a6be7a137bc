"""``fastckpt convert SRC DST [--to fastckpt|accelerate|hf-model] [--model module:factory]``.

Converts a checkpoint folder between layouts (see :mod:`fastckpt._plan.convert`); ``DST`` is committed atomically.

``--model module:factory`` imports ``module`` (the current directory is on the path) and calls ``factory()``, which
returns the model, a list of models, or a ``(models, optimizers)`` pair: with it, accelerate's positional optimizer
state is keyed by parameter fqn; without it the keys stay positional and the manifest says so.

Exit status: 0 converted; 1 the source is damaged (an ``IntegrityError``: it does not match the checksums in its
``fastckpt.json``); 2 usage error (e.g. DST is SRC, inside it, or contains it), or the source could not be read or did
not fit the model. The error is printed; on 1 and 2 nothing is written.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

import torch

from fastckpt.cli.progress import Progress
from fastckpt.errors import CheckpointError, IntegrityError

__all__ = ["HELP", "add_arguments", "run", "load_factory"]

HELP = "convert a checkpoint folder between fastckpt's layout, accelerate's, and a Hugging Face model folder"
EPILOG = ("exit status: 0 converted; 1 the source is damaged (does not match its recorded checksums); "
          "2 usage error (DST is SRC, inside it, or contains it), or the source is unreadable or does not fit --model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fastckpt convert`` flags (see :mod:`fastckpt.cli`)."""
    parser.add_argument("src", metavar="SRC", help="a fastckpt or accelerate checkpoint folder")
    parser.add_argument("dst", metavar="DST", help="the folder to write (replaced atomically if it exists)")
    parser.add_argument("--to", choices=["fastckpt", "accelerate", "hf-model"], default="fastckpt",
                        help="target layout (default fastckpt; hf-model: model weights + config.json only)")
    parser.add_argument("--model", metavar="MODULE:FACTORY", default=None,
                        help="factory returning the model (or (models, optimizers)) to key optimizer state by fqn")
    parser.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="shard model/optimizer files over SIZE (bytes or e.g. 10GB, 10GiB); "
                             "default: one file (hf-model: 10GB)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow full unpickling of accelerate files that need it (runs code: trusted files only)")


def _as_list(obj: Any) -> list:
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def load_factory(spec: str) -> tuple[list[torch.nn.Module], list[Any] | None]:
    """Import ``module:factory`` and call it: ``(models, optimizers or None)``.

    Raises:
        ValueError: ``spec`` is not ``module:factory``, or the factory returns something else than documented.
        ImportError / AttributeError: the module or the factory does not exist.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must be MODULE:FACTORY (e.g. mypkg.models:build), got {spec!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    made = getattr(importlib.import_module(module_name), attr)()
    optimizers = None
    if isinstance(made, tuple) and len(made) == 2 and all(
            isinstance(o, torch.optim.Optimizer) for o in _as_list(made[1])):
        made, optimizers = made[0], _as_list(made[1])
    models = _as_list(made)
    if not models or not all(isinstance(m, torch.nn.Module) for m in models):
        raise ValueError(f"{spec}() must return a torch.nn.Module, a list of them, or (models, optimizers)")
    return models, optimizers


def run(args: argparse.Namespace) -> int:
    """Run ``fastckpt convert``; returns the exit status."""
    from fastckpt._plan.convert import convert

    shard = args.max_shard_size
    if shard is not None and shard.isdigit():
        shard = int(shard)
    if shard is None and args.to == "hf-model":
        shard = "10GB"
    try:
        models, optimizers = load_factory(args.model) if args.model else (None, None)
        with Progress(f"verify {Path(args.src).name}") as progress:
            snap = convert(Path(args.src), Path(args.dst), to=args.to, models=models, optimizers=optimizers,
                           max_shard_size=shard, trust_pickle=args.trust_pickle, progress=progress)
    except IntegrityError as exc:
        print(f"IntegrityError: {exc}", file=sys.stderr)
        return 1
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for note in snap.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.to == "fastckpt" and any(f is None for f in snap.fqns):
        print("note: optimizer state keeps accelerate's positional keys (pass --model MODULE:FACTORY to key it by "
              "parameter name); the manifest records \"optimizer_keys\": \"positional\"", file=sys.stderr)
    if args.to == "hf-model" or snap.mode == "model_only":
        what = "model 0's weights" if args.to == "hf-model" else f"{len(snap.models)} model(s), weights only"
        print(f"{args.src} -> {args.dst} ({args.to}): {what}" + (" + config.json" if snap.config else ""))
    else:
        print(f"{args.src} -> {args.dst} ({args.to}): {len(snap.models)} model(s), {len(snap.optimizers)} "
              f"optimizer(s), {len(snap.schedulers)} scheduler(s), {len(snap.rng)} RNG file(s), "
              f"{len(snap.objects)} other object state(s)")
    return 0

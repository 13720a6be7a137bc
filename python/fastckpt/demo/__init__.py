"""``fastckpt demo``: train GPT-2 for a few steps, checkpoint it three ways, reload, verify, time, compare.

The three checkpoints of one training state:

1. ``fastckpt.save_state(..., model_only=False)``: model, optimizer, scheduler and RNG states;
2. ``fastckpt.save_state(..., model_only=True)``: the model weights (and config.json) only;
3. accelerate's ``Accelerator.save_state`` (on CPU, model/optimizer/scheduler prepared), the baseline.

Durable against durable: fastckpt saves with ``durable=True`` (every file and folder fsynced); accelerate's time
includes an fsync of every file it wrote and of its folder. Before each load the checkpoint's files are read once
and their pages dropped from the page cache (``posix_fadvise(DONTNEED)``; the files are clean after the fsync), so
loads read from disk and both contenders start from the same memory state (:func:`same_start`).

Each checkpoint is loaded into objects built from scratch (a model initialised with another seed, a new AdamW, a
new scheduler) and compared bit for bit with the trained ones: every weight (``torch.equal``) and the tie between
``lm_head.weight`` and ``transformer.wte.weight``; for full checkpoints also the optimizer state tensors and
param_groups, the scheduler state_dict, and the next draws of Python ``random``, numpy and torch, which must equal
the draws taken right after the save.

A second table times weights-only loads into an existing model from the model-only checkpoint: fastckpt's
verifying ``load_state(model_only=True)`` next to safetensors, run:ai's model streamer and tensorizer, each when
importable (:mod:`fastckpt.demo.peers`); the missing ones are named under it.

Layer 5 (public). May import the public API (``fastckpt``, ``fastckpt.accelerate``) and its own modules: gpt2
(the model), compare (bit-for-bit comparisons), files (sizes, fsync, page-cache drops), table (rows, the table, the
machine's load beside it), peers (the weights-only loads).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import copy
import dataclasses
import inspect
import logging
import math
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import numpy as np
import torch

from fastckpt.demo.compare import draw_random, verify
from fastckpt.demo.files import dir_bytes, drop_page_cache, fsync_tree, same_start
from fastckpt.demo.gpt2 import GPT, PRESETS, num_parameters
from fastckpt.demo.peers import FASTCKPT, PEERS, available_peers, missing_line, weights_rows
from fastckpt.demo.table import DemoRow, busy_line, format_table, format_weights_table, load_average, make_row

__all__ = ["DemoResult", "DemoRow", "busy_line", "dir_bytes", "drop_page_cache", "format_table", "fsync_tree",
           "run_demo", "same_start"]

HELP = "train GPT-2 a few steps, checkpoint with fastckpt and accelerate, reload, verify, compare speed"

# stdlib modules whose source is the training text; any CPython install that ships .py sources has them.
_CORPUS_MODULES = ("argparse", "dataclasses", "textwrap", "string", "json.decoder", "fractions")
_WARMUP_STEPS = 2
_SCHEDULE_STEPS = 100  # cosine decay length after the warm-up

Objects = tuple[GPT, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]
Method = tuple[Callable[[Objects, pathlib.Path], float], Callable[[Objects, pathlib.Path], float]]


@dataclasses.dataclass
class DemoResult:
    """What :func:`run_demo` measured. ``ok`` is False when any row failed verification."""

    rows: list[DemoRow]
    parameters: int
    losses: list[float]
    wall_s: float
    peak_load: float = math.nan  #: the highest 1-minute load average sampled during the rounds
    #: the weights-only loads into an existing model: fastckpt's model-only load, then each importable peer
    weights: list[DemoRow] = dataclasses.field(default_factory=list)
    missing_peers: list[str] = dataclasses.field(default_factory=list)  #: peers not importable, not measured

    @property
    def ok(self) -> bool:
        return all(row.verified for row in self.rows + self.weights)


def corpus_text() -> str:
    """Real English and Python text available offline: the source of a few stdlib modules.

    Falls back to the docstrings of the builtins (present even under ``python -OO``) where sources are missing.
    """
    parts = []
    for name in _CORPUS_MODULES:
        with contextlib.suppress(ImportError, OSError, TypeError):
            parts.append(inspect.getsource(__import__(name, fromlist=["_"])))
    if not parts:
        parts = [obj.__doc__ for obj in vars(builtins).values() if isinstance(getattr(obj, "__doc__", None), str)]
    return "\n".join(parts)


def build_training(config_name: str, seed: int) -> Objects:
    """A GPT-2 model initialised from ``seed``, AdamW (weight decay on matrices only, two param_groups) and a
    linear warm-up followed by cosine decay (``SequentialLR``: its state is plain data, no lambda)."""
    torch.manual_seed(seed)
    model = GPT(PRESETS[config_name])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=6e-4,
        betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler
    scheduler = sched.SequentialLR(
        optimizer,
        [
            sched.LinearLR(optimizer, start_factor=0.1, end_factor=1.0, total_iters=_WARMUP_STEPS),
            sched.CosineAnnealingLR(optimizer, T_max=_SCHEDULE_STEPS, eta_min=6e-5),
        ],
        milestones=[_WARMUP_STEPS],
    )
    return model, optimizer, scheduler


def train(model: GPT, optimizer, scheduler, steps: int, batch_size: int, seq_len: int, seed: int) -> list[float]:
    """``steps`` AdamW steps on random windows of :func:`corpus_text` as byte tokens; returns the losses."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # dropout draws from the global torch generator
    tokens = torch.frombuffer(bytearray(corpus_text().encode("utf-8")), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=generator)
        window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        _, loss = model(window[:, :-1], targets=window[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    return losses


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _folder(name: str) -> str:
    return name.replace(" ", "_")


def _methods(fastckpt: Any, *, step: int, threads: int) -> dict[str, Method]:
    """Row name -> (save, load); each takes (model, optimizer, scheduler) and a folder and returns seconds."""

    def fastckpt_method(model_only: bool) -> Method:
        def save(objects: Objects, path: pathlib.Path) -> float:
            return _timed(
                lambda: fastckpt.save_state(
                    *objects, output_dir=path, model_only=model_only, step=step, durable=True, threads=threads
                )
            )

        def load(objects: Objects, path: pathlib.Path) -> float:
            loaded = objects[:1] if model_only else objects
            return _timed(lambda: fastckpt.load_state(*loaded, input_dir=path, model_only=model_only, threads=threads))

        return save, load

    def accelerate_save(objects: Objects, path: pathlib.Path) -> float:
        accelerator = _prepared_accelerator(objects)
        with _quiet("accelerate"):
            return _timed(lambda: (accelerator.save_state(str(path)), fsync_tree(path)))

    def accelerate_load(objects: Objects, path: pathlib.Path) -> float:
        accelerator = _prepared_accelerator(objects)
        with _quiet("accelerate"):
            return _timed(lambda: accelerator.load_state(str(path)))

    return {
        "fastckpt full": fastckpt_method(model_only=False),
        "fastckpt model_only": fastckpt_method(model_only=True),
        "accelerate": (accelerate_save, accelerate_load),
    }


def _prepared_accelerator(objects: Objects) -> Any:
    """A CPU ``Accelerator`` that has prepared the model, optimizer and scheduler (as a training script would)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(*objects)
    return accelerator


def _accelerate_installed() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Silence a library's log records below ERROR (accelerate logs each tied weight it drops)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_demo(
    size: str = "small",
    steps: int = 3,
    out_dir: str | os.PathLike | None = None,
    *,
    threads: int = 0,
    batch_size: int = 2,
    seq_len: int = 64,
    seed: int = 1234,
    cold_cache: bool = True,
    stream: TextIO | None = None,
    rounds: int = 3,
) -> DemoResult:
    """Train GPT-2 ``size`` for ``steps`` steps, checkpoint it with fastckpt (full, model_only) and accelerate,
    reload each checkpoint into fresh objects, verify bit-exactness, and print one comparison table; then time the
    weights-only loads of the model-only checkpoint into an existing model, fastckpt's against each importable peer
    (safetensors, run:ai's model streamer, tensorizer), in a second table (``DemoResult.weights``).

    Args:
        size: a :data:`fastckpt.demo.gpt2.PRESETS` name: ``"small"`` (GPT-2 small, 124M parameters; the full
            state is about 1.5 GB) or ``"tiny"`` (120,576 parameters, for tests).
        steps: training steps before the checkpoint (the warm-up is 2 steps, so 3 reaches the cosine phase).
        out_dir: folder for the checkpoints (kept); None: a temporary folder, removed afterwards.
        threads: fastckpt I/O threads (0: fastckpt's default).
        batch_size, seq_len: sequences per step and tokens per sequence (seq_len <= the preset's block_size).
        seed: seed of the model, the data order and the RNGs; the fresh objects use ``seed + 1``.
        cold_cache: drop the checkpoint's pages from the page cache before each load (Linux), after reading the
            files once (:func:`fastckpt.demo.files.same_start`).
        stream: where the progress and the table go (default ``sys.stdout``).
        rounds: how many times each checkpoint is saved and loaded; the contenders alternate (round r starts
            with the r-th, so none always runs first on a warm or cold machine) and the table shows medians.

    Returns:
        A :class:`DemoResult`; ``result.ok`` is False when any checkpoint failed verification.

    Raises:
        KeyError: unknown ``size``.
        FileExistsError: ``out_dir`` already holds one of the demo's checkpoint folders.

    Example:
        >>> result = run_demo("tiny", steps=2)  # doctest: +SKIP
        >>> result.ok
        True
    """
    import fastckpt

    out = stream or sys.stdout
    started = time.perf_counter()
    methods = _methods(fastckpt, step=steps, threads=threads)
    if not _accelerate_installed():
        print("accelerate is not installed: its row is skipped (pip install 'fastckpt[accelerate]')", file=out)
        methods.pop("accelerate")
    taken = [pathlib.Path(out_dir, _folder(name)) for name in [*methods, "tensorizer"] if out_dir is not None]
    if any(path.exists() for path in taken):
        raise FileExistsError(f"{next(p for p in taken if p.exists())} already exists; pick an empty --keep folder")
    model, optimizer, scheduler = build_training(size, seed)
    params = num_parameters(model)
    print(
        f"GPT-2 {size}: {params:,} parameters; {steps} training step(s) of {batch_size} x {seq_len} byte tokens",
        file=out,
    )
    losses = train(model, optimizer, scheduler, steps, batch_size, seq_len, seed)
    print("losses: " + ", ".join(f"{loss:.3f}" for loss in losses), file=out)

    root = pathlib.Path(out_dir) if out_dir is not None else pathlib.Path(tempfile.mkdtemp(prefix="fastckpt-demo-"))
    trained = (model, optimizer, scheduler)
    names = list(methods)
    timings: dict[str, tuple[list[float], list[float], list[str]]] = {n: ([], [], []) for n in names}
    try:
        peak_load = load_average()
        for r in range(max(1, rounds)):
            for name in names[r % len(names):] + names[: r % len(names)]:  # alternate who goes first
                saves, loads, problems = timings[name]
                if problems:
                    continue  # a failed row is reported once
                save, load = methods[name]
                path = root / _folder(name)
                shutil.rmtree(path, ignore_errors=True)  # every round saves into a fresh folder
                save_s = load_s = math.nan
                try:
                    save_s = save(trained, path)
                    draws = draw_random()
                    fresh = build_training(size, seed + 1)
                    if cold_cache:
                        same_start(path)
                    load_s = load(fresh, path)
                    problems += verify(trained, fresh, full=name != "fastckpt model_only", draws_after_save=draws)
                    del fresh
                except Exception as exc:  # noqa: BLE001 -- a failing row is reported in the table, the others run
                    stage = "save" if math.isnan(save_s) else "load"
                    problems.append(f"{stage} raised {type(exc).__name__}: {exc}")
                saves.append(save_s)
                loads.append(load_s)
                peak_load = max(peak_load, load_average())
        baseline = timings.get("accelerate", ([], []))[:2]
        rows = [make_row(name, root / _folder(name), *timings[name], baseline=baseline) for name in names]
        peers = available_peers()
        weights: list[DemoRow] = []
        if peers and not timings["fastckpt model_only"][2]:
            def sample() -> None:
                nonlocal peak_load
                peak_load = max(peak_load, load_average())

            target = copy.deepcopy(model)  # an existing model of the same shape (zeroed before each load)
            weights = weights_rows(fastckpt, [FASTCKPT, *peers], root / _folder("fastckpt model_only"), root,
                                   model, target, rounds=rounds, threads=threads, cold_cache=cold_cache,
                                   on_round=sample)
            del target
    finally:
        if out_dir is None:
            shutil.rmtree(root, ignore_errors=True)

    missing = [name for name in PEERS if name not in peers]
    result = DemoResult(rows, params, losses, time.perf_counter() - started, peak_load, weights, missing)
    print(format_table(rows), file=out)
    if weights:
        print(format_weights_table(weights), file=out)
    if missing_line(missing):
        print(missing_line(missing), file=out)
    print(busy_line(peak_load), file=out)
    cache = ("a cold page cache (files read once, then posix_fadvise DONTNEED: the same start for every row)"
             if cold_cache else "the page cache")
    print("save: durable on both sides (fastckpt durable=True; accelerate save_state + fsync of each file)", file=out)
    n_rounds = max(1, rounds)
    print(f"medians of {n_rounds} round{'s' if n_rounds != 1 else ''}: each round saves and loads every checkpoint, "
          "the contenders alternating (round r starts with the r-th)", file=out)
    print("save / load speedup: median of per-round ratios, accelerate's seconds / the row's seconds (above 1x: "
          f"faster than accelerate); loads from {cache}", file=out)
    print("verified: reloaded into objects built from scratch and compared bit for bit (every weight and the tie;"
          " full rows also optimizer state + param_groups, scheduler state, next python/numpy/torch RNG draws)",
          file=out)
    if weights:
        print("weights-only loads into an existing model, from the model_only checkpoint (tensorizer: its own file, "
              "written untimed), same cache state and rotation; fastckpt verifies every byte (checksums) before it "
              "changes the model, the peers verify nothing; vs fastckpt: median of per-round ratios, fastckpt's "
              "seconds / the row's (above 1x: faster than fastckpt); equal: every weight torch.equal to the saved "
              "one (tensorizer stores the tied embedding twice and unties it on load: it fills a model of its own, "
              "checked weight by weight)", file=out)
    for row in rows + weights:
        for problem in row.problems[:10]:
            print(f"FAILED {row.name}: {problem}", file=out)
    where = f"kept in {root}" if out_dir is not None else "removed"
    print(f"checkpoints {where}; wall time {result.wall_s:.1f} s", file=out)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fastckpt demo`` flags (see :mod:`fastckpt.cli`)."""
    parser.add_argument(
        "--size",
        choices=sorted(PRESETS),
        default="small",
        help="GPT-2 preset: small = 124M parameters (default), tiny = 120,576 (seconds)",
    )
    parser.add_argument("--steps", type=_count, default=3, help="training steps before the checkpoint (default 3)")
    parser.add_argument(
        "--keep",
        metavar="DIR",
        help="write the checkpoints to DIR and keep them (default: a temporary folder, removed)",
    )
    parser.add_argument("--threads", type=_count, default=0, help="fastckpt I/O threads (default 0: automatic)")
    parser.add_argument("--rounds", type=_count, default=3,
                        help="save/load rounds per checkpoint, contenders alternating; the table shows medians "
                             "(default 3)")
    parser.add_argument(
        "--warm-cache",
        action="store_true",
        help="load from the page cache instead of dropping the checkpoint's pages first",
    )


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed flags; exit status 0 when every checkpoint verified, 1 otherwise."""
    try:
        result = run_demo(args.size, args.steps, args.keep, threads=args.threads, cold_cache=not args.warm_cache,
                          rounds=args.rounds)
    except FileExistsError as exc:
        print(f"fastckpt demo: error: {exc}", file=sys.stderr)
        return 2
    return 0 if result.ok else 1

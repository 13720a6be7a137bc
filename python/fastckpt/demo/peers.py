"""The demo's weights-only loads: fastckpt's verifying model-only load next to the fastest weight loaders people
pick when load time matters (issue 26), into an existing model, cold page cache, alternated, medians.

Rows (each only when its library imports):

- ``fastckpt load_state model_only``: ``fastckpt.load_state(model, input_dir=..., model_only=True)``, which verifies
  every byte (checksums) before it changes the model;
- ``safetensors load_file + load_state_dict``: ``safetensors.torch.load_file`` of the same ``model.safetensors``,
  then ``model.load_state_dict(..., strict=False)`` (the tied head is stored once);
- ``runai streamer + copy_``: ``runai_model_streamer.SafetensorsStreamer`` streaming the same file, each tensor
  ``copy_``-ed into the model's (it has no load into a module);
- ``tensorizer load_into_module``: ``TensorDeserializer(...).load_into_module`` of its own file, written untimed at
  set-up with ``TensorSerializer.write_module``. It stores the tied embedding twice (more bytes to read) and puts
  new ``Parameter`` objects into the module, so the tied head comes back untied; it loads into a copy of the model
  of its own and is checked weight by weight, not on the tie.

None of the peers verifies a byte. Every load's result is compared with the saved weights (``torch.equal``).

Layer 5 (public): imports ``fastckpt`` (passed in) and the demo's files module.
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import time
from collections.abc import Callable

import torch

from fastckpt.demo.files import dir_bytes, same_start
from fastckpt.demo.table import DemoRow, _median, _ratio

__all__ = ["FASTCKPT", "PEERS", "PEER_MODULES", "available_peers", "missing_line", "untied", "weights_loaders", "check_weights",
           "weights_rows"]

FASTCKPT = "fastckpt load_state model_only"
#: peer row name -> the module it needs
PEER_MODULES = {
    "safetensors load_file + load_state_dict": "safetensors",
    "runai streamer + copy_": "runai_model_streamer",
    "tensorizer load_into_module": "tensorizer",
}
PEERS = list(PEER_MODULES)
INSTALL = "pip install 'fastckpt-rs[bench]'"


def available_peers() -> list[str]:
    """The peer rows whose library is importable, in :data:`PEERS` order."""
    return [name for name in PEERS if importlib.util.find_spec(PEER_MODULES[name]) is not None]


def missing_line(missing: list[str]) -> str:
    """The line under the weights table naming the peers that did not run ('' when none is missing)."""
    if not missing:
        return ""
    mods = ", ".join(PEER_MODULES[name] for name in missing)
    return f"not installed, so not measured: {', '.join(missing)} ({mods}); add them with {INSTALL}"


def untied(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state_dict with each storage once, under its first name (the tied head dropped): what
    safetensors' ``save_file`` takes (it refuses shared tensors); the benchmarks use it too."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor
    return out


def check_weights(saved: torch.nn.Module, loaded: torch.nn.Module) -> list[str]:
    """Every weight of ``saved`` (tied ones once) that ``loaded`` does not hold bit for bit (empty: equal)."""
    got = loaded.state_dict()
    return [f"{name}: the loaded tensor differs from the saved one" for name, want in untied(saved).items()
            if name not in got or not torch.equal(got[name], want)]


def _zero(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for tensor in untied(model).values():
            tensor.zero_()


def weights_loaders(fastckpt, names: list[str], checkpoint: pathlib.Path, root: pathlib.Path, saved: torch.nn.Module,
                    target: torch.nn.Module, *, threads: int = 0, cold_cache: bool = True
                    ) -> dict[str, tuple[Callable[[], tuple[float, list[str]]], int]]:
    """Row name -> (one timed load returning (seconds, problems), bytes it reads) for ``names``.

    Args:
        fastckpt: the ``fastckpt`` module.
        names: :data:`FASTCKPT` and/or names of :data:`PEERS`.
        checkpoint: the demo's model-only checkpoint folder (its ``model.safetensors`` feeds safetensors and runai).
        root: a folder for tensorizer's own file (written here, untimed, when tensorizer is in ``names``).
        saved: the trained model; target: a model of the same shape the loads overwrite (zeroed before each).
        threads: fastckpt I/O threads (0: automatic). cold_cache: read once and drop each row's files first.

    Returns:
        Each call zeroes its target, sets the cache state (untimed), times the load and compares the result with
        ``saved`` (``torch.equal``, every weight).
    """
    weights = checkpoint / "model.safetensors"
    tensorizer_dir = root / "tensorizer"
    own = copy.deepcopy(target) if "tensorizer load_into_module" in names else target  # tensorizer replaces the module's Parameters (and unties the head): its own model
    if "tensorizer load_into_module" in names:
        from tensorizer import TensorSerializer

        tensorizer_dir.mkdir(parents=True, exist_ok=True)
        serializer = TensorSerializer(str(tensorizer_dir / "model.tensors"))
        serializer.write_module(saved)  # untimed set-up
        serializer.close()

    def load_fastckpt() -> torch.nn.Module:
        fastckpt.load_state(target, input_dir=checkpoint, model_only=True, threads=threads)
        return target

    def load_safetensors() -> torch.nn.Module:
        from safetensors.torch import load_file

        target.load_state_dict(load_file(str(weights)), strict=False)
        return target

    def load_runai() -> torch.nn.Module:
        from runai_model_streamer import SafetensorsStreamer

        state = target.state_dict()
        with torch.no_grad(), SafetensorsStreamer() as streamer:
            streamer.stream_file(str(weights), owned=False)
            for name, tensor in streamer.get_tensors():
                state[name].copy_(tensor)
        return target

    def load_tensorizer() -> torch.nn.Module:
        from tensorizer import TensorDeserializer

        with TensorDeserializer(str(tensorizer_dir / "model.tensors"), device="cpu") as deserializer:
            deserializer.load_into_module(own)
        return own

    # name -> (load, the model it fills, the folder whose cache state is set, the bytes it reads)
    table = {FASTCKPT: (load_fastckpt, target, checkpoint, dir_bytes(checkpoint)),
             "safetensors load_file + load_state_dict": (load_safetensors, target, checkpoint, weights.stat().st_size),
             "runai streamer + copy_": (load_runai, target, checkpoint, weights.stat().st_size)}
    if "tensorizer load_into_module" in names:
        table["tensorizer load_into_module"] = (load_tensorizer, own, tensorizer_dir, dir_bytes(tensorizer_dir))

    def timed(load: Callable[[], torch.nn.Module], model: torch.nn.Module, folder: pathlib.Path
              ) -> Callable[[], tuple[float, list[str]]]:
        def run() -> tuple[float, list[str]]:
            _zero(model)
            if cold_cache:
                same_start(folder)
            start = time.perf_counter()
            loaded = load()
            seconds = time.perf_counter() - start
            return seconds, check_weights(saved, loaded)

        return run

    return {name: (timed(*table[name][:3]), table[name][3]) for name in names}


def weights_rows(fastckpt, names: list[str], checkpoint: pathlib.Path, root: pathlib.Path, saved: torch.nn.Module,
                 target: torch.nn.Module, *, rounds: int, threads: int = 0, cold_cache: bool = True,
                 on_round: Callable[[], None] = lambda: None) -> list[DemoRow]:
    """Time every loader of ``names`` (:data:`FASTCKPT` first) ``rounds`` times, alternating who goes first as the
    demo's checkpoints do (round r starts with the r-th), and return their rows: medians, ``load_speedup`` =
    median of per-round fastckpt seconds / the row's, problems from the equality check (a row that raised is
    reported with what it raised and not run again). Arguments as :func:`weights_loaders`; ``on_round`` is called
    after each load (the demo samples the load average there)."""
    loaders = weights_loaders(fastckpt, names, checkpoint, root, saved, target, threads=threads,
                              cold_cache=cold_cache)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    problems: dict[str, list[str]] = {name: [] for name in names}
    for r in range(max(1, rounds)):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if problems[name]:
                continue
            try:
                took, wrong = loaders[name][0]()
            except Exception as exc:  # noqa: BLE001 -- a failing peer is reported in the table, the others run
                took, wrong = float("nan"), [f"load raised {type(exc).__name__}: {exc}"]
            seconds[name].append(took)
            problems[name] += wrong
            on_round()
    base = seconds[names[0]]
    return [DemoRow(name, checkpoint if name != "tensorizer load_into_module" else root / "tensorizer",
                    loaders[name][1], float("nan"), _median(seconds[name]), problems[name], [], seconds[name],
                    float("nan"), _ratio(base, seconds[name])) for name in names]

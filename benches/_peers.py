"""The fastest loaders as contenders (issue 26): run:ai's model streamer and tensorizer next to safetensors and
fastckpt's weights paths, on the same weights, in the same rounds and cache state, each result checked equal to the
saved model.

Rows (all of the model's weights, tied weights once; GB/s on the model's bytes):

- into fresh tensors, every page touched: ``fastckpt.torch.load_file`` (the default), safetensors ``load_file``,
  runai ``SafetensorsStreamer.stream_file`` (``owned=True``), tensorizer ``TensorDeserializer`` (with and without
  ``verify_hash``);
- into the existing model: fastckpt ``load_state(model_only=True)`` (verifying, and ``verify=False``), runai
  streamed (``owned=False``) + ``copy_``, tensorizer ``load_into_module`` (with and without ``verify_hash``),
  safetensors ``load_file`` + ``load_state_dict`` (cold and warm).

What the peers cannot do: neither runai nor tensorizer (without ``verify_hash``) checks a byte; runai has no load
into a module (stream + ``copy_``); tensorizer's ``load_into_module`` needs a ``write_module`` file, which holds the
tied embedding twice (more bytes than the others read), and it puts new ``Parameter`` objects into the module (the
tied head comes back untied, and an optimizer no longer owns the parameters), so it loads into a model of its own.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

import fastckpt
import fastckpt.torch as fastckpt_torch
from benches._measure import Timing, timed
from fastckpt.demo.peers import untied

__all__ = ["peer_contenders", "check_model", "peer_table", "prepare_peer_sources"]

FRESH = "fresh"  # into new tensors
LIVE = "live"  # into the existing model



def prepare_peer_sources(b) -> None:
    """The tensorizer file of the model's weights (the safetensors file is written by ``prepare_sources``)."""
    try:
        from tensorizer import TensorSerializer
    except ImportError:  # not installed: its rows fail and are reported, the others run
        return
    path = b.root / "src" / "tensorizer"
    path.mkdir(parents=True, exist_ok=True)
    ser = TensorSerializer(str(path / "model.tensors"))
    ser.write_module(b.state.model)  # its load_into_module needs a module file (a tied weight is stored twice)
    ser.close()
    b.sources["tensorizer"] = path


def check_model(b, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Raise unless ``tensors`` (fresh) or the target model (None) equals the saved model, tensor by tensor."""
    want = untied(b.state.model)
    got = tensors if tensors is not None else b.target.model.state_dict()
    for name, w in want.items():
        g = got.get(name)
        if g is None or not torch.equal(g.reshape(w.shape), w):
            raise AssertionError(f"{name}: the loaded tensor differs from the saved one")


def _zero_target(b) -> None:
    with torch.no_grad():
        for model in (b.target.model, b.extras.get("tensorizer-model")):
            for p in untied(model).values() if model is not None else ():
                p.zero_()


def _touch(tensors) -> None:
    for t in tensors:
        if t.numel():
            t.detach().reshape(-1).view(torch.uint8)[::4096].sum()


def _fresh(load: Callable[[object], dict]) -> Callable[[object], Timing]:
    def run(b) -> Timing:
        out: dict = {}

        def call() -> None:
            out.update(load(b))

        timing = timed(call, lambda: _touch(out.values()))
        check_model(b, out)
        return timing

    return run


def _live(load: Callable[[object], object], own_model: bool = False) -> Callable[[object], Timing]:
    def run(b) -> Timing:
        timing = timed(lambda: load(b) and None)
        check_model(b, _tensorizer_model(b).state_dict() if own_model else None)
        return timing

    return run


def _model_file(b) -> str:
    return str(b.sources["fastckpt"] / "model.safetensors")


def _tensorizer_file(b) -> str:
    return str(b.sources["tensorizer"] / "model.tensors")


def _runai_fresh(b) -> dict:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as s:
        s.stream_file(_model_file(b))
        return dict(s.get_tensors())


def _runai_live(b) -> None:
    from runai_model_streamer import SafetensorsStreamer

    sd = b.target.model.state_dict()
    with torch.no_grad(), SafetensorsStreamer() as s:
        s.stream_file(_model_file(b), owned=False)
        for name, t in s.get_tensors():
            sd[name].copy_(t)


def _tensorizer_fresh(verify: bool) -> Callable[[object], dict]:
    def load(b) -> dict:
        from tensorizer import TensorDeserializer

        with TensorDeserializer(_tensorizer_file(b), device="cpu", verify_hash=verify) as d:
            return dict(d.items())

    return load


def _tensorizer_model(b) -> torch.nn.Module:
    """A model of its own for tensorizer's ``load_into_module``, which puts new ``Parameter`` objects into the module
    (it unties the tied head; the optimizer would no longer own the parameters), so it never loads into the target
    the other contenders share."""
    if "tensorizer-model" not in b.extras:
        import copy

        b.extras["tensorizer-model"] = copy.deepcopy(b.target.model)
    return b.extras["tensorizer-model"]


def _tensorizer_live(verify: bool) -> Callable[[object], None]:
    def load(b) -> None:
        from tensorizer import TensorDeserializer

        with TensorDeserializer(_tensorizer_file(b), device="cpu", verify_hash=verify) as d:
            d.load_into_module(_tensorizer_model(b))

    return load


def _safetensors_fresh(b) -> dict:
    from safetensors.torch import load_file

    return load_file(str(b.sources["safetensors"] / "model.safetensors"))


def _safetensors_live(b) -> None:
    from safetensors.torch import load_file

    b.target.model.load_state_dict(load_file(str(b.sources["safetensors"] / "model.safetensors")), strict=False)


def _fastckpt_fresh(backend: str | None) -> Callable[[object], dict]:
    def load(b) -> dict:
        if backend is None:
            return fastckpt_torch.load_file(_model_file(b))
        return fastckpt_torch.load_file(_model_file(b), backend=backend)

    return load


def _fastckpt_live(verify: bool) -> Callable[[object], None]:
    def load(b) -> None:
        fastckpt.load_state(b.target.model, input_dir=b.sources["fastckpt"], model_only=True, verify=verify)

    return load


#: (row name, kind, caches, load, source the cache state is set on); fastckpt rows first in each kind.
PEERS: list[tuple[str, str, tuple[str, ...], Callable, str]] = [
    ("fastckpt.torch.load_file", FRESH, ("cold", "warm"), _fastckpt_fresh(None), "fastckpt"),
    ("fastckpt.torch.load_file pread", FRESH, ("cold",), _fastckpt_fresh("pread"), "fastckpt"),
    ("safetensors load_file -> fresh", FRESH, ("cold", "warm"), _safetensors_fresh, "safetensors"),
    ("runai streamer -> fresh", FRESH, ("cold", "warm"), _runai_fresh, "fastckpt"),
    ("tensorizer -> fresh", FRESH, ("cold",), _tensorizer_fresh(False), "tensorizer"),
    ("tensorizer verify_hash -> fresh", FRESH, ("cold",), _tensorizer_fresh(True), "tensorizer"),
    ("fastckpt load_state model_only", LIVE, ("cold", "warm"), _fastckpt_live(True), "fastckpt"),
    ("fastckpt load_state model_only verify=False", LIVE, ("cold", "warm"), _fastckpt_live(False), "fastckpt"),
    ("safetensors load_file -> model", LIVE, ("cold", "warm"), _safetensors_live, "safetensors"),
    ("runai streamer + copy_", LIVE, ("cold", "warm"), _runai_live, "fastckpt"),
    ("tensorizer load_into_module", LIVE, ("cold", "warm"), _tensorizer_live(False), "tensorizer"),
    ("tensorizer load_into_module verify_hash", LIVE, ("cold",), _tensorizer_live(True), "tensorizer"),
]


def peer_contenders(contender_cls, cache_setup) -> list:
    """The :class:`~benches._contenders.Contender` of every row of :data:`PEERS` (peer workloads only)."""
    out = []
    for name, kind, caches, load, source in PEERS:
        for cache in caches:
            setup_cache = cache_setup(cache, source)

            def setup(b, setup_cache=setup_cache, kind=kind) -> None:
                if kind == LIVE:
                    _zero_target(b)
                setup_cache(b)

            run = _fresh(load) if kind == FRESH else _live(load, own_model=name.startswith("tensorizer"))
            out.append(contender_cls(name, "load", run, cache=cache, moves="model", setup=setup, gpt_only=True,
                                     peer=True))
    return out


def _best(results, workload: str, cache: str, names: list[str]) -> tuple[str, list[float]] | None:
    """(name, per-round done times) of the peer with the lowest median among ``names``."""
    rows = [r for r in results if r.row.workload == workload and r.row.cache == cache and r.row.name in names]
    if not rows:
        return None
    best = min(rows, key=lambda r: r.done)
    return best.row.name, [t.done for t in best.row.timings]


def peer_table(results, disk: dict | None = None) -> list[str]:
    """Markdown: each fastckpt weights row against the best peer of its kind and cache, same rounds
    (``vs best`` = the best peer's time / fastckpt's, per round, median), both against the raw sequential read
    (``x raw``) and, cold, against the device's parallel O_DIRECT read rate (``x disk``, from ``disk``)."""
    lines = ["| workload | load | fastckpt | s | x raw | x disk | best peer | s | x raw | x disk | vs best |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    fast_names = [p[0] for p in PEERS if p[0].startswith("fastckpt")]
    peer_names = {kind: [p[0] for p in PEERS if p[1] == kind and not p[0].startswith("fastckpt")]
                  for kind in (FRESH, LIVE)}
    kind_of = {p[0]: p[1] for p in PEERS}
    for r in results:
        if r.row.name not in fast_names:
            continue
        best = _best(results, r.row.workload, r.row.cache, peer_names[kind_of[r.row.name]])
        if best is None:
            continue
        name, times = best
        peer = next(x for x in results if x.row.workload == r.row.workload and x.row.cache == r.row.cache
                    and x.row.name == name)
        ratios = [p / t.done for p, t in zip(times, r.row.timings)]
        raw = statistics.median(r.vs_raw) if r.vs_raw else float("nan")
        praw = statistics.median(peer.vs_raw) if peer.vs_raw else float("nan")
        def vs_disk(res) -> str:
            if disk is None or res.row.cache != "cold":
                return ""
            return f"{res.gbps / disk['parallel_read']:.2f}x"

        lines.append(f"| {r.row.workload} | {kind_of[r.row.name]}, {r.row.cache} | {r.row.name} | {r.done:.3f} | "
                     f"{raw:.2f}x | {vs_disk(r)} | {name} | {peer.done:.3f} | {praw:.2f}x | {vs_disk(peer)} | "
                     f"{statistics.median(ratios):.2f}x |")
    return lines

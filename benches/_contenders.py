"""The contenders of the benchmark suite: every way of saving and loading a state that is measured, each a
:class:`Contender` with an untimed ``setup`` (fresh output folder, page cache dropped or warmed) and a timed
``run`` returning a :class:`~benches._measure.Timing`.

Like with like: a peer that does not fsync gets its fsync timed into ``done`` (durable), while ``returned`` is when
its call returned; fastckpt's synchronous saves return durable, so both of its times are the durable one. Loads
end with every byte in memory: a lazy (mmap) loader's ``done`` includes touching every page it mapped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import shutil
from collections.abc import Callable

import torch

import fastckpt
import fastckpt.torch as fastckpt_torch
from benches._measure import Timing, drop_caches, fsync_tree, raw_read, raw_write, timed, warm_cache
from benches._workloads import TrainingState, Workload, build_state, state_tensors
from fastckpt.demo.peers import untied

__all__ = ["Bench", "Contender", "contenders", "prepare_sources", "touch_pages"]

logging.getLogger("accelerate").setLevel(logging.ERROR)


@dataclasses.dataclass
class Bench:
    """One workload being measured: the live state, a stepped target state of the same shapes (loads go into
    it), the folder, the prepared source checkpoints of the loads, and pre-faulted scratch buffers."""

    workload: Workload
    state: TrainingState
    target: TrainingState
    root: pathlib.Path
    full_bytes: int
    model_bytes: int
    sources: dict[str, pathlib.Path] = dataclasses.field(default_factory=dict)
    scratch: torch.Tensor | None = None  # uint8, full_bytes, pre-faulted: memcpy and raw-read destination
    extras: dict[str, object] = dataclasses.field(default_factory=dict)

    def out(self, name: str) -> pathlib.Path:
        return self.root / "out" / name.replace(" ", "_").replace("/", "_")


@dataclasses.dataclass
class Contender:
    """One measured way of doing an operation.

    Attributes:
        name: the row label.
        op: ``"save"``, ``"load"`` or ``"copy"`` (the in-memory reference).
        cache: ``"cold"`` or ``"warm"`` for loads, ``""`` otherwise.
        moves: ``"full"`` (the whole state) or ``"model"`` (weights only): the bytes its GB/s is computed on.
        run: the timed call.
        setup: untimed, before each run.
        teardown: untimed, after each run.
        gpt_only: needs an optimizer (skipped on the single-tensor workload).
        peer: measured only on workloads with ``peers`` set.
    """

    name: str
    op: str
    run: Callable[[Bench], Timing]
    cache: str = ""
    moves: str = "full"
    setup: Callable[[Bench], None] | None = None
    teardown: Callable[[Bench], None] | None = None
    gpt_only: bool = False
    peer: bool = False

    @property
    def label(self) -> str:
        return f"{self.name} ({self.cache})" if self.cache else self.name


def touch_pages(tensors: list[torch.Tensor]) -> None:
    """Read one element of every 4 KiB page of ``tensors`` (brings a lazily mapped tensor into memory)."""
    for t in tensors:
        if t.numel():
            flat = t.detach().reshape(-1).view(torch.uint8)
            flat[::4096].sum()


def _fresh_out(name: str) -> Callable[[Bench], None]:
    def setup(b: Bench) -> None:
        shutil.rmtree(b.out(name), ignore_errors=True)
        b.out(name).parent.mkdir(parents=True, exist_ok=True)
        os.sync()  # no writeback of an earlier contender's files runs during this one

    return setup


def _cache(kind: str, source: str) -> Callable[[Bench], None]:
    def setup(b: Bench) -> None:
        paths = [b.sources[source]]
        drop_caches(paths)
        if kind == "warm":
            warm_cache(paths)

    return setup


def _restore_target(b: Bench) -> None:
    """Give the target optimizer ordinary (not file-mapped) state tensors again after a lazy loader."""
    if b.target.optimizer is None:
        return
    for per_param in b.target.optimizer.state.values():
        for k, v in per_param.items():
            if isinstance(v, torch.Tensor):  # every one: a 1-element `step` view alone keeps the whole file mapped
                per_param[k] = v.clone()



def _accelerator(b: Bench, which: str):
    key = f"accelerator-{which}"
    if key not in b.extras:
        import accelerate

        acc = accelerate.Accelerator(cpu=True)
        state = b.state if which == "save" else b.target
        acc.prepare(*state.objects)
        b.extras[key] = acc
    return b.extras[key]


# --- saves -------------------------------------------------------------------------------------------------------


def _save_contenders() -> list[Contender]:
    def fast(model_only: bool, name: str) -> Contender:
        def run(b: Bench) -> Timing:
            return timed(lambda: fastckpt.save_state(*b.state.objects, output_dir=b.out(name), model_only=model_only))

        return Contender(name, "save", run, moves="model" if model_only else "full", setup=_fresh_out(name),
                         gpt_only=model_only)

    def fast_async(b: Bench) -> Timing:
        name = "fastckpt save_state async"
        return timed(lambda: fastckpt.save_state(*b.state.objects, output_dir=b.out(name), async_save=True).wait)

    def accelerate_save(b: Bench) -> Timing:
        acc, path = _accelerator(b, "save"), b.out("accelerate save_state")
        return timed(lambda: acc.save_state(str(path)), lambda: fsync_tree(path))

    def safetensors_save(b: Bench) -> Timing:
        from safetensors.torch import save_file

        path = b.out("safetensors save_file")
        path.mkdir(parents=True, exist_ok=True)
        file = path / "model.safetensors"
        sd = untied(b.state.model)
        return timed(lambda: save_file(sd, str(file)), lambda: fsync_tree(path))

    def torch_save(b: Bench) -> Timing:
        path = b.out("torch.save")
        path.mkdir(parents=True, exist_ok=True)
        file = path / "state.pt"
        obj = {"model": b.state.model.state_dict()}
        if b.state.optimizer is not None:
            obj["optimizer"] = b.state.optimizer.state_dict()
        return timed(lambda: torch.save(obj, file), lambda: fsync_tree(path))

    def raw(b: Bench) -> Timing:
        path = b.out("raw write")
        path.mkdir(parents=True, exist_ok=True)
        return raw_write(state_tensors(b.state), path / "raw.bin")

    def memcpy(b: Bench) -> Timing:
        flat = b.scratch

        def copy() -> None:  # into the pre-faulted scratch buffer, wrapping around (it may be smaller)
            at = 0
            for t in state_tensors(b.state):
                src = t.detach().reshape(-1).view(torch.uint8)
                done = 0
                while done < len(src):
                    n = min(len(src) - done, len(flat) - at)
                    flat[at : at + n].copy_(src[done : done + n])
                    done += n
                    at = (at + n) % len(flat)

        return timed(copy)

    names = ["raw write", "fastckpt save_state async", "accelerate save_state", "safetensors save_file", "torch.save"]
    return [
        Contender("raw write", "save", raw, setup=_fresh_out(names[0])),
        fast(False, "fastckpt save_state full"),
        fast(True, "fastckpt save_state model_only"),
        Contender(names[1], "save", fast_async, setup=_fresh_out(names[1])),
        Contender(names[2], "save", accelerate_save, setup=_fresh_out(names[2])),
        Contender(names[3], "save", safetensors_save, moves="model", setup=_fresh_out(names[3]), peer=True),
        Contender(names[4], "save", torch_save, setup=_fresh_out(names[4]), peer=True),
        Contender("memcpy of the state", "copy", memcpy),
    ]


# --- loads -------------------------------------------------------------------------------------------------------


def _load_contenders() -> list[Contender]:
    def raw(b: Bench) -> Timing:  # the very files fastckpt's loads read (see raw_read)
        return raw_read(b.sources["fastckpt"], b.scratch)

    def fast_existing(b: Bench) -> Timing:
        return timed(lambda: fastckpt.load_state(*b.target.objects, input_dir=b.sources["fastckpt"]))

    def fast_fresh_setup(kind: str) -> Callable[[Bench], None]:
        def setup(b: Bench) -> None:
            b.extras["fresh"] = build_state(b.workload, seed=3, stepped=False)
            _cache(kind, "fastckpt")(b)

        return setup

    def fast_fresh(b: Bench) -> Timing:
        return timed(lambda: fastckpt.load_state(*b.extras["fresh"].objects, input_dir=b.sources["fastckpt"]))

    def drop_fresh(b: Bench) -> None:
        b.extras.pop("fresh", None)

    def fast_lazy(b: Bench) -> Timing:
        file = b.sources["fastckpt"] / "model.safetensors"
        return timed(lambda: b.target.model.load_state_dict(fastckpt_torch.load_file(file), strict=False))

    def accelerate_load(b: Bench) -> Timing:
        acc = _accelerator(b, "load")
        return timed(lambda: acc.load_state(str(b.sources["accelerate"])))

    def safetensors_load(b: Bench) -> Timing:
        from safetensors.torch import load_file

        file = b.sources["safetensors"] / "model.safetensors"
        return timed(lambda: b.target.model.load_state_dict(load_file(str(file)), strict=False))

    def torch_load(b: Bench) -> Timing:
        file = b.sources["torch"] / "state.pt"
        loaded: list = []

        def load() -> None:
            sd = torch.load(file, mmap=True, weights_only=True)
            b.target.model.load_state_dict(sd["model"])
            if b.target.optimizer is not None:
                b.target.optimizer.load_state_dict(sd["optimizer"])
                loaded.extend(v for s in b.target.optimizer.state.values() for v in s.values())

        return timed(load, lambda: touch_pages([t for t in loaded if isinstance(t, torch.Tensor)]))

    out: list[Contender] = []
    for kind in ("cold", "warm"):
        out += [
            Contender("raw read", "load", raw, cache=kind, setup=_cache(kind, "fastckpt")),
            Contender("fastckpt load_state existing", "load", fast_existing, cache=kind,
                      setup=_cache(kind, "fastckpt")),
            Contender("accelerate load_state", "load", accelerate_load, cache=kind, setup=_cache(kind, "accelerate")),
        ]
    out += [
        Contender("fastckpt load_state fresh", "load", fast_fresh, cache="cold", setup=fast_fresh_setup("cold"),
                  teardown=drop_fresh, peer=True),
        Contender("fastckpt.torch.load_file lazy", "load", fast_lazy, cache="cold", moves="model",
                  setup=_cache("cold", "fastckpt"), peer=True),
        Contender("safetensors load_file", "load", safetensors_load, cache="cold", moves="model",
                  setup=_cache("cold", "safetensors"), peer=True),
        Contender("torch.load mmap", "load", torch_load, cache="cold", setup=_cache("cold", "torch"),
                  teardown=_restore_target, peer=True),
    ]
    return out


def contenders(workload: Workload) -> list[Contender]:
    """The contenders that apply to ``workload`` (the single tensor has no optimizer and no tied weights)."""
    from benches._peers import peer_contenders

    every = _save_contenders() + _load_contenders() + peer_contenders(Contender, _cache)
    return [c for c in every if not (c.gpt_only and workload.single_tensor) and (workload.peers or not c.peer)]


def prepare_sources(b: Bench) -> None:
    """Write the checkpoints the loads read (one per format; safetensors and torch.save only for workloads with
    ``peers``), durably; the raw read baseline reads fastckpt's."""
    from safetensors.torch import save_file

    src = b.root / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    b.sources["fastckpt"] = fastckpt.save_state(*b.state.objects, output_dir=src / "fastckpt")
    b.sources["accelerate"] = src / "accelerate"
    _accelerator(b, "save").save_state(str(src / "accelerate"))
    if b.workload.peers:
        b.sources["safetensors"] = src / "safetensors"
        b.sources["safetensors"].mkdir()
        save_file(untied(b.state.model), str(src / "safetensors" / "model.safetensors"))
        b.sources["torch"] = src / "torch"
        b.sources["torch"].mkdir()
        obj = {"model": b.state.model.state_dict()}
        if b.state.optimizer is not None:
            obj["optimizer"] = b.state.optimizer.state_dict()
        torch.save(obj, src / "torch" / "state.pt")
    if b.workload.peers and not b.workload.single_tensor:
        from benches._peers import prepare_peer_sources

        prepare_peer_sources(b)
    fsync_tree(src)

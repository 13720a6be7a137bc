"""The coordinator's planning cost at 1024-4096 ranks, modelled in one process on synthetic per-rank plans.

Usage::

    python benches/planning_scale.py                    # ranks 256..4096; prints the table
    python benches/planning_scale.py --ranks 1024,2048,4096 --tensors 32

No process group: the same code a sharded save / load runs on the coordinator is fed the plans N ranks would send
for an FSDP2 model (every weight and bias ``Shard(0)`` over the N ranks, AdamW's ``exp_avg`` / ``exp_avg_sq`` alike,
its ``step`` replicated on every rank, as FSDP2 gives them):

- ``global plan``: ``fastckpt.dcp.SavePlanner.create_global_plan``: DCP's global plan (dedup of the replicated
  items, the metadata merge, the chunk-overlap validation) made over columns by
  :func:`fastckpt.dcp.global_plan.merge_save_plans` (DCP's output, object for object), with and without plan caching (``enable_plan_caching=True``, the second
  save of an unchanged state);
- ``writer``: ``fastckpt.dcp.StorageWriter.prepare_global_plan`` and ``finish`` (every rank's write results merged
  into ``dcp_metadata.json`` and ``dcp_index.bin``, written; the results themselves are made before, as the ranks
  make them);
- ``manifest``: fastckpt's manifest merge (:func:`fastckpt._io.storage.local.layout.manifest_dict` over every rank's shard file
  and RNG file, serialised);
- ``rank load plan``: one rank's own load planning (``DefaultLoadPlanner`` over the merged metadata, for its own
  rows of every tensor), which DCP runs on every rank;
- ``rank metadata parse``: one rank's reading of the merged ``dcp_metadata.json`` (every rank parses and checks
  it on load: N chunks per tensor, their cover checked).
- ``rank index read + load plan``: what one rank does to plan its load over the folder's ``dcp_index.bin`` (read
  its header, plan with the chunks its boxes overlap, look up each chunk it reads; ``dcp_metadata.json`` is never
  read); ``, committed folder``: the same over the folder as ``fastckpt.dcp.save`` commits it, whose manifest
  ``fastckpt.json`` (one entry per rank's shard file) the reader also reads.
- ``rank manifest read``: one rank's parse of the checkpoint's manifest, which still lists every rank's files (the
  modelled entries carry no per-tensor crc32c / xxh3, so this is a lower bound of the real manifest's cost).

``--llm N`` adds an 8B Llama-shaped FSDP2 + AdamW state on N ranks (accelerate#4099: 2816), with ``--llm-layers``
of its 32 decoder layers (default 4: every layer has the same per-rank shape, see :func:`llm_model`).
``--writer-ab N`` runs only a same-run A/B of the metadata + index writer (the per-chunk one it replaced against
the column one, same bytes checked).

Work is counted as Python function calls (``sys.setprofile``: every ``call`` and ``c_call`` event), which is
deterministic; CPU seconds of the process (``time.process_time``) are printed beside it, with the
profiler's overhead, or without it (and without counts) under ``--no-count``. ``ops ratio`` is each world's count over the previous world's:
at most ~2 when a world twice as large costs at most twice as much (linear).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS_PER_RANK = 4
COLS = 64
LAST_WALL = 0.0  # wall seconds of the last count_ops call
PROFILE = True  # count calls (sys.setprofile); --no-count times without the profiler's overhead


def _index(fqn: str, offsets: tuple[int, ...]) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(fqn, torch.Size(offsets))


def linear_model(world: int, tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """``tensors`` Linear layers whose weight [4N, 64] and bias [4N] give every rank 4 rows."""
    return [(name, shape) for t in range(tensors)
            for name, shape in ((f"layers.{t}.weight", (world * ROWS_PER_RANK, COLS)),
                                (f"layers.{t}.bias", (world * ROWS_PER_RANK,)))]


def llm_model(world: int, layers: int = 32) -> list[tuple[str, tuple[int, ...]]]:
    """An 8B Llama-shaped decoder (hidden 4096, 8 KV heads of 128, MLP 14336, vocabulary 128256): 291 tensors at
    32 layers. Every layer has the same 9 tensors, so each rank's share of each layer (its ``Shard(0)`` blocks, the
    chunks per tensor) is the same whatever the number of layers: the coordinator's work is the embeddings' and
    head's plus ``layers`` times one layer's, and fewer layers model the same per-rank shape in less memory (all
    32 at 2816 ranks are ~3.3 M plan items, ~14 GB in this one process)."""
    h, kv, mlp, vocab = 4096, 1024, 14336, 128256
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (mlp, h)), (p + "mlp.up_proj.weight", (mlp, h)),
                (p + "mlp.down_proj.weight", (h, mlp)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def row_block(rows: int, world: int, r: int) -> tuple[int, int]:
    """``(offset, rows)`` of rank r's ``Shard(0)`` block of ``rows`` rows (torch.chunk's split, as FSDP2's)."""
    per = -(-rows // world)
    start = min(rows, r * per)
    return start, min(rows, start + per) - start


def rank_plans(world: int, tensors: int, model: Any = None) -> list[Any]:
    """The ``SavePlan`` each of ``world`` ranks sends for the model + AdamW state (see the module docs).
    ``model``: ``[(fqn, shape)]`` (default: :func:`linear_model`); a rank whose block of a tensor is empty (more
    ranks than rows) sends no chunk of it."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties(dtype=torch.float32)
    spec = model if model is not None else linear_model(world, tensors)
    step = ChunkStorageMetadata(torch.Size([]), torch.Size([]))
    plans = []
    for r in range(world):
        items = []
        for name, shape in spec:
            start, n = row_block(shape[0], world, r)
            if n:
                offsets = (start,) + (0,) * (len(shape) - 1)
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size((n,) + shape[1:]))
                for state in ("", "state.exp_avg.", "state.exp_avg_sq."):
                    items.append(WriteItem(_index(state + name, offsets), WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(chunk, props, torch.Size(shape))))
            items.append(WriteItem(_index(f"state.step.{name}", ()), WriteItemType.TENSOR,
                                   tensor_data=TensorWriteData(step, props, torch.Size([]))))
        plans.append(SavePlan(items))
    return plans


def count_ops(fn: Callable[[], Any]) -> tuple[int, float, Any]:
    """``(Python and C function calls made by fn(), seconds, fn's result)``: CPU seconds of this process
    (``time.process_time``: on a shared machine the wall time mostly measures the other processes)."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" or event == "c_call":
            calls += 1

    global LAST_WALL
    start = time.process_time()
    wall = time.perf_counter()
    if PROFILE:
        sys.setprofile(profile)
    try:
        out = fn()
    finally:
        if PROFILE:
            sys.setprofile(None)
    LAST_WALL = time.perf_counter() - wall
    return calls, time.process_time() - start, out


CACHE_KEY = "planning-scale"


def global_plan(plans: list[Any], *, caching: bool = False) -> tuple[list[Any], Any]:
    """DCP's global planning as a sharded save runs it: ``fastckpt.dcp.SavePlanner`` (DCP's default planner, its
    merge with the garbage collector paused; plans cached per part)."""
    import fastckpt.dcp

    planner = fastckpt.dcp.SavePlanner(cache_key=CACHE_KEY if caching else None, flatten_state_dict=False)
    return planner.create_global_plan(plans)


def write_results(world: int, plans: list[Any]) -> list[list[Any]]:
    """The write results every rank sends back for its part of the global plan ``plans`` (made by the ranks, so
    outside the coordinator's measured step): one file per rank, one digest list shared by its results."""
    from torch.distributed.checkpoint.storage import WriteResult

    from fastckpt.dcp.writer import _chunk_name, shard_file_name

    results = []
    for r, plan in enumerate(plans):
        file = shard_file_name(r, world)
        digests = [(file, (1 << 20, 0, [], []))]  # one list per rank, shared by its results as write_data does
        rank_results = []
        for item in plan.items:
            chunk = item.tensor_data.chunk
            name = _chunk_name(item.index.fqn, chunk.offsets, chunk.sizes, item.tensor_data.size)
            rank_results.append(WriteResult(index=item.index, size_in_bytes=4, storage_data={
                "file": file, "name": name, "digests": digests}))
        results.append(rank_results)
    return results


def writer_merge(world: int, plans: list[Any], metadata: Any, folder: pathlib.Path,
                 results: list[list[Any]]) -> dict[str, Any]:
    """The fastckpt.dcp writer's coordinator steps on ``plans``: storage data per rank, then ``finish`` over the
    ranks' ``results`` (:func:`write_results`)."""
    import fastckpt.dcp
    from fastckpt.dcp.writer import shard_file_name

    writer = fastckpt.dcp.StorageWriter(folder, commit=False, durable=False)
    writer.set_up_storage_writer(True)
    final = writer.prepare_global_plan(plans)
    assert [p.storage_data["file"] for p in final] == [shard_file_name(r, world) for r in range(world)]
    writer.finish(metadata, results)
    assert set(writer.files) >= {shard_file_name(r, world) for r, p in enumerate(final) if p.items}
    return writer.files


def manifest_merge(world: int, dcp_files: dict[str, Any]) -> str:
    """fastckpt's manifest of a sharded save with ``world`` RNG files and the DCP part's files."""
    import json

    from fastckpt._io.storage.local.layout import manifest_dict, random_states_name

    files = {random_states_name(r): 2048 for r in range(world)}
    checksums = {name: {"crc32c": "00000000"} for name in files}
    sharded = {"storage": "fastckpt.dcp", "world_size": world, "aliases": [{}], "parts": ["model"],
               "files": {f"model/{k}": v for k, v in dcp_files.items()}}
    counts = {"models": 1, "optimizers": 1, "schedulers": 0, "processes": world, "sharded": sharded}
    return json.dumps(manifest_dict("full", files, counts, 0, checksums=checksums), indent=2)


def rank_manifest_read(text: str) -> int:
    """What every rank of a sharded ``load_state`` does with the manifest today: parse all of it (every rank's RNG
    file and shard file entries) and pick its part's checksums (``_plan/sharded_load.py``)."""
    import json

    manifest = json.loads(text)
    sharded = manifest["sharded"]
    checksums = {n[len("model/"):]: info for n, info in sharded.get("files", {}).items() if n.startswith("model/")}
    return len(checksums) + len(manifest.get("files", {}))


def rank_load_plan(world: int, tensors: int, metadata: Any) -> Any:
    """Rank ``world // 2``'s own DCP load plan over the merged metadata (its rows of every tensor)."""
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: F401  (DCP's plan items)

    r = world // 2
    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if len(md.size) == 0:
            state[fqn] = torch.empty(())
    # plain local tensors cannot say which rows they are: planning them as DCP plans a rank's DTensor shard
    # needs the shard's offsets, so the overlap test below is what DCP runs (create_read_items_for_chunk_list)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    items = []
    for fqn, md in metadata.state_dict_metadata.items():
        if len(md.size) == 0:
            continue
        offsets = (r * ROWS_PER_RANK,) + (0,) * (len(md.size) - 1)
        sizes = (ROWS_PER_RANK,) + tuple(md.size[1:])
        items += create_read_items_for_chunk_list(fqn, md, [ChunkStorageMetadata(torch.Size(offsets),
                                                                                torch.Size(sizes))])
    plan = create_default_local_load_plan(state, metadata, strict=False)
    return len(items) + len(plan.items)


class _Shard(torch.Tensor):
    """A stand-in for a rank's DTensor in DCP's load planning: the global size (an expanded one-element tensor:
    no memory) and ``__create_chunk_list__`` giving this rank's block, as a DTensor does."""

    _chunks: list[Any]

    def __create_chunk_list__(self) -> list[Any]:
        return self._chunks


def rank_state(world: int, r: int, metadata: Any) -> dict[str, Any]:
    """Rank r's load state dict over ``metadata``'s tensors: its row block of each (FSDP2's ``Shard(0)``)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        shape = tuple(md.size)
        t = torch.empty(1).expand(*shape).as_subclass(_Shard) if shape else torch.empty(()).as_subclass(_Shard)
        start, n = row_block(shape[0], world, r) if shape else (0, 0)
        offsets, sizes = ((start,) + (0,) * (len(shape) - 1), (n,) + shape[1:]) if shape else ((), ())
        t._chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))]
        state[fqn] = t
    return state


def commit_manifest(folder: pathlib.Path, files: dict[str, Any]) -> None:
    """Write the ``fastckpt.json`` a committing ``fastckpt.dcp.StorageWriter`` (``fastckpt.dcp.save``) writes
    into the folder it commits: one entry per file of the save (every rank's shard file)."""
    import json

    from fastckpt._io.storage.local.layout import MANIFEST, manifest_dict

    sizes = {name: entry["bytes"] for name, entry in files.items()}
    checksums = {name: {k: v for k, v in entry.items() if k != "bytes"} for name, entry in files.items()}
    (folder / MANIFEST).write_text(json.dumps(manifest_dict("dcp", sizes, {"layout": "dcp"}, 0, checksums=checksums),
                                              indent=2))


def rank_load_indexed(world: int, folder: pathlib.Path) -> tuple[int, int]:
    """What one rank (``world // 2``) does to plan a load over an indexed folder: ``StorageReader.read_metadata``
    (the index's header), ``fastckpt.dcp.LoadPlanner`` (the chunks its boxes overlap, by binary search; DCP's
    planning over them) and the reader's lookups of every chunk its plan reads (file, name, sizes).
    Returns (read items, index bytes looked at)."""
    import fastckpt.dcp

    reader = fastckpt.dcp.StorageReader(folder)
    metadata = reader.read_metadata()
    planner = fastckpt.dcp.LoadPlanner()
    planner.set_up_planner(rank_state(world, world // 2, metadata), metadata, False)
    plan = planner.create_local_plan()
    reader._needed(plan.items)
    return len(plan.items), reader._parsed.index.bytes_read


def measure(world: int, tensors: int, model: Any = None, *, full: bool = True) -> dict[str, tuple[int, float]]:
    """Ops and seconds of each coordinator step (and one rank's load planning) at ``world`` ranks (``full``: also
    one rank's planning and parse over the whole ``dcp_metadata.json``, what a rank did before the index)."""
    plans = rank_plans(world, tensors, model)
    out: dict[str, tuple[int, float]] = {}
    ops, secs, (final, metadata) = count_ops(lambda: global_plan(plans))
    out["global plan"] = (ops, secs)
    walls = [LAST_WALL]
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in (SavePlanner._cached_all_plans, SavePlanner._cached_global_plan, SavePlanner._cached_metadata):
        cache.pop(f"fastckpt.dcp:{CACHE_KEY}", None)
    global_plan(plans, caching=True)  # the first save fills the cache
    from torch.distributed.checkpoint.planner import SavePlan

    unchanged = [SavePlan([], usable=False) for _ in range(world)]  # what ranks send when their plan is cached
    ops, secs, _ = count_ops(lambda: global_plan(unchanged, caching=True))
    out["global plan, cached"] = (ops, secs)
    tmp = tempfile.TemporaryDirectory(prefix="fastckpt-scale-")
    folder = pathlib.Path(tmp.name) / "model"
    results = write_results(world, final)
    ops, secs, files = count_ops(lambda: writer_merge(world, final, metadata, folder, results))
    text = (folder / "dcp_metadata.json").read_bytes()
    out["writer"] = (ops, secs)
    walls.append(LAST_WALL)
    ops, secs, manifest_text = count_ops(lambda: manifest_merge(world, files))
    out["manifest"] = (ops, secs)
    walls.append(LAST_WALL)
    out["coordinator total"] = (sum(out[k][0] for k in ("global plan", "writer", "manifest")),
                                sum(out[k][1] for k in ("global plan", "writer", "manifest")))
    out["coordinator total, wall s"] = (0, sum(walls))
    if full:
        ops, secs, _ = count_ops(lambda: rank_load_plan(world, tensors, metadata))
        out["rank load plan, full metadata"] = (ops, secs)
        from fastckpt._format.dcp_metadata import parse_metadata

        ops, secs, _ = count_ops(lambda: parse_metadata(text, "dcp_metadata.json"))
        out["rank metadata parse, full metadata"] = (ops, secs)
    ops, secs, (items, looked_at) = count_ops(lambda: rank_load_indexed(world, folder))
    out["rank index read + load plan"] = (ops, secs)
    commit_manifest(folder, files)  # the same folder as fastckpt.dcp.save commits it: the reader reads its manifest
    ops, secs, _ = count_ops(lambda: rank_load_indexed(world, folder))
    out["rank index read + load plan, committed folder (+ its manifest)"] = (ops, secs)
    ops, secs, _ = count_ops(lambda: rank_manifest_read(manifest_text))
    out["rank manifest read (every rank's entries)"] = (ops, secs)
    out["dcp_metadata.json KB"] = (0, len(text) / 1e3)
    out["manifest (no per-tensor crcs modelled) KB"] = (0, len(manifest_text) / 1e3)
    out["dcp_index.bin KB"] = (0, (folder / "dcp_index.bin").stat().st_size / 1e3)
    out["index read by a rank KB"] = (0, looked_at / 1e3)
    tmp.cleanup()
    return out


def writer_ab(world: int, tensors: int, rounds: int = 5) -> None:
    """Same-run A/B of the coordinator's ``dcp_metadata.json`` + ``dcp_index.bin`` building on one set of plans and
    write results: the per-chunk writer this replaced (``tests/helpers/dcp_reference_writer.py``) against
    ``StorageWriter._metadata_text`` (columns), alternated, CPU seconds, garbage collector paused for both (as
    ``finish`` pauses it); prints each round and the median of the per-round ratios. Both give the same bytes."""
    import gc

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.dcp_reference_writer import reference_files_and_text

    import fastckpt.dcp

    plans = rank_plans(world, tensors)
    final, metadata = global_plan(plans)
    results = write_results(world, final)
    writer = fastckpt.dcp.StorageWriter("unused", commit=False)
    ratios = []
    for k in range(rounds):
        secs = {}
        for name in (("reference", "columns") if k % 2 == 0 else ("columns", "reference")):
            gc.disable()
            start = time.process_time()
            if name == "reference":
                out = reference_files_and_text(metadata, results)
            else:
                out = writer._metadata_text(metadata, results)[:2]
            secs[name] = time.process_time() - start
            gc.enable()
            secs[name + " bytes"] = out
        assert secs["reference bytes"] == secs["columns bytes"]
        ratios.append(secs["columns"] / secs["reference"])
        print(f"round {k}: reference {secs['reference']:.3f} s, columns {secs['columns']:.3f} s, "
              f"ratio {ratios[-1]:.2f}")
    print(f"writer A/B at N={world}: median per-round ratio columns / reference {statistics.median(ratios):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="256,512,1024,2048,4096")
    parser.add_argument("--tensors", type=int, default=16, help="Linear layers (weight + bias each)")
    parser.add_argument("--llm", type=int, default=0, metavar="N",
                        help="also model an 8B Llama-shaped FSDP2 + AdamW state on N ranks (accelerate#4099: 2816)")
    parser.add_argument("--llm-layers", type=int, default=4, metavar="L",
                        help="decoder layers of the --llm model (of the 8B model's 32; see llm_model)")
    parser.add_argument("--repeat", type=int, default=1, metavar="R",
                        help="measure every world R times (in turn) and print the median seconds (calls are exact)")
    parser.add_argument("--no-full", action="store_true",
                        help="skip the rows over the whole dcp_metadata.json (what a rank did before the index)")
    parser.add_argument("--writer-ab", type=int, default=0, metavar="N",
                        help="only the same-run A/B of the metadata + index writer (per-chunk vs columns) at N ranks")
    parser.add_argument("--no-count", "--wall-only", dest="no_count", action="store_true",
                        help="time without counting calls (no profiler)")
    args = parser.parse_args()
    global PROFILE
    PROFILE = not args.no_count
    sys.path.insert(0, str(ROOT / "python"))
    if args.writer_ab:
        writer_ab(args.writer_ab, args.tensors)
        return
    worlds = [int(w) for w in args.ranks.split(",")]
    print(f"synthetic FSDP2 plans: {args.tensors} x (weight [{ROWS_PER_RANK}N, {COLS}] + bias [{ROWS_PER_RANK}N]) "
          "+ AdamW (exp_avg, exp_avg_sq sharded, step replicated); N ranks; ops = Python/C calls, s = CPU seconds")
    print("| step | " + " | ".join(f"N={w}" for w in worlds) + " | ops ratio per doubling |")
    print("|---|" + "---|" * (len(worlds) + 1))
    measure(64, args.tensors)  # warm-up (imports, first calls): not reported
    runs: dict[int, list[dict[str, tuple[int, float]]]] = {w: [] for w in worlds}
    for _ in range(args.repeat):  # the worlds in turn, each round: the machine's load hits them alike
        for w in worlds:
            runs[w].append(measure(w, args.tensors, full=not args.no_full))
    rows = {w: {step: (rs[0][step][0], statistics.median(r[step][1] for r in rs)) for step in rs[0]}
            for w, rs in runs.items()}
    _table(rows, worlds)
    if args.llm:
        world = args.llm
        model = llm_model(world, args.llm_layers)
        print(f"\n8B Llama-shaped model, {args.llm_layers} of its 32 decoder layers ({len(model)} of 291 tensors, "
              f"Shard(0) over N ranks by torch.chunk's split) + AdamW, N={world}")
        print(f"| step | N={world} |\n|---|---|")
        llm = measure(world, 0, model, full=False)
        for step, (ops, secs) in llm.items():
            print(f"| {step} | {_cell(step, ops, secs)} |")


def _cell(step: str, ops: int, secs: float) -> str:
    if step.endswith(" KB"):
        return f"{secs:.1f}"
    if step.endswith("wall s"):
        return f"{secs:.3f} s"
    return f"{secs:.3f} s ({ops / 1e6:.3f} M ops)" if ops < 1e5 else f"{secs:.3f} s ({ops / 1e6:.2f} M ops)"


def _table(rows: dict[int, dict[str, tuple[int, float]]], worlds: list[int]) -> None:
    for step in rows[worlds[0]]:
        cells = [_cell(step, *rows[w][step]) for w in worlds]
        ratios = [rows[b][step][0] / max(1, rows[a][step][0]) for a, b in zip(worlds, worlds[1:])]
        ratio = ", ".join(f"{x:.2f}" for x in ratios) if rows[worlds[0]][step][0] else "-"
        print(f"| {step} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()

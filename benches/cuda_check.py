"""One script for a machine with a GPU: install the prebuilt wheel, check the CUDA paths, time them, print a table.

Run from the repository root on the device machine (no network, no Rust toolchain, its own torch)::

    python benches/cuda_check.py                 # installs dist/*.whl with --no-deps first
    python benches/cuda_check.py --no-install --gb 2 --rounds 2

Build the wheel beforehand on a machine with Rust: ``maturin build --release -o dist`` (abi3, any Python >= 3.11).

1. Correctness: ``tests/io/test_cuda.py``, ``tests/io/test_async_save.py``, ``tests/io/test_async_stream.py`` and
   ``tests/format/test_gil.py`` with pytest when it is installed; without pytest, the ``test_*`` functions of
   ``tests/io/test_cuda.py`` are called directly.
2. Timing, on a GPT-style state (fp32 weights + AdamW moments on the GPU, ``--gb`` GB in all), each contender
   once per round, alternated, medians: the device-to-host copy of the state into pinned memory (the PCIe limit),
   the raw sequential write / read of the same bytes (the disk limit), fastckpt's synchronous save (chunked copies
   overlapping the writes), the same save with the overlap switched off, the async save (blocking time and time to
   durable), ``torch.save`` of the GPU state dicts (+ fsync), and loads into the existing GPU state (warm and cold
   page cache) against ``torch.load(map_location="cuda")``. Writes ``$OUT/cuda_check.json`` when ``$OUT`` is set.
3. The training loop (:mod:`benches._cuda_train`): the same state training on the GPU, a checkpoint between two
   steps: the call's blocking time, the forward/backward pass and the ``optimizer.step()`` after the call (its
   stall against max(0, copy time - forward/backward time) + 5 ms), for fastckpt's streaming async save, the
   snapshot one and DCP ``async_save`` with its pinned ``DefaultStager``. ``--no-train-loop`` skips it.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent


def install_wheel() -> None:
    wheels = sorted(glob.glob(str(ROOT / "dist" / "fastckpt-*.whl")))
    if not wheels:
        sys.exit(f"no wheel in {ROOT / 'dist'}: build one with `maturin build --release -o dist`")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-index", "-q", wheels[-1]]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def run_checks() -> bool:
    """The correctness checks; True when all passed."""
    files = ["tests/io/test_cuda.py", "tests/io/test_async_save.py", "tests/io/test_async_stream.py",
             "tests/format/test_gil.py"]
    if importlib.util.find_spec("pytest") is not None:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-o", "addopts=", *files]
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc in (0, 1):  # ran: passed / some failed
            return rc == 0
        print(f"pytest could not run these files (exit {rc})", flush=True)
    print("calling the test_* functions of tests/test_cuda.py directly", flush=True)
    sys.path.insert(0, str(ROOT / "tests"))  # the test module imports helpers.*
    spec = importlib.util.spec_from_file_location("test_cuda", ROOT / "tests" / "io" / "test_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ok = True
    for name in sorted(n for n in dir(module) if n.startswith("test_")):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                getattr(module, name)(pathlib.Path(tmp))
                print(f"PASS {name}", flush=True)
            except Exception:
                ok = False
                print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    return ok


def _gpu_state(gb: float):
    import torch

    from fastckpt.demo.gpt2 import GPT, GPTConfig

    width, vocab = 2048, 32768
    params = gb * 1e9 / 12  # fp32 weights + two AdamW moments: 12 bytes per parameter
    layers = max(1, round((params - vocab * width) / (12 * width * width)))
    config = GPTConfig(vocab_size=vocab, block_size=1024, n_layer=layers, n_head=16, n_embd=width, dropout=0.0)
    with torch.device("cuda"):
        model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return model, optimizer


def time_cuda_path(gb: float, rounds: int, folder: pathlib.Path,
                   train_loop: bool = True) -> tuple[list[tuple[str, list[float], list[float], int]], list[str]]:
    """Rows ``(name, returned seconds per round, done seconds per round, bytes)``, and the training-loop table's
    lines (empty with ``train_loop=False``)."""
    import torch

    import fastckpt
    from benches._measure import drop_caches, fsync_tree, raw_read, raw_write
    from fastckpt._io import async_writer as _async
    from fastckpt._io.commit import write_checkpoint
    from fastckpt._plan.save import build_save_plan

    model, optimizer = _gpu_state(gb)
    tensors = [*{t.data_ptr(): t for t in model.state_dict().values()}.values()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if v.numel() > 1]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host = [pinned[0:0]]  # filled by the d2h contender; the raw baselines write / read these host bytes
    print(f"state: {nbytes / 1e9:.2f} GB on {torch.cuda.get_device_name(0)}", flush=True)

    def d2h():
        at = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            pinned[at : at + n].copy_(t.detach().reshape(-1).view(torch.uint8), non_blocking=True)
            at += n
        torch.cuda.synchronize()
        host[0] = pinned

    def save_sync(path):
        fastckpt.save_state(model, optimizer, output_dir=path)

    def save_no_overlap(path):
        plan = build_save_plan([model], [optimizer], [], model_only=False)
        _async.default_saver().submit(plan, path.absolute(), write=write_checkpoint, blocking=False).wait()

    def torch_save(path):
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path / "state.pt")

    results: dict[str, tuple[list[float], list[float]]] = {}

    def record(name: str, returned: float, done: float) -> None:
        r, d = results.setdefault(name, ([], []))
        r.append(returned)
        d.append(done)

    def timed(name: str, fn, finish=None) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        more = fn()
        returned = time.perf_counter() - start
        for f in (more, finish):
            if callable(f):
                f()
        record(name, returned, time.perf_counter() - start)

    d2h()
    fastckpt.save_state(model, optimizer, output_dir=folder / "warmup", async_save=True).wait()  # pool: once
    fastckpt.save_state(model, optimizer, output_dir=folder / "src")
    torch_save(folder / "torch-src")
    shutil.rmtree(folder / "warmup")
    for r in range(rounds):
        order = ["d2h", "raw", "sync", "no_overlap", "async", "torch", "load_warm", "load_cold", "torch_load"]
        order = order[r % len(order):] + order[: r % len(order)]
        for what in order:
            out = folder / f"out-{what}"
            shutil.rmtree(out, ignore_errors=True)
            drop_caches([])
            if what == "d2h":
                timed("device-to-host copy into pinned memory", d2h)
            elif what == "raw":
                out.mkdir()
                t = raw_write([host[0]], out / "raw.bin")
                record("raw write (host bytes, + fsync)", t.returned, t.done)
                drop_caches([out])
                t = raw_read(out / "raw.bin", pinned)
                record("raw read (cold)", t.returned, t.done)
            elif what == "sync":
                timed("fastckpt save_state sync (durable)", lambda o=out: save_sync(o))
            elif what == "no_overlap":
                timed("fastckpt save, copies then writes (no overlap)", lambda o=out: save_no_overlap(o))
            elif what == "async":
                timed("fastckpt save_state async (returned / durable)", lambda o=out: fastckpt.save_state(
                    model, optimizer, output_dir=o, async_save=True).wait)
            elif what == "torch":
                timed("torch.save GPU state dicts (+ fsync)", lambda o=out: torch_save(o), lambda o=out: fsync_tree(o))
            elif what == "load_warm":
                fastckpt.load_state(model, optimizer, input_dir=folder / "src")
                timed("fastckpt load_state into GPU state (warm)",
                      lambda: fastckpt.load_state(model, optimizer, input_dir=folder / "src"))
            elif what == "load_cold":
                drop_caches([folder / "src"])
                timed("fastckpt load_state into GPU state (cold)",
                      lambda: fastckpt.load_state(model, optimizer, input_dir=folder / "src"))
            elif what == "torch_load":
                def load() -> None:
                    sd = torch.load(folder / "torch-src" / "state.pt", map_location="cuda", weights_only=True)
                    model.load_state_dict(sd["model"])
                    optimizer.load_state_dict(sd["optimizer"])

                drop_caches([folder / "torch-src"])
                timed("torch.load(map_location='cuda') + load_state_dict (cold)", load)
            shutil.rmtree(out, ignore_errors=True)
    loop_lines: list[str] = []
    if train_loop:
        from benches._cuda_train import time_train_loop

        try:
            loop_lines = time_train_loop(model, optimizer, folder, rounds)
        except Exception:  # reported, the rest of the results still count
            loop_lines = ["training loop failed:", "```", traceback.format_exc(), "```"]
    return [(name, r, d, nbytes) for name, (r, d) in results.items()], loop_lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-install", action="store_true", help="use the installed fastckpt")
    parser.add_argument("--gb", type=float, default=4.0, help="total state size in GB (default 4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--no-train-loop", action="store_true", help="skip the training-loop timing")
    parser.add_argument("--dir", default=os.environ.get("FASTCKPT_BENCH_DIR", tempfile.gettempdir()))
    args = parser.parse_args()
    t0 = time.perf_counter()
    if not args.no_install:
        install_wheel()
    sys.path.insert(0, str(ROOT))  # benches._measure (fastckpt itself comes from the installed wheel)
    import torch

    import fastckpt

    print(f"fastckpt {fastckpt.__version__} from {pathlib.Path(fastckpt.__file__).parent}; torch {torch.__version__}; "
          f"Python {sys.version.split()[0]}; CUDA {torch.cuda.is_available()}", flush=True)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 1
    ok = True if args.skip_checks else run_checks()
    print(f"correctness checks: {'passed' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s so far)", flush=True)
    folder = pathlib.Path(args.dir) / f"fastckpt-cuda-{os.getpid()}"
    folder.mkdir(parents=True)
    try:
        rows, loop_lines = time_cuda_path(args.gb, args.rounds, folder, train_loop=not args.no_train_loop)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    from benches._measure import machine_description

    lines = [f"Machine: {machine_description(pathlib.Path(args.dir))}. {args.rounds} rounds, medians, GB = 1e9 bytes; "
             "x raw: the raw write's (saves) or cold raw read's (loads) done time over this one's, per round, median.",
             "", "| contender | GB | returned s | done s | GB/s (done) | x raw |", "|---|---:|---:|---:|---:|---:|"]
    raw = {"save": next((d for n, _, d, _ in rows if n.startswith("raw write")), None),
           "load": next((d for n, _, d, _ in rows if n.startswith("raw read")), None)}
    for name, returned, done, nbytes in rows:
        r, d = statistics.median(returned), statistics.median(done)
        base = raw["load" if "load" in name else "save"] if ("save" in name or "load" in name) else None
        ratio = f"{statistics.median(b / x for b, x in zip(base, done)):.2f}x" if base else ""
        lines.append(f"| {name} | {nbytes / 1e9:.2f} | {r:.3f} | {d:.3f} | {nbytes / 1e9 / d:.2f} | {ratio} |")
    lines += ["", *loop_lines]
    print("\n".join(lines), flush=True)
    if os.environ.get("OUT"):
        payload = {"ok": ok, "table": lines, "rows": [(n, r, d, b) for n, r, d, b in rows]}
        pathlib.Path(os.environ["OUT"], "cuda_check.json").write_text(json.dumps(payload, indent=1))
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

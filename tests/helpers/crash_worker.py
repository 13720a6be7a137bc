"""A process that saves a training state and can be killed mid-save (tests/test_crash_kill.py,
tests/test_concurrent_saves.py, tests/test_resource_faults.py run it, sometimes under strace).

    python tests/helpers/crash_worker.py SEED MB TARGET [--auto] [--threads N] [--repeat K] [--go] [--as-user UID]
                                         [--hold-manifest] [--remote URL]

Builds :func:`build_state` (deterministic in SEED: a model of MB mebibytes of float32 weights, AdamW after one step,
StepLR), prints ``ready`` and flushes (with ``--go``, then waits for a line on stdin), then calls ``fastckpt.save_state`` (``output_dir=TARGET``, or
``project_dir=TARGET`` with ``--auto``) K times, printing ``saved <path> <seconds>`` after each; on an error prints
``error <ExceptionClass> <errno> <message>`` and exits 3. With ``--hold-manifest`` the first save, once every data
file is in its staging folder, prints ``staged`` and waits for a line on stdin before it writes its manifest and
commits (a handshake in place of a delay).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

WIDTH = 1024  # one weight row of float32 = 4 KiB; a 256-row weight = 1 MiB


class BigNet(nn.Module):
    """``MB`` weights of 256 x 1024 float32 (1 MiB each) and one bias."""

    def __init__(self, mb: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.empty(256, WIDTH)) for _ in range(mb))
        self.bias = nn.Parameter(torch.empty(WIDTH))


def build_state(seed: int, mb: int):
    """(model, optimizer, scheduler), bit-identical for the same (seed, mb) in any process."""
    g = torch.Generator().manual_seed(seed)
    model = BigNet(mb)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return model, opt, sched


def _hold_before_manifest() -> None:
    from fastckpt._io.storage.local import commit

    real, held = commit.write_text, []

    def write_text(path, text, durable):
        if path.name == commit.MANIFEST and not held:
            held.append(path)
            print("staged", flush=True)
            sys.stdin.readline()
        return real(path, text, durable)

    commit.write_text = write_text


def main(argv: list[str]) -> int:
    seed, mb, target = int(argv[0]), int(argv[1]), argv[2]
    auto = "--auto" in argv
    threads = int(argv[argv.index("--threads") + 1]) if "--threads" in argv else 0
    repeat = int(argv[argv.index("--repeat") + 1]) if "--repeat" in argv else 1
    import fastckpt

    model, opt, sched = build_state(seed, mb)
    if "--as-user" in argv:  # drop root: file modes apply from here on (everything needed is imported)
        uid = int(argv[argv.index("--as-user") + 1])
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if "--hold-manifest" in argv:
        _hold_before_manifest()
    print("ready", flush=True)
    if "--go" in argv:  # wait for the parent's word, so that several workers start their saves together
        sys.stdin.readline()
    try:
        for _ in range(repeat):
            where = {"project_dir": target} if auto else {"output_dir": target}
            if "--remote" in argv:  # a tiered save: committed locally, then uploaded; waits for the remote commit
                where["remote"] = argv[argv.index("--remote") + 1]
            t0 = time.monotonic()
            path = fastckpt.save_state(model, opt, sched, threads=threads, step=seed, **where)
            if "--remote" in argv:
                print(f"local {path.wait_local()}", flush=True)
                path = path.wait()
            print(f"saved {path} {time.monotonic() - t0:.4f}", flush=True)
    except Exception as exc:  # reported to the parent, which asserts on it
        print(f"error {type(exc).__name__} {getattr(exc, 'errno', None)} {exc}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown (seconds with torch loaded)

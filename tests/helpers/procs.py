"""Helpers for the fault tests that run saves in other processes (tests/helpers/crash_worker.py): start a worker (under
strace to inject a signal, an error or a delay at the Nth call of a syscall), wait for it, and tell which saved
state a checkpoint folder holds by a bit-exact fingerprint of everything it restores."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt._io.storage.local.staging import leftovers
from helpers.crash_worker import BigNet, build_state

WORKER = Path(__file__).parent / "crash_worker.py"

requires_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONWARNINGS="error", PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = str(WORKER.parent) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def strace_prefix(syscall: str, action: str) -> list[str]:
    """``strace`` arguments that apply ``action`` (``signal=KILL:when=3``, ``error=EIO:when=2``,
    ``delay_enter=2000000:when=1``) to ``syscall`` in the worker and all its threads."""
    return ["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={syscall}",
            "-e", f"inject={syscall}:{action}"]


def start_worker(seed: int, mb: int, target: Path, *flags: str, strace: list[str] | None = None) -> subprocess.Popen:
    """Start ``_crash_worker.py SEED MB TARGET FLAGS`` (see its docs); stdout is a pipe of text lines."""
    cmd = [*(strace or []), sys.executable, str(WORKER), str(seed), str(mb), str(target), *flags]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=worker_env())


def go(*procs: subprocess.Popen) -> None:
    """Let workers started with ``--go`` (and past :func:`wait_ready`) start their saves, all at once."""
    for p in procs:
        p.stdin.write("go\n")
    for p in procs:
        p.stdin.flush()


def wait_ready(proc: subprocess.Popen) -> None:
    """Block until the worker printed ``ready`` (its state is built; the save starts now)."""
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"worker did not get ready: {line!r}\n{proc.stderr.read()}")


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, list[str], str]:
    """(exit status, stdout lines, stderr) once the worker exits; -9 / 137 when it was killed."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, [line for line in out.splitlines() if line], err


def owned_leftovers(parent: Path) -> list[str]:
    """Names of staging / trash folders and lock files in ``parent``."""
    return sorted(name for names in leftovers(parent).values() for name in names)


def _update(h, t: torch.Tensor) -> None:
    t = t.detach().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def fingerprint(model, opt, sched) -> str:
    """sha256 over every model tensor, every optimizer state tensor and hyper-parameter, and the scheduler."""
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        _update(h, v)
    sd = opt.state_dict()
    for i in sorted(sd["state"]):
        for k, v in sorted(sd["state"][i].items()):
            h.update(f"{i}.{k}".encode())
            if isinstance(v, torch.Tensor):
                _update(h, v)
            else:
                h.update(repr(v).encode())
    h.update(repr(sd["param_groups"]).encode())
    h.update(repr(sorted(sched.state_dict().items())).encode())
    return h.hexdigest()


@lru_cache(maxsize=8)
def expected_fingerprint(seed: int, mb: int) -> str:
    return fingerprint(*build_state(seed, mb))


def loaded_fingerprint(folder: Path, mb: int) -> str:
    """Verify ``folder`` (every crc32c) and load it into fresh objects; their fingerprint."""
    model = BigNet(mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    fastckpt.load_state(model, opt, sched, input_dir=folder, verify=True)
    return fingerprint(model, opt, sched)


def which_state(folder: Path, mb: int, seeds: dict[str, int]) -> str:
    """The name in ``seeds`` whose state ``folder`` holds, bit for bit; fails when it holds none of them."""
    got = loaded_fingerprint(folder, mb)
    names = [name for name, seed in seeds.items() if expected_fingerprint(seed, mb) == got]
    assert names, f"{folder} holds none of the states {seeds}: a mix or a damaged checkpoint"
    return names[0]


def link_copy(src: Path, dst: Path) -> Path:
    """A copy of checkpoint folder ``src`` made of hard links (saves never modify files in place)."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        os.link(p, dst / p.name)
    return dst

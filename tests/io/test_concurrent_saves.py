"""C18 and C14: processes that save to the same place at once, and readers that hold a checkpoint being replaced.

- Two processes save different states to the same output_dir at once (released together): both succeed and the
  folder holds one writer's complete state, bit for bit (both when the folder is new, where both commits are
  plain renames racing, and when it exists, where both are exchanges).
- With automatic naming, every committed checkpoint_N holds one writer's complete state.
- A save never touches another live process's staging folder, even while that process sits in an fsync.
- A process that mapped / lazily opened a checkpoint keeps its data while another process saves over it (C14).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.common import make_tiny
from helpers.crash_worker import build_state
from helpers.fault_log import record
from helpers.procs import (
    finish,
    go,
    owned_leftovers,
    start_worker,
    strace_prefix,
    wait_ready,
    which_state,
    worker_env,
)

import fastckpt
import fastckpt.torch as ft

MB = 16
SEEDS = {"a": 101, "b": 202, "old": 303}


def _race(target, *flags: str, strace: list[str] | None = None) -> list[str]:
    """Start two workers (states a and b), release them together; both must succeed. Their output lines."""
    procs = [start_worker(SEEDS[w], MB, target, "--go", *flags, strace=strace) for w in ("a", "b")]
    try:
        for p in procs:
            wait_ready(p)
        go(*procs)
        lines = []
        for p in procs:
            rc, out, err = finish(p)
            assert rc == 0 and out and all(line.startswith("saved ") for line in out), (rc, out, err)
            lines += out
        return lines
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                finish(p)


@pytest.mark.parametrize("existing", [False, True], ids=["new_folder", "existing_folder"])
def test_c18_two_processes_save_to_one_output_dir(tmp_path, existing):
    """Both workers are held 1.5 s at the entry of their commit (strace), after each looked at the target: for a
    new folder both saw none and both rename, so the second rename meets a non-empty folder and must retry as an
    exchange; for an existing folder both exchange in turn."""
    target = tmp_path / "out"
    if existing:
        model, opt, sched = build_state(SEEDS["old"], MB)
        fastckpt.save_state(model, opt, sched, output_dir=target)
    commit = ("renameat2", 1) if existing else ("rename", 4)  # rename 1-3: the files inside the staging folder
    hold = strace_prefix(commit[0], f"delay_enter=1500000:when={commit[1]}") if shutil.which("strace") else None
    _race(target, "--threads", "1", strace=hold)
    winner = which_state(target, MB, {"a": SEEDS["a"], "b": SEEDS["b"]})
    assert owned_leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    print(f"winner: {winner}")
    record("faults")


def test_c18_two_processes_with_automatic_naming(tmp_path):
    lines = _race(tmp_path, "--auto", "--repeat", "2")
    saved = {line.split()[1] for line in lines}
    committed = fastckpt._io.storage.local.numbering.checkpoint_numbers(tmp_path)
    assert {str(p) for p in committed.values()} == saved
    for n, folder in committed.items():
        assert which_state(folder, MB, {"a": SEEDS["a"], "b": SEEDS["b"]}) in ("a", "b"), n
    latest = fastckpt.latest_checkpoint(tmp_path)
    assert latest == committed[max(committed)]
    assert owned_leftovers(tmp_path / "checkpoints") == []
    record("faults")


def test_a_live_staging_folder_is_never_touched(tmp_path):
    """A worker holds mid-save (every data file in its staging folder, the manifest not yet written) until told to
    go on; meanwhile this process saves into the same parent, which cleans leftovers: the live staging folder
    survives and the worker commits."""
    target = tmp_path / "slow"
    proc = start_worker(SEEDS["a"], MB, target, "--threads", "1", "--hold-manifest")
    wait_ready(proc)
    line = proc.stdout.readline()
    if line.strip() != "staged":
        proc.kill()
        pytest.fail(f"the worker never reached its manifest: {line!r} {proc.stderr.read()}")
    before = owned_leftovers(tmp_path)
    assert any(not n.endswith(".lock") and any((tmp_path / n).iterdir()) for n in before), before
    fastckpt.save_state(make_tiny(3), output_dir=tmp_path / "other", model_only=True)
    assert owned_leftovers(tmp_path) == before, "a live save's staging folder was touched"
    proc.stdin.write("go\n")
    proc.stdin.flush()
    rc, out, err = finish(proc)
    assert rc == 0 and out[-1].startswith(f"saved {target} "), (rc, out, err)
    assert which_state(target, MB, {"a": SEEDS["a"]}) == "a"
    assert owned_leftovers(tmp_path) == []
    record("faults")


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}


_HOLDER = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np, torch
    import fastckpt._core as core, fastckpt.torch as ft
    def digests(ts):
        return {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for k, v in ts.items()}
    path = sys.argv[1]
    eager = ft.load_file(path)                       # views of a private mapping
    lazy = ft.safe_open(path, "pt")                  # mapped, nothing read yet
    raw = core.SafetensorsFile(path)                 # its file handle stays open
    print("ready", flush=True)
    sys.stdin.readline()                             # the parent overwrites the checkpoint meanwhile
    late = {k: lazy.get_tensor(k) for k in lazy.keys()}
    into = {}
    for name, dtype, shape, b, e in raw.tensors():
        buf = np.empty(e - b, dtype=np.uint8)
        raw.read_into([(name, buf)])
        into[name] = torch.from_numpy(buf)
    print(json.dumps({"eager": digests(eager), "late": digests(late), "read_into": digests(into)}), flush=True)
""")


def test_c14_another_process_holds_a_checkpoint_that_is_saved_over(tmp_path):
    model, opt, sched = build_state(SEEDS["old"], 4)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "held")
    want = _digests(ft.load_file(ckpt / "model.safetensors"))
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), str(ckpt / "model.safetensors")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env())
    assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
    for seed in (SEEDS["a"], SEEDS["b"]):  # the second save removes the tree the holder has mapped
        m, o, s = build_state(seed, 4)
        fastckpt.save_state(m, o, s, output_dir=ckpt)
    out, err = holder.communicate("go\n", timeout=120)
    assert holder.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {"eager": want, "late": want, "read_into": want}
    assert which_state(ckpt, 4, {"b": SEEDS["b"]}) == "b"
    record("faults")


def test_c14_this_process_holds_views_across_two_overwrites(tmp_path):
    model, opt, sched = build_state(SEEDS["old"], 2)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "held")
    held = ft.load_file(ckpt / "model.safetensors")
    lazy = ft.safe_open(ckpt / "optimizer.safetensors", "pt")
    want, want_opt = _digests(held), _digests({k: lazy.get_tensor(k).clone() for k in lazy.keys()})
    for seed in (SEEDS["a"], SEEDS["b"]):
        fastckpt.save_state(*build_state(seed, 2), output_dir=ckpt)
    assert _digests(held) == want
    assert _digests({k: lazy.get_tensor(k) for k in lazy.keys()}) == want_opt
    assert which_state(ckpt, 2, {"b": SEEDS["b"]}) == "b"
    record("faults")

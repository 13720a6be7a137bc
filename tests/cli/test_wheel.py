"""The abi3 wheel installs and works in a fresh virtualenv with no Rust toolchain on PATH.

Builds the wheel with maturin (what `make wheel` does), installs it with ``--no-deps`` into a new virtualenv, and
runs a save/load round trip there with a PATH that holds no cargo/rustc; torch and numpy come from this test
environment through PYTHONPATH (installing them again would download gigabytes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ROUND_TRIP = """
import shutil, sys, tempfile, torch, fastckpt
assert shutil.which("cargo") is None and shutil.which("rustc") is None
assert fastckpt.__file__.startswith(sys.prefix), fastckpt.__file__
m = torch.nn.Linear(4, 3)
path = fastckpt.save_state(m, output_dir=tempfile.mkdtemp() + "/ckpt", model_only=True)
fresh = torch.nn.Linear(4, 3)
fastckpt.load_state(fresh, input_dir=path)
assert torch.equal(fresh.weight, m.weight) and torch.equal(fresh.bias, m.bias)
print("ok", fastckpt.__version__)
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("maturin") is None and not (Path(sys.prefix) / "bin" / "maturin").exists(),
                    reason="maturin is not installed")
def test_abi3_wheel_installs_and_runs_without_rust(tmp_path):
    maturin = shutil.which("maturin") or str(Path(sys.prefix) / "bin" / "maturin")
    subprocess.run([maturin, "build", "--release", "-o", str(tmp_path / "dist")], cwd=ROOT, check=True,
                   capture_output=True, timeout=900)
    wheels = list((tmp_path / "dist").glob("fastckpt-*-cp311-abi3-*.whl"))
    assert len(wheels) == 1, wheels
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheels[0])], check=True,
                   timeout=300)
    clean_env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    clean_env["PATH"] = f"{env_dir / 'bin'}:/usr/bin:/bin"
    deps = tmp_path / "deps"  # this environment's packages (torch, numpy, ...) without fastckpt itself
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("fastckpt", "_fastckpt", "__editable__")):
            (deps / entry.name).symlink_to(entry)
    clean_env["PYTHONPATH"] = str(deps)
    out = subprocess.run([py, "-c", ROUND_TRIP], env=clean_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")

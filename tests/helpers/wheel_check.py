"""Build and check fastckpt's distributions the way the release workflow does: one place for `make wheel`,
`make release-check` and tests/cli/test_wheel.py.

- :func:`build_wheel`: ``maturin build --release --zig --compatibility manylinux_2_28`` (zig from the ``ziglang``
  package links against glibc 2.28's symbols, so the wheel installs where torch's manylinux_2_28 wheel does).
- :func:`check_wheel`: the file name and the WHEEL tags say ``cp311-abi3-manylinux_2_28_x86_64``; ``auditwheel show``
  says the wheel is consistent with manylinux_2_28 and needs no external library; LICENSE is in ``.dist-info``.
- :func:`fresh_venv`: a new virtualenv of a given interpreter with the wheel installed ``--no-deps --no-index``.
- :data:`TORCH_ROUND_TRIP` (needs torch: Python 3.11 here, which sees the shared torch through a ``.pth``) and
  :data:`CORE_ROUND_TRIP` (numpy + the official ``safetensors`` reader only: the abi3 extension on 3.12 / 3.13,
  where torch would be a multi-GB download per interpreter), run with no cargo / rustc on PATH.

Run as a script: ``python tests/helpers/wheel_check.py release-check`` (what `make release-check` and CI run: it
builds the sdist and a wheel from it, then runs tests/cli/test_wheel.py on them) or ``wheel`` (`make wheel`).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

__all__ = ["PYTHONS", "build_sdist", "build_wheel", "check_installs", "check_sdist", "check_wheel",
           "missing_build_tools", "release_check"]

ROOT = Path(__file__).resolve().parents[2]
DIST = "fastckpt_rs"  # the distribution name as wheel and sdist file names spell it
PLATFORM = "manylinux_2_28_x86_64"
#: the interpreters the wheel is checked on (one abi3 wheel: cp311 and every later CPython)
PYTHONS = ("3.11", "3.12", "3.13")

TORCH_ROUND_TRIP = """
import hashlib, shutil, sys, tempfile, torch, fastckpt
from importlib import metadata
assert shutil.which("cargo") is None and shutil.which("rustc") is None, "a Rust toolchain is on PATH"
assert fastckpt.__file__.startswith(sys.prefix), fastckpt.__file__
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)).to(torch.bfloat16)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
m(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()
opt.step()
path = fastckpt.save_state(m, opt, output_dir=tempfile.mkdtemp() + "/ckpt")
fresh = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)).to(torch.bfloat16)
fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
fastckpt.load_state(fresh, fresh_opt, input_dir=path)
for (name, a), b in zip(m.state_dict().items(), fresh.state_dict().values()):
    assert a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)), name
for k, st in opt.state_dict()["state"].items():
    for key, v in st.items():
        assert torch.equal(v, fresh_opt.state_dict()["state"][k][key]), (k, key)
assert fastckpt.__version__ == metadata.version("fastckpt-rs"), fastckpt.__version__
print("ok", sys.version_info[:2], fastckpt.__version__, "torch", torch.__version__)
"""

CORE_ROUND_TRIP = """
import importlib.util, shutil, sys, tempfile, glob, os
from importlib import metadata
import numpy as np
from safetensors.numpy import load_file, save as st_save
assert shutil.which("cargo") is None and shutil.which("rustc") is None, "a Rust toolchain is on PATH"
(so,) = glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "fastckpt", "_core.abi3.so"))
spec = importlib.util.spec_from_file_location("fastckpt._core", so)  # the extension alone: fastckpt imports torch
core = importlib.util.module_from_spec(spec)
spec.loader.exec_module(core)
rng = np.random.default_rng(0)
arrays = {"w": rng.standard_normal((33, 17)).astype(np.float32), "b": rng.standard_normal(17).astype(np.float16),
          "ids": rng.integers(-2**62, 2**62, size=(5, 3), dtype=np.int64), "mask": rng.random(7) > 0.5}
dtypes = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64", np.dtype(bool): "BOOL"}
sources = [(k, dtypes[a.dtype], list(a.shape), a.view(np.uint8).reshape(-1), 0, None) for k, a in arrays.items()]
path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
core.write_file(path, sources, [("format", "np")])
data = open(path, "rb").read()
assert data == st_save(arrays, metadata={"format": "np"}), "bytes differ from safetensors' own writer"
back = load_file(path)
assert back.keys() == arrays.keys()
for k, a in arrays.items():
    assert back[k].dtype == a.dtype and back[k].shape == a.shape and back[k].tobytes() == a.tobytes(), k
f = core.SafetensorsFile(path, mmap=False)
into = {k: np.empty_like(a) for k, a in arrays.items()}
f.read_into([(k, v.view(np.uint8).reshape(-1)) for k, v in into.items()])
assert all(into[k].tobytes() == a.tobytes() for k, a in arrays.items())
assert core.crc32c(b"123456789") == 0xE3069283
print("ok", sys.version_info[:2], metadata.version("fastckpt-rs"), "core")
"""


def tool(name: str) -> str | None:
    """``name`` from this interpreter's environment (a venv's bin/), else from PATH."""
    here = Path(sys.prefix) / "bin" / name
    return str(here) if here.exists() else shutil.which(name)


def build_env() -> dict[str, str]:
    """The environment for maturin: this venv's bin/ first, so ``--zig`` finds ``python -m ziglang``."""
    env = {k: v for k, v in os.environ.items() if k != "CONDA_PREFIX"}
    env["PATH"] = f"{Path(sys.prefix) / 'bin'}:{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = sys.prefix
    return env


def missing_build_tools() -> str | None:
    """Why a wheel cannot be built here (None when it can): maturin, ziglang, auditwheel or cargo is missing."""
    for name in ("maturin", "auditwheel"):
        if tool(name) is None:
            return f"{name} is not installed (make release-check installs the build tools)"
    if shutil.which("cargo") is None:
        return "cargo is not on PATH"
    try:
        import ziglang  # noqa: F401
    except ImportError:
        return "the ziglang package is not installed (make release-check installs the build tools)"
    return None


def cargo_version() -> str:
    """The one version of the project: Cargo.toml's ``[workspace.package] version``."""
    return tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["version"]


def build_wheel(src: Path, out: Path) -> Path:
    """Build the manylinux_2_28 abi3 wheel of the tree at ``src`` into ``out`` and return its path."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.whl"))
    subprocess.run([tool("maturin"), "build", "--release", "--zig", "--compatibility", "manylinux_2_28", "-o",
                    str(out)], cwd=src, env=build_env(), check=True)
    (wheel,) = set(out.glob(f"{DIST}-*.whl")) - before
    return wheel


def build_sdist(src: Path, out: Path) -> Path:
    """``maturin sdist`` of ``src`` into ``out``; returns the .tar.gz."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([tool("maturin"), "sdist", "-o", str(out)], cwd=src, env=build_env(), check=True)
    (sdist,) = out.glob(f"{DIST}-*.tar.gz")
    return sdist


def check_wheel(wheel: Path) -> str:
    """Check the wheel's tags, ``auditwheel show`` and its LICENSE; returns auditwheel's report.

    Raises:
        AssertionError: naming what differs.
    """
    version = cargo_version()
    expected = f"{DIST}-{version}-cp311-abi3-{PLATFORM}.whl"
    assert wheel.name == expected, f"{wheel.name}, expected {expected}"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = f"{DIST}-{version}.dist-info"
        tags = [line.split(": ", 1)[1] for line in zf.read(f"{info}/WHEEL").decode().splitlines()
                if line.startswith("Tag: ")]
        assert tags == [f"cp311-abi3-{PLATFORM}"], tags
        licenses = [n for n in names if n.startswith(f"{info}/") and n.rsplit("/", 1)[-1] == "LICENSE"]
        assert licenses, f"no LICENSE in {wheel.name}'s {info}"
        assert zf.read(licenses[0]) == (ROOT / "LICENSE").read_bytes(), licenses[0]
        meta = zf.read(f"{info}/METADATA").decode()
        assert "Name: fastckpt-rs" in meta and f"Version: {version}" in meta, meta[:300]
        assert "fastckpt/_core.abi3.so" in names, [n for n in names if n.endswith(".so")]
    report = subprocess.run([tool("auditwheel"), "show", str(wheel)], capture_output=True, text=True, check=True)
    text = " ".join(report.stdout.split())
    assert f'consistent with the following platform tag: "{PLATFORM}"' in text, report.stdout
    assert "external shared libraries are required" not in text, report.stdout
    return report.stdout


def check_sdist(sdist: Path) -> None:
    """The sdist holds LICENSE, README, pyproject, the lock file and both crates."""
    root = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as tf:
        names = set(tf.getnames())
        for need in ("LICENSE", "README.md", "pyproject.toml", "Cargo.lock", "rust/core/Cargo.toml",
                     "rust/python/Cargo.toml", "python/fastckpt/__init__.py", "python/fastckpt/_core.pyi"):
            assert f"{root}/{need}" in names, f"{sdist.name} lacks {need}"
        assert tf.extractfile(f"{root}/LICENSE").read() == (ROOT / "LICENSE").read_bytes()


def interpreter(version: str) -> str | None:
    """A CPython ``version`` interpreter: pyenv's, else ``pythonX.Y`` on PATH."""
    found = sorted(glob.glob(f"/root/.pyenv/versions/{version}.*/bin/python3"))
    return found[-1] if found else shutil.which(f"python{version}")


def shared_site(dest: Path) -> Path:
    """A folder of links to this environment's packages except fastckpt itself (torch, numpy, safetensors, ...)."""
    dest.mkdir(parents=True, exist_ok=True)
    for site in dict.fromkeys(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)):
        for entry in Path(site).iterdir():
            low = entry.name.lower()
            if low.startswith(("fastckpt", "_fastckpt", "__editable__")) or low.endswith(".pth"):
                continue
            if not (dest / entry.name).exists():
                (dest / entry.name).symlink_to(entry)
    return dest


def fresh_venv(python: str, where: Path, wheel: Path, *, see_site: Path | None = None,
               pip_install: tuple[str, ...] = ()) -> Path:
    """A new virtualenv of ``python`` at ``where`` with ``wheel`` installed ``--no-deps --no-index``; ``see_site``
    is added to its path by a ``.pth`` file (after its own site-packages), ``pip_install`` installed from the index
    pinned by constraints.txt. Returns its python."""
    subprocess.run([python, "-m", "venv", str(where)], check=True)
    py = where / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", "--no-index", str(wheel)], check=True)
    if pip_install:
        subprocess.run([*pip, "-c", str(ROOT / "constraints.txt"), *pip_install], check=True)
    if see_site is not None:
        purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        Path(purelib, "zz_shared.pth").write_text(f"{see_site}\n")
    return py


def run_without_rust(py: Path, code: str, cwd: Path) -> str:
    """Run ``code`` in ``py`` with a PATH holding no cargo / rustc; returns stdout, raises naming stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "CARGO_HOME", "RUSTUP_HOME")}
    env["PATH"] = f"{py.parent}:/usr/bin:/bin"
    out = subprocess.run([str(py), "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{py}: exit {out.returncode}\n{out.stderr[-3000:]}"
    return out.stdout


def check_installs(wheel: Path, work: Path, *, torch_on: tuple[str, ...] = ("3.11",)) -> list[str]:
    """Install ``wheel`` into a fresh venv of each of :data:`PYTHONS` and run a round trip in each: the torch one
    on ``torch_on`` (3.11 sees this environment's torch), the core one (numpy + safetensors) on the others.

    Returns the lines each printed. Raises AssertionError naming a missing interpreter or a failed round trip."""
    lines = []
    shared = shared_site(work / "shared-site")
    for version in PYTHONS:
        python = interpreter(version)
        assert python is not None, f"no Python {version} interpreter found"
        if version in torch_on:
            assert sys.version_info[:2] == tuple(map(int, version.split("."))), "torch comes from this environment"
            py = fresh_venv(python, work / f"venv-{version}", wheel, see_site=shared)
            lines.append(run_without_rust(py, TORCH_ROUND_TRIP, work).strip())
        else:
            py = fresh_venv(python, work / f"venv-{version}", wheel, pip_install=("numpy", "safetensors"))
            lines.append(run_without_rust(py, CORE_ROUND_TRIP, work).strip())
    return lines


def release_check(work: Path) -> int:
    """The release workflow, locally: the sdist, a wheel built from the unpacked sdist, then
    tests/cli/test_wheel.py on both (tags, auditwheel, LICENSE, fresh-venv installs and round trips).

    Returns pytest's exit status."""
    sdist = build_sdist(ROOT, work / "dist")
    with tarfile.open(sdist) as tf:
        tf.extractall(work / "src", filter="data")
    (src,) = (work / "src").iterdir()
    wheel = build_wheel(src, work / "dist")
    env = {**os.environ, "FASTCKPT_WHEEL": str(wheel), "FASTCKPT_SDIST": str(sdist)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/cli/test_wheel.py"], cwd=ROOT, env=env).returncode


def main(argv: list[str]) -> int:
    if argv[:1] == ["wheel"]:
        print(build_wheel(ROOT, ROOT / "dist"))
        return 0
    if argv[:1] == ["release-check"]:
        reason = missing_build_tools()
        if reason:
            print(f"release-check: {reason}", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="fastckpt-release-") as tmp:
            return release_check(Path(tmp))
    print(__doc__.strip().splitlines()[0], "\nusage: wheel_check.py wheel | release-check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


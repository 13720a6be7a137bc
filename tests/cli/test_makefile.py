"""Every Makefile target works on a fresh clone on its own (issue: `make release-check` ran pytest, whose addopts
pass ``--benchmark-disable``, after installing pytest without pytest-benchmark; CI passed only because `make test`
ran first). Read statically, with make's own dry run: whatever a target runs comes from what its prerequisites
install, so no target depends on another target having run before it."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: pytest options (as in addopts or a recipe) -> the plugin distribution that provides them
PLUGIN_OF = {"--benchmark-": "pytest-benchmark", "-n": "pytest-xdist", "--dist": "pytest-xdist"}


def _test_extra() -> set[str]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {re.split(r"[<>=\[ ]", req)[0] for req in doc["project"]["optional-dependencies"]["test"]}


def _addopts() -> list[str]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return doc["tool"]["pytest"]["ini_options"]["addopts"].split()


def _plugins(options: list[str]) -> set[str]:
    return {plugin for opt in options for prefix, plugin in PLUGIN_OF.items()
            if opt == prefix or (prefix.endswith("-") and opt.startswith(prefix))}


def _dry_run(target: str, tmp_path: Path) -> list[str]:
    """The commands `make TARGET` runs in a fresh clone (no venv yet: every recipe line shows), from make itself."""
    if shutil.which("make") is None:
        pytest.skip("no make on PATH")
    proc = subprocess.run(["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return [line for line in proc.stdout.splitlines() if line.strip()]


def _targets() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    return re.findall(r"^([a-z][a-z-]*):", text, flags=re.M)


def test_the_targets_are_the_documented_ones():
    assert {"test", "test-quick", "py-test", "release-check", "lint", "wheel", "demo"} <= set(_targets())


@pytest.mark.parametrize("target", _targets())
def test_each_target_installs_what_it_runs(target, tmp_path):
    lines = _dry_run(target, tmp_path)
    venv = str(tmp_path / "venv")
    installs = " ".join(line for line in lines if " -m pip " in line and " install " in line)
    installed: set[str] = set()
    if '".[test]"' in installs:
        installed |= _test_extra()
    installed |= set(re.findall(r"\b(pytest(?:-[a-z]+)?|ruff|mypy)\b", installs))
    ran_pytest = False
    for i, line in enumerate(lines):
        uses_venv = f"{venv}/bin/" in line and " -m venv " not in line
        if uses_venv:  # the venv is made first
            assert any(f"-m venv {venv}" in earlier for earlier in lines[:i]), (target, line)
        if uses_venv and (" -m pytest" in line or "wheel_check.py release-check" in line):  # the latter: pytest inside
            ran_pytest = True
            needed = _plugins(_addopts()) | _plugins(line.split()) | {"pytest"}
            assert needed <= installed, (target, line, sorted(needed - installed))
        for tool in ("ruff", "mypy"):
            if uses_venv and f" -m {tool}" in line:
                assert tool in installed, (target, line)
    if target in ("test", "py-test", "test-quick", "release-check"):
        assert ran_pytest, lines


def test_release_check_installs_the_addopts_plugins(tmp_path):
    """The case from the field, by value: addopts ask for pytest-benchmark, release-check installs it."""
    assert "--benchmark-disable" in _addopts()
    install = next(line for line in _dry_run("release-check", tmp_path) if "safetensors" in line and "install" in line)
    assert "pytest-benchmark" in install.split()


def test_py_test_runs_in_parallel_and_test_quick_leaves_out_slow_tests_and_launches(tmp_path):
    (pytest_line,) = [line for line in _dry_run("py-test", tmp_path) if " -m pytest" in line]
    assert pytest_line.split(" -m pytest", 1)[1].split() == ["-n", "auto", "--dist", "loadgroup"]
    (quick,) = [line for line in _dry_run("test-quick", tmp_path) if " -m pytest" in line]
    assert '-m "not slow and not launches"' in quick or "-m not slow and not launches" in quick
    assert "pytest-xdist" in _test_extra()

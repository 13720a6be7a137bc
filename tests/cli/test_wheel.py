"""The manylinux_2_28 abi3 wheel (what `make wheel` and the release workflow build) installs and works in a fresh
virtualenv of Python 3.11, 3.12 and 3.13 with no Rust toolchain on PATH; the sdist holds what a build from it needs.

The checks live in :mod:`helpers.wheel_check`. ``FASTCKPT_WHEEL`` / ``FASTCKPT_SDIST`` name prebuilt archives
(`make release-check` passes the sdist and the wheel it built from that sdist); without them the test builds the
wheel from this tree (a release build, minutes) and the sdist. What runs where:

- 3.11: ``save_state`` / ``load_state`` of a bf16 model with AdamW state, bit-exact, through the installed wheel,
  torch from this environment (a ``.pth`` file; the wheel itself is installed with ``--no-deps``).
- 3.12, 3.13: the abi3 extension ``fastckpt._core`` loaded alone (torch for those interpreters is a download of
  gigabytes each) writes a safetensors file from numpy arrays that is byte-identical to safetensors' own writer and
  reads back exactly through the official reader and the core's ``read_into``; numpy and safetensors come from
  the package index, pinned by constraints.txt.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import wheel_check


def _needs_build_tools() -> None:
    reason = wheel_check.missing_build_tools()
    if reason:
        pytest.skip(reason)
    for version in wheel_check.PYTHONS:
        if wheel_check.interpreter(version) is None:
            pytest.skip(f"no Python {version} interpreter (pyenv or python{version} on PATH)")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The wheel and the sdist under test: the prebuilt ones named by the environment, or built here."""
    _needs_build_tools()
    out = tmp_path_factory.mktemp("dist")
    wheel = Path(os.environ["FASTCKPT_WHEEL"]) if "FASTCKPT_WHEEL" in os.environ else None
    sdist = Path(os.environ["FASTCKPT_SDIST"]) if "FASTCKPT_SDIST" in os.environ else None
    return {"wheel": wheel or wheel_check.build_wheel(wheel_check.ROOT, out),
            "sdist": sdist or wheel_check.build_sdist(wheel_check.ROOT, out)}


@pytest.mark.slow
def test_wheel_is_manylinux_2_28_abi3_with_license(built):
    report = wheel_check.check_wheel(built["wheel"])
    assert "manylinux_2_28_x86_64" in report


@pytest.mark.slow
def test_sdist_holds_license_and_both_crates(built):
    wheel_check.check_sdist(built["sdist"])


@pytest.mark.slow
def test_wheel_installs_and_round_trips_on_each_python_without_rust(built, tmp_path):
    lines = wheel_check.check_installs(built["wheel"], tmp_path)
    version = wheel_check.cargo_version()
    assert [line.split()[0] for line in lines] == ["ok"] * len(wheel_check.PYTHONS), lines
    assert all(version in line for line in lines), lines
    assert lines[0].endswith(f"torch {__import__('torch').__version__}"), lines[0]
    assert [line.split()[-1] for line in lines[1:]] == ["core"] * (len(wheel_check.PYTHONS) - 1), lines


def test_missing_build_tools_is_a_reason_not_a_failure(monkeypatch):
    """Without maturin the wheel tests skip with the tool's name (CI's `make test` venv has no build tools)."""
    monkeypatch.setattr(wheel_check, "tool", lambda name: None)
    assert wheel_check.missing_build_tools() == (
        "maturin is not installed (make release-check installs the build tools)")

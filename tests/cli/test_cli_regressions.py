"""Regressions from a new-user pass over the CLI: ``convert`` refuses a damaged source and overlapping
SRC/DST, ``inspect`` survives a closed pipe and escapes control characters in names, ``verify --threads``
rejects negatives, and every subcommand's help documents its exit statuses."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
from helpers.common import make_training_state, read_split

import fastckpt
from fastckpt._plan.convert import convert
from fastckpt.cli import build_parser
from fastckpt.cli import main as cli


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    model, opt, sched = make_training_state(seed=5)
    return fastckpt.save_state(model, opt, sched, output_dir=tmp_path_factory.mktemp("cli") / "good")


def _tree(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_convert_refuses_a_source_that_fails_its_checksums(good, tmp_path, capsys):
    src = shutil.copytree(good, tmp_path / "src")
    path = src / "model.safetensors"
    n, _, header, _ = read_split(path)
    name = next(k for k in header if k != "__metadata__")
    data = bytearray(path.read_bytes())
    data[8 + n + header[name]["data_offsets"][0]] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(fastckpt.IntegrityError, match="model.safetensors"):
        convert(src, tmp_path / "lib")
    capsys.readouterr()
    assert cli(["convert", str(src), str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("IntegrityError:") and "model.safetensors" in err and name in err
    assert not (tmp_path / "dst").exists() and not (tmp_path / "lib").exists()


@pytest.mark.parametrize("dst", [".", "sub", "sub/deeper", ".."])
def test_convert_refuses_dst_equal_to_inside_or_containing_src(good, tmp_path, capsys, dst):
    src = shutil.copytree(good, tmp_path / "a" / "src")
    before = _tree(tmp_path)
    assert cli(["convert", str(src), os.path.join(str(src), dst)]) == 2
    assert "DST must not be SRC, inside it, or contain it" in capsys.readouterr().err
    assert _tree(tmp_path) == before


def test_inspect_into_a_closed_pipe_exits_141_without_a_traceback(good):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: like `| head` that already quit
    try:
        proc = subprocess.run([sys.executable, "-m", "fastckpt", "inspect", str(good)], stdout=write_end,
                              stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141
    assert proc.stderr == b""


def _safetensors(path, name: str) -> None:
    header = json.dumps({name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")


def test_inspect_escapes_control_characters_in_names(tmp_path, capsys):
    path = tmp_path / "evil.safetensors"
    _safetensors(path, "w\x1b[2J\x07\r\n")
    assert cli(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out
    assert "  w\\x1b[2J\\x07\\r\\n  F32" in out
    assert cli(["inspect", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"][0]["name"] == "w\x1b[2J\x07\r\n"  # unchanged in JSON


@pytest.mark.parametrize("value", ["-3", "x"])
def test_verify_rejects_a_negative_or_non_integer_thread_count(good, capsys, value):
    with pytest.raises(SystemExit) as exc:
        cli(["verify", "--threads", value, str(good)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --threads: must be" in err and "Traceback" not in err
    assert cli(["verify", "--threads", "0", "-q", str(good)]) == 0


@pytest.mark.parametrize("command, statuses", [
    ("verify", ["0 intact", "1 damaged", "2 not a checkpoint"]),
    ("inspect", ["0 shown", "1 a malformed", "2 not a checkpoint"]),
    ("convert", ["0 converted", "1 the source is damaged", "2 usage error"]),
])
def test_help_documents_exit_statuses(command, statuses):
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    text = " ".join(sub.format_help().split())
    assert "exit status:" in text
    for status in statuses:
        assert status in text


def test_version_is_this_packages_not_the_unrelated_fastckpt_distributions(capsys, monkeypatch):
    """`fastckpt --version` read the metadata of the distribution named `fastckpt` (an unrelated project): it printed
    "unknown (not installed)" after `pip install fastckpt-rs`, or the other project's version beside it."""
    import importlib.metadata

    from fastckpt import __version__
    from fastckpt.cli import main

    def other(name: str) -> str:
        if name == "fastckpt":
            return "9.9.9"  # the unrelated project, installed
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", other)
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastckpt {__version__} (fastckpt-rs)"

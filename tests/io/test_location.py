"""A URL fastckpt does not serve is a ValueError naming its scheme, at every entry point that takes a path, before
anything is written: never a local folder named ``s3:`` / ``gs:`` (``Path("s3://b/x")`` is ``s3:/b/x``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from accelerate.utils import ProjectConfiguration
from helpers.common import make_training_state

import fastckpt
import fastckpt.accelerate
import fastckpt.dcp
import fastckpt.torch
from fastckpt._io.location import check_location, url_scheme
from fastckpt.cli import main

#: URLs of storage no entry point serves yet, with the scheme each message must name
URLS = {
    "gs": "gs://bucket/run/ckpt",
    "hf": "hf://user/repo/ckpt",
    "az": "az://container/ckpt",
    "S3": "S3://bucket/run/ckpt",  # schemes are case-insensitive (RFC 3986)
    "s3": "s3://bucket/run/ckpt",
    "file": "file:///tmp/ckpt",
}

#: entry points that serve s3:// (tests/io/test_object_store.py); the others still refuse it
S3_SERVED = {"save_state output_dir", "save_state project_dir", "load_state input_dir", "load_state project_dir",
             "latest_checkpoint", "verify_checkpoint", "accelerate.save_state output_dir",
             "accelerate.save_state project_dir", "accelerate.load_state input_dir",
             "accelerate.load_state project_dir", "dcp.save", "dcp.load", "dcp.StorageWriter",
             "dcp.StorageWriter.reset", "dcp.StorageReader", "dcp.StorageReader.reset"}


def _model() -> torch.nn.Module:
    return make_training_state(0)[0]


ENTRIES = {
    "save_state output_dir": lambda url, acc: fastckpt.save_state(_model(), model_only=True, output_dir=url),
    "save_state project_dir": lambda url, acc: fastckpt.save_state(_model(), project_dir=url, total_limit=2),
    "load_state input_dir": lambda url, acc: fastckpt.load_state(_model(), input_dir=url),
    "load_state project_dir": lambda url, acc: fastckpt.load_state(_model(), project_dir=url),
    "latest_checkpoint": lambda url, acc: fastckpt.latest_checkpoint(url),
    "verify_checkpoint": lambda url, acc: fastckpt.verify_checkpoint(url),
    "accelerate.save_state output_dir": lambda url, acc: fastckpt.accelerate.save_state(acc(), url),
    "accelerate.save_state project_dir": lambda url, acc: fastckpt.accelerate.save_state(acc(
        project_config=ProjectConfiguration(project_dir=url, automatic_checkpoint_naming=True))),
    "accelerate.load_state input_dir": lambda url, acc: fastckpt.accelerate.load_state(acc(), url),
    "accelerate.load_state project_dir": lambda url, acc: fastckpt.accelerate.load_state(acc(
        project_config=ProjectConfiguration(project_dir=url, automatic_checkpoint_naming=True))),
    "dcp.save": lambda url, acc: fastckpt.dcp.save({"w": torch.ones(2)}, url),
    "dcp.load": lambda url, acc: fastckpt.dcp.load({"w": torch.ones(2)}, url),
    "dcp.StorageWriter": lambda url, acc: fastckpt.dcp.StorageWriter(url),
    "dcp.StorageWriter.reset": lambda url, acc: fastckpt.dcp.StorageWriter("local").reset(url),
    "dcp.StorageReader": lambda url, acc: fastckpt.dcp.StorageReader(url),
    "dcp.StorageReader.reset": lambda url, acc: fastckpt.dcp.StorageReader("local").reset(url),
    "torch.save_file": lambda url, acc: fastckpt.torch.save_file({"w": torch.ones(2)}, url),
    "torch.load_file": lambda url, acc: fastckpt.torch.load_file(url),
    "torch.safe_open": lambda url, acc: fastckpt.torch.safe_open(url, framework="pt"),
    "torch.save_model": lambda url, acc: fastckpt.torch.save_model(_model(), url),
    "torch.load_model": lambda url, acc: fastckpt.torch.load_model(_model(), url),
}

CLI = {
    "verify": lambda url: ["verify", url],
    "inspect": lambda url: ["inspect", url],
    "convert src": lambda url: ["convert", url, "out"],
    "convert dst": lambda url: ["convert", "in", url],
    "consolidate src": lambda url: ["consolidate", url, "out"],
    "consolidate out": lambda url: ["consolidate", "in", url],
}


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _created(cwd: Path) -> list[str]:
    return sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*"))


@pytest.mark.parametrize(("entry", "scheme"), [(e, s) for e in sorted(ENTRIES) for s in sorted(URLS)
                                               if not (e in S3_SERVED and s.lower() == "s3")])
def test_unsupported_url_is_refused_before_anything_is_written(entry, scheme, empty_cwd, new_accelerator):
    url = URLS[scheme]
    with pytest.raises(ValueError) as caught:
        ENTRIES[entry](url, new_accelerator)
    message = str(caught.value)
    assert f"{scheme.lower()}://" in message and url in message and "local paths" in message, message
    assert ("s3://" in message.split("supported: ")[1]) == (entry in S3_SERVED), message
    assert _created(empty_cwd) == []


@pytest.mark.parametrize(("command", "scheme"), [(c, s) for c in sorted(CLI) for s in sorted(URLS)
                                                 if not (c in ("verify", "inspect", "convert src", "consolidate src")
                                                         and s.lower() == "s3")])
def test_cli_refuses_unsupported_urls_with_usage_status(command, scheme, empty_cwd, capsys):
    url = URLS[scheme]
    assert main(CLI[command](url)) == 2
    err = capsys.readouterr().err
    assert f"{scheme.lower()}://" in err and url in err, err
    assert _created(empty_cwd) == []


def test_file_url_names_the_local_path_to_pass_instead():
    with pytest.raises(ValueError, match=r"pass the local path '/tmp/my ckpt'"):
        check_location("file:///tmp/my%20ckpt", "output_dir")


@pytest.mark.parametrize("path", ["ckpt", "ckpt/step_1", "/abs/path", "C:\\ckpt", "a:b/c", "weird:/x", "./s3:x", b"bytes/x",
                                  Path("s3:/bucket")])
def test_local_paths_pass(path):
    assert url_scheme(path) is None
    assert check_location(path, "output_dir") is None


def test_a_scheme_an_entry_point_serves_passes():
    assert check_location("s3://bucket/x", "output_dir", supported=("s3",)) == "s3"
    assert check_location(None, "output_dir") is None
    with pytest.raises(ValueError, match=r"gs:// storage is not supported here \(supported: local paths, s3://\)"):
        check_location("gs://bucket/x", "output_dir", supported=("s3",))


def test_entry_points_leave_local_relative_paths_alone(empty_cwd):
    """The check is not a string test on ':': a local path with a colon still saves there."""
    path = fastckpt.save_state(_model(), model_only=True, output_dir="run:1/ckpt")
    assert path == empty_cwd / "run:1" / "ckpt" and (path / "fastckpt.json").is_file()
    assert os.listdir(empty_cwd) == ["run:1"]

"""Log lines (issue 12, item 9): ``logging.getLogger("fastckpt")`` gets one INFO line per save and per load naming the
folder, the parts, the bytes, the seconds and GB/s, and one DEBUG line per file."""

from __future__ import annotations

import logging
import re

from helpers.common import make_training_state

import fastckpt

LINE = re.compile(r"^(saved|loaded) (?P<folder>\S+) \((?P<mode>\w+)\): (?P<parts>\d+) parts, (?P<bytes>\d+) bytes "
                  r"in (?P<s>[0-9.]+) s, (?P<rate>[0-9.]+) GB/s")


def _info(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "fastckpt" and r.levelno == logging.INFO]


def test_info_line_per_save_and_load(tmp_path, caplog):
    model, opt, sched = make_training_state(0)
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c")
        fastckpt.load_state(model, opt, sched, input_dir=ckpt)
    saved, loaded = _info(caplog)
    files = {p.name: p.stat().st_size for p in ckpt.iterdir() if p.name != "fastckpt.json"}
    m = LINE.match(saved)
    assert m and m["folder"] == str(ckpt) and m["mode"] == "full", saved
    assert int(m["parts"]) == len(files)  # model, optimizer, scheduler, RNG
    tensor_bytes = sum(t.numel() * t.element_size() for t in [*model.state_dict().values()])
    assert int(m["bytes"]) > tensor_bytes
    m = LINE.match(loaded)
    assert m and m["folder"] == str(ckpt) and int(m["parts"]) == len(files), loaded
    assert int(m["bytes"]) == sum(files.values())


def test_debug_line_per_file(tmp_path, caplog):
    model, opt, sched = make_training_state(0)
    with caplog.at_level(logging.DEBUG, logger="fastckpt"):
        ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c")
        fastckpt.load_state(model, opt, sched, input_dir=ckpt)
    debug = [r.getMessage() for r in caplog.records if r.name == "fastckpt" and r.levelno == logging.DEBUG]
    for name in ("model.safetensors", "optimizer.safetensors", "scheduler.json"):
        assert any(line.startswith("wrote ") and name in line for line in debug), (name, debug)
        assert any(line.startswith(("opened ", "read ")) and name in line for line in debug), (name, debug)


def test_nothing_logged_below_the_level(tmp_path, caplog):
    model, opt, sched = make_training_state(0)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c")
    assert [r for r in caplog.records if r.name == "fastckpt"] == []

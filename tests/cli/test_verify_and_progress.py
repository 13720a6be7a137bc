"""``fastckpt verify`` of one file of a checkpoint uses the manifest beside it; a stock accelerate folder is said
to record no checksums (issue 12, item 7); progress bars appear only on a terminal (item 9)."""

from __future__ import annotations

import io

import safetensors.torch as official
import torch
from helpers.common import make_training_state, read_split

import fastckpt
from fastckpt.cli import main as cli
from fastckpt.cli.progress import Progress


def _flip_data_byte(path, tensor):
    n, _json, header, _data = read_split(path)
    begin = 8 + n + header[tensor]["data_offsets"][0]
    raw = bytearray(path.read_bytes())
    raw[begin] ^= 0x01
    path.write_bytes(bytes(raw))


def test_verify_of_one_damaged_file_uses_the_manifest_beside_it(tmp_path, capsys):
    model, opt, sched = make_training_state(0)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c")
    assert cli(["verify", str(ckpt / "model.safetensors")]) == 0
    _flip_data_byte(ckpt / "model.safetensors", "fc2.weight")
    capsys.readouterr()
    assert cli(["verify", str(ckpt / "model.safetensors")]) == 1  # was "ok", exit 0
    err = capsys.readouterr().err
    assert f"{ckpt / 'model.safetensors'}: tensor 'fc2.weight': crc32c" in err
    assert "optimizer" not in err  # only the file asked for was checked


def test_verify_of_a_stock_accelerate_folder_says_it_has_no_checksums(tmp_path, capsys):
    folder = tmp_path / "stock"
    folder.mkdir()
    model, opt, _ = make_training_state(0)
    official.save_file(dict(model.state_dict()), folder / "model.safetensors", metadata={"format": "pt"})
    torch.save(opt.state_dict(), folder / "optimizer.bin")
    assert cli(["verify", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "an accelerate checkpoint (no fastckpt.json), so it records no checksums" in out
    assert "2 files read, 1 safetensors headers valid" in out
    assert "did not finish" not in out


class _Tty(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_bar_only_on_a_terminal_and_for_large_work():
    for tty, total, shown in [(True, 2**30, True), (False, 2**30, False), (True, 2**20, False)]:
        stream = _Tty(tty)
        with Progress("verify c", stream=stream) as progress:
            for done in (total // 2, total):
                progress(done, total)
            if shown:
                assert progress.bar.n == total
        assert ("verify c" in stream.getvalue()) == shown, (tty, total)


def test_cli_verify_prints_no_bar_into_a_pipe(tmp_path, capsys):
    model, opt, sched = make_training_state(0)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c")
    assert cli(["verify", str(ckpt)]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "it/s" not in captured.err and "B/s" not in captured.err

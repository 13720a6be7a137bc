"""``fastckpt demo`` and its GPT-2 model: parameter counts, the bit-exact round trip of all three checkpoints,
the exit status, ``--keep``, and the ``python -m fastckpt`` entry point."""

from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys

import pytest
import torch

import fastckpt
from fastckpt import demo
from fastckpt.cli import main
from fastckpt.demo import compare as _demo_verify
from fastckpt.demo.gpt2 import GPT, PRESETS, GPTConfig, num_parameters

ROWS = ["fastckpt full", "fastckpt model_only", "accelerate"]


def _meta_model(config: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(config)


def test_gpt2_small_has_gpt2_parameter_count():
    # GPT-2 small with the head tied to the token embedding: 124,439,808 (50257 x 768 + 1024 x 768 +
    # 12 x 7,087,872 + 2 x 768).
    assert num_parameters(_meta_model(PRESETS["small"])) == 124_439_808


def test_gpt2_tiny_parameter_count():
    # 256 x 64 + 64 x 64 + 2 x 49,984 + 2 x 64
    assert num_parameters(_meta_model(PRESETS["tiny"])) == 120_576


def test_lm_head_is_tied_to_token_embedding():
    model = _meta_model(PRESETS["tiny"])
    assert model.lm_head.weight is model.transformer.wte.weight
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(model.state_dict())


def test_config_json_round_trips():
    config = PRESETS["tiny"]
    data = json.loads(config.to_json_string())
    assert data.pop("architecture") == "fastckpt-demo-gpt2" and "model_type" not in data
    assert GPTConfig(**data) == config


def test_demo_tiny_verifies_all_three_checkpoints(capsys):
    assert main(["demo", "--size", "tiny", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(tuple(name + "  " for name in ROWS))]
    assert [row[: len(name)] for row, name in zip(rows, ROWS)] == ROWS, out
    assert all(row.split()[-1] == "yes" for row in rows), out
    assert "FAILED" not in out


def test_run_demo_keep_writes_each_checkpoint(tmp_path):
    result = demo.run_demo("tiny", steps=3, out_dir=tmp_path, stream=io.StringIO(), rounds=1)
    assert result.ok
    assert [row.name for row in result.rows] == ROWS
    assert len(result.losses) == 3
    assert result.parameters == 120_576
    full, model_only, accel = (tmp_path / name for name in ("fastckpt_full", "fastckpt_model_only", "accelerate"))
    assert json.loads((full / "fastckpt.json").read_text())["mode"] == "full"
    assert json.loads((model_only / "fastckpt.json").read_text())["mode"] == "model_only"
    assert not (model_only / "optimizer.safetensors").exists()
    assert {p.name for p in accel.iterdir()} >= {"model.safetensors", "optimizer.bin", "scheduler.bin"}
    for row in result.rows:
        assert row.bytes_written == sum(p.stat().st_size for p in row.path.iterdir())
    with pytest.raises(FileExistsError):
        demo.run_demo("tiny", steps=1, out_dir=tmp_path, stream=io.StringIO(), rounds=1)


def test_demo_keep_refuses_a_used_folder(tmp_path, capsys):
    (tmp_path / "fastckpt_full").mkdir()
    assert main(["demo", "--size", "tiny", "--keep", str(tmp_path), "--rounds", "1"]) == 2
    captured = capsys.readouterr()
    assert "fastckpt_full already exists" in captured.err
    assert captured.out == ""  # refused before training


def test_demo_reports_a_raising_save_and_runs_the_other_rows(monkeypatch, capsys):
    def broken_save(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fastckpt, "save_state", broken_save)
    assert main(["demo", "--size", "tiny", "--steps", "1", "--rounds", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED fastckpt full: save raised OSError: [Errno 28] No space left on device" in out
    assert [line.split()[-1] for line in out.splitlines() if line.startswith(tuple(ROWS))] == ["no", "no", "yes"]


def test_demo_exits_nonzero_when_a_load_restores_nothing(monkeypatch, capsys):
    monkeypatch.setattr(fastckpt, "load_state", lambda *args, **kwargs: None)
    assert main(["demo", "--size", "tiny", "--steps", "1", "--rounds", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED fastckpt full: model.transformer.wte.weight: tensor values differ" in out
    assert "FAILED accelerate" not in out


def test_diff_is_type_strict():
    assert _demo_verify.diff({"betas": (0.9, 0.95)}, {"betas": (0.9, 0.95)}, "g") == []
    assert _demo_verify.diff({"betas": (0.9, 0.95)}, {"betas": [0.9, 0.95]}, "g") == [
        "g.betas: tuple (0.9, 0.95) != list [0.9, 0.95]"
    ]
    assert _demo_verify.diff(torch.zeros(2), torch.zeros(2, dtype=torch.float64), "t") == [
        "t: torch.float32[2] != torch.float64[2]"
    ]
    assert _demo_verify.diff(1, 1.0, "n") == ["n: int 1 != float 1.0"]


@pytest.mark.slow
def test_python_dash_m_fastckpt_demo():
    proc = subprocess.run(
        [sys.executable, "-m", "fastckpt", "demo", "--size", "tiny", "--steps", "2", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(tuple(name + "  " for name in ROWS))]
    assert len(rows) == 3 and all(row.rstrip().endswith("yes") for row in rows), proc.stdout
    assert "FAILED" not in proc.stdout


def test_demo_alternates_contenders_and_reports_medians_of_rounds(monkeypatch):
    """Issue 12, item 10: three rounds, each starting with another contender; the table shows medians and the
    speedup is the median of per-round ratios (said under the table)."""
    order: list[str] = []
    real = demo._methods

    def recording(*args, **kwargs):
        methods = real(*args, **kwargs)

        def wrap(name, save):
            return lambda objects, path: (order.append(name), save(objects, path))[1]

        return {name: (wrap(name, save), load) for name, (save, load) in methods.items()}

    monkeypatch.setattr(demo, "_methods", recording)
    out = io.StringIO()
    result = demo.run_demo("tiny", steps=1, cold_cache=False, stream=out, rounds=3)
    names = [row.name for row in result.rows]
    assert order == names + names[1:] + names[:1] + names[2:] + names[:2]
    by_name = {row.name: row for row in result.rows}
    for row in result.rows:
        assert len(row.save_rounds) == len(row.load_rounds) == 3 and row.verified
        assert row.save_s == statistics.median(row.save_rounds)
        ratios = [a / s for a, s in zip(by_name["accelerate"].save_rounds, row.save_rounds)]
        assert row.save_speedup == statistics.median(ratios)
        load_ratios = [a / s for a, s in zip(by_name["accelerate"].load_rounds, row.load_rounds)]
        assert row.load_speedup == statistics.median(load_ratios)  # issue 27 item 12: a load column too
    assert "medians of 3 rounds" in out.getvalue()
    lines = out.getvalue().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("checkpoint"))
    assert lines[header].split("  ")[-3:] == ["save speedup", "load speedup", "verified"]
    accelerate_row = next(line for line in lines if line.startswith("accelerate  "))
    assert accelerate_row.split()[-3:] == ["1.00x", "1.00x", "yes"]
    below = [line for line in lines[header + 2 + len(names):]  # the weights-only table (issue 26) comes between
             if not line.startswith(("weights-only load  ", "-----", "not installed, so not measured: ", *_WEIGHTS))]
    assert below[0].startswith("machine load: 1-minute load average up to ")  # beside the tables
    assert result.peak_load >= 0  # sampled during the rounds (Linux has a load average)


def test_the_load_average_line_says_what_a_busy_machine_does():
    busy = demo.busy_line(11.32, cpus=2)
    assert busy.startswith("machine load: 1-minute load average up to 11.32 on 2 CPUs: busy (other work wanted every "
                           "CPU): every time above is longer")
    assert "both speedup columns shrink toward 1x" in busy
    idle = demo.busy_line(0.5, cpus=16)
    assert idle == ("machine load: 1-minute load average up to 0.50 on 16 CPUs: not saturated; a busier machine gives "
                    "longer times and speed-ups closer to 1x")


# Issue 26: the weights-only loads next to the fastest loaders (fastckpt.demo.peers).

_WEIGHTS = ["fastckpt load_state model_only", "safetensors load_file + load_state_dict", "runai streamer + copy_",
            "tensorizer load_into_module"]
_MISSING_LINE = ("not installed, so not measured: runai streamer + copy_, tensorizer load_into_module "
                 "(runai_model_streamer, tensorizer); add them with pip install 'fastckpt-rs[bench]'")


def _weights_block(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("weights-only load  "))
    end = next(i for i in range(start + 2, len(lines)) if not lines[i].startswith(tuple(_WEIGHTS)))
    return lines[start:end]


def test_missing_peers_line_names_them_and_the_extra():
    from fastckpt.demo import peers

    assert peers.PEERS == _WEIGHTS[1:]
    assert peers.missing_line([]) == ""
    assert peers.missing_line(_WEIGHTS[2:]) == _MISSING_LINE


def test_weights_table_exact_values():
    from fastckpt.demo.table import DemoRow, format_weights_table

    rows = [DemoRow(_WEIGHTS[0], None, 500_000_000, float("nan"), 1.0, [], [], [1.0], load_speedup=1.0),
            DemoRow(_WEIGHTS[3], None, 700_000_000, float("nan"), 0.5, ["w: differs"], [], [0.5], load_speedup=2.0)]
    assert format_weights_table(rows).splitlines() == [
        "weights-only load               MB read  load s  load GB/s  vs fastckpt  equal",
        "------------------------------  -------  ------  ---------  -----------  -----",
        "fastckpt load_state model_only    500.0   1.000       0.50        1.00x    yes",
        "tensorizer load_into_module       700.0   0.500       1.40        2.00x     no",
    ]


def test_demo_weights_rows_with_absent_peers(monkeypatch):
    """Only safetensors importable (runai and tensorizer faked absent): the weights table has fastckpt's row and
    safetensors', rotated over the rounds, each equal to the saved weights; the line under it names the others."""
    from fastckpt.demo import peers

    monkeypatch.setattr(demo, "available_peers", lambda: [_WEIGHTS[1]])
    calls: list[str] = []
    real = peers.weights_loaders

    def recording(*args, **kwargs):
        loaders = real(*args, **kwargs)
        return {name: ((lambda name=name, run=run: (calls.append(name), run())[1]), size)
                for name, (run, size) in loaders.items()}

    monkeypatch.setattr(peers, "weights_loaders", recording)
    out = io.StringIO()
    result = demo.run_demo("tiny", steps=1, cold_cache=False, stream=out, rounds=3)
    assert result.ok and [row.name for row in result.weights] == _WEIGHTS[:2]
    assert result.missing_peers == _WEIGHTS[2:]
    assert calls == [_WEIGHTS[0], _WEIGHTS[1], _WEIGHTS[1], _WEIGHTS[0], _WEIGHTS[0], _WEIGHTS[1]]
    fast, safe = result.weights
    assert fast.load_speedup == 1.0 and len(safe.load_rounds) == 3
    assert safe.load_speedup == statistics.median([f / s for f, s in zip(fast.load_rounds, safe.load_rounds)])
    assert fast.bytes_written == result.rows[1].bytes_written > safe.bytes_written  # the folder / its weights file
    text = out.getvalue()
    block = _weights_block(text)
    assert [line.split("  ")[0] for line in block[2:]] == _WEIGHTS[:2]
    assert all(line.split()[-2:] == [f"{row.load_speedup:.2f}x", "yes"] for line, row in zip(block[2:], result.weights))
    assert text.splitlines()[text.splitlines().index(block[-1]) + 1] == _MISSING_LINE
    assert "the peers verify nothing" in text and "unties it on load" in text


def test_demo_without_any_peer_keeps_one_table_and_names_them_all(monkeypatch):
    monkeypatch.setattr(demo, "available_peers", lambda: [])
    out = io.StringIO()
    result = demo.run_demo("tiny", steps=1, cold_cache=False, stream=out, rounds=1)
    assert result.ok and result.weights == [] and result.missing_peers == _WEIGHTS[1:]
    assert "weights-only load  " not in out.getvalue()
    assert ("not installed, so not measured: safetensors load_file + load_state_dict, runai streamer + copy_, "
            "tensorizer load_into_module (safetensors, runai_model_streamer, tensorizer); add them with "
            "pip install 'fastckpt-rs[bench]'") in out.getvalue().splitlines()


def test_demo_weights_row_that_loads_wrong_bytes_fails(monkeypatch):
    """A peer that leaves the model unchanged (zeroed) is caught by the equality check: no, FAILED, exit 1."""
    from fastckpt.demo import peers

    monkeypatch.setattr(demo, "available_peers", lambda: [_WEIGHTS[1]])
    monkeypatch.setattr("safetensors.torch.load_file", lambda path: {})
    out = io.StringIO()
    result = demo.run_demo("tiny", steps=1, cold_cache=False, stream=out, rounds=1)
    assert not result.ok
    assert [row.verified for row in result.weights] == [True, False]
    assert (f"FAILED {_WEIGHTS[1]}: transformer.wte.weight: the loaded tensor differs from the saved one"
            in out.getvalue().splitlines())
    assert peers.FASTCKPT == _WEIGHTS[0]


def test_demo_real_peers_when_installed():
    pytest.importorskip("runai_model_streamer")
    pytest.importorskip("tensorizer")
    out = io.StringIO()
    result = demo.run_demo("tiny", steps=1, stream=out, rounds=1)
    assert result.ok and result.missing_peers == []
    assert [row.name for row in result.weights] == _WEIGHTS
    assert all(row.verified and len(row.load_rounds) == 1 for row in result.weights)
    # tensorizer's own file holds the tied embedding twice: more bytes than the safetensors file the others read
    assert result.weights[3].bytes_written > result.weights[1].bytes_written == result.weights[2].bytes_written
    assert "not installed" not in out.getvalue()

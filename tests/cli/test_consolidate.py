"""``fastckpt consolidate``: a DCP-format checkpoint becomes a Hugging Face model folder that the official
safetensors reader and ``from_pretrained`` load bit-exact, ties kept, every dtype (int, bool, float8, F4), headers
exactly as the official writer pads them, shards + index over ``--max-shard-size``, and clear exit statuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.dcp_state import full_state, same
from safetensors import safe_open

import fastckpt.dcp
from fastckpt import _core
from fastckpt._format.tensors import tensor_sources
from fastckpt.cli import main

transformers = pytest.importorskip("transformers")


def tiny_gpt2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16)
    return transformers.GPT2LMHeadModel(config).eval()


def official(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.fixture
def gpt2_checkpoint(tmp_path):
    """A fastckpt-style checkpoint: ``model/`` holds the DCP save of {"model": sd, "step": 3}, beside config.json."""
    model = tiny_gpt2()
    ckpt = tmp_path / "ckpt"
    fastckpt.dcp.save({"model": model.state_dict(), "step": 3}, ckpt / "model")
    model.config.save_pretrained(ckpt)
    model.generation_config.save_pretrained(ckpt)
    return model, ckpt


def test_gpt2_loads_bit_exact_with_from_pretrained(gpt2_checkpoint, tmp_path, capsys):
    model, ckpt = gpt2_checkpoint
    assert main(["consolidate", str(ckpt), str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "generation_config.json",
                                                                   "model.safetensors"]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    want = model.state_dict()
    got = loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    tensors, metadata = official(tmp_path / "hf" / "model.safetensors")
    assert "lm_head.weight" not in tensors and metadata == {"format": "pt", "lm_head.weight": "transformer.wte.weight"}
    assert "model.safetensors" in capsys.readouterr().out


def test_headers_and_bytes_are_the_official_writers(gpt2_checkpoint, tmp_path):
    model, ckpt = gpt2_checkpoint
    assert main(["consolidate", str(ckpt / "model"), str(tmp_path / "hf")]) == 0
    data = (tmp_path / "hf" / "model.safetensors").read_bytes()
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    expected = _core.serialize(tensor_sources(sd), [("format", "pt"), ("lm_head.weight", "transformer.wte.weight")])
    assert data == expected
    assert int.from_bytes(data[:8], "little") % 8 == 0


def test_every_dtype_from_a_sharded_state(tmp_path):
    state = full_state()
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    fastckpt.dcp.save(state, tmp_path / "c")
    assert main(["consolidate", str(tmp_path / "c"), str(tmp_path / "hf")]) == 0
    got, metadata = official(tmp_path / "hf" / "model.safetensors")
    assert metadata == {"format": "pt", "head": "emb"}
    assert got.keys() == tensors.keys() - {"head"}
    assert all(same(tensors[k], got[k]) for k in got)


def test_shards_and_index(gpt2_checkpoint, tmp_path):
    model, ckpt = gpt2_checkpoint
    assert main(["consolidate", str(ckpt), str(tmp_path / "hf"), "--max-shard-size", "40000"]) == 0
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors.index.json" in names
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    union: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors, _ = official(tmp_path / "hf" / shard)
        assert all(index["weight_map"][k] == shard for k in tensors)
        union.update(tensors)
    assert sorted(index["weight_map"]) == sorted(union)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in union.values())
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_resave_replaces_the_output_whole(gpt2_checkpoint, tmp_path):
    _, ckpt = gpt2_checkpoint
    out = tmp_path / "hf"
    assert main(["consolidate", str(ckpt), str(out), "--max-shard-size", "40000"]) == 0
    assert main(["consolidate", str(ckpt), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]  # no staging left


def test_exit_statuses(gpt2_checkpoint, tmp_path, capsys):
    _, ckpt = gpt2_checkpoint
    assert main(["consolidate", str(tmp_path / "none"), str(tmp_path / "o")]) == 2
    assert main(["consolidate", str(ckpt), str(tmp_path / "o"), "--max-shard-size", "5 parsecs"]) == 2
    assert main(["consolidate", str(ckpt), str(tmp_path / "o"), "--key", "optim"]) == 1
    meta = ckpt / "model" / "dcp_metadata.json"
    meta.write_text(meta.read_text().replace('"format_version": 1', '"format_version": 7'))
    assert main(["consolidate", str(ckpt), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "no tensors under 'optim'" in err and "HeaderError" in err and "dcp_metadata.json" in err
    assert not (tmp_path / "o").exists()


CONSOLIDATE_SCRIPT = """
import json, sys
from fastckpt.cli import main
import fastckpt._io.dcp.consolidate, fastckpt.cli.consolidate, tqdm  # imported before the measurement

def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

before = hwm_kib()
status = main(["consolidate", sys.argv[1], sys.argv[2], "--threads", "4"])
print(json.dumps({"status": status, "before_kib": before, "after_kib": hwm_kib()}))
"""


@pytest.mark.slow
def test_consolidate_streams_with_a_few_chunk_buffers(tmp_path):
    import subprocess
    import sys

    save = ("import sys, torch, fastckpt.dcp; fastckpt.dcp.save({'a': torch.ones(8192, 4096), "
            "'b': torch.full((4096, 8192), 2.0)}, sys.argv[1])")  # 256 MiB in two tensors
    subprocess.run([sys.executable, "-W", "ignore", "-c", save, str(tmp_path / "c")], check=True, timeout=300)
    out = subprocess.run([sys.executable, "-c", CONSOLIDATE_SCRIPT, str(tmp_path / "c"), str(tmp_path / "hf")],
                         capture_output=True, text=True, check=True, timeout=300)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    extra_mib = (rss["after_kib"] - rss["before_kib"]) / 1024
    assert rss["status"] == 0
    # 4 threads x 8 MiB copy buffers + interpreter noise; the state is 256 MiB.
    assert extra_mib < 64, f"peak resident memory grew by {extra_mib:.1f} MiB while consolidating 256 MiB"
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 256 * 2**20


def test_a_model_only_folder_is_already_a_model_folder_and_convert_reshards_it(tmp_path, capsys):
    """Issue 27 item 8: an FSDP2 model-only save is the one-process model-only folder (tests/integrations/
    test_fsdp.py checks that); consolidate says it is one already and names the command that reshards it."""
    model = torch.nn.Linear(4, 3)
    folder = fastckpt.save_state(model, model_only=True, output_dir=tmp_path / "weights")
    assert main(["consolidate", str(folder), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err == (f"fastckpt consolidate: {folder}: already a model folder (model.safetensors), not a DCP checkpoint: "
                   "there is nothing to consolidate (from_pretrained and load_state read it as it is); to reshard it, "
                   f"run `fastckpt convert {folder} OUT --to hf-model --max-shard-size 5GB`\n")
    assert not (tmp_path / "hf").exists()
    assert main(["convert", str(folder), str(tmp_path / "hf"), "--to", "hf-model", "--max-shard-size", "5GB"]) == 0
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert all(torch.equal(f.get_tensor(k), v) for k, v in model.state_dict().items())

"""Every load checks every byte it reads (issue 19 item 2): a one-byte flip inside a tensor of each kind of file a
load reads (a single ``model.safetensors`` over 1 MiB, Hugging Face shards, the optimizer file read into the live
optimizer's own tensors, the RNG file, a ``fastckpt.dcp`` folder) raises IntegrityError naming the file and the
tensor, without ``verify=True``, and leaves the live model and optimizer bit-identical (``torch.equal``);
``verify=False`` is the explicit opt-out. The FSDP2 part files are covered in tests/integrations/test_fsdp.py
(2 processes, scenario ``integrity``)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

import fastckpt
import fastckpt.dcp
from fastckpt.errors import DtypeError, IntegrityError


def _state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))  # 1.5 MB
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()  # the optimizer holds state: the load reads into its live tensors
    opt.zero_grad()
    return model, opt


def _snapshot(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def _same(a, b) -> bool:
    (ma, oa), (mb, ob) = a, b
    if ma.keys() != mb.keys() or not all(torch.equal(ma[k], mb[k]) for k in ma):
        return False
    if oa["param_groups"] != ob["param_groups"] or oa["state"].keys() != ob["state"].keys():
        return False
    return all(torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][p][k]))
               for p, s in oa["state"].items() for k, v in s.items())


def _flip_tensor(path, tensor: str, at: int = 1000) -> None:
    """Flip one bit of byte ``at`` of ``tensor``'s data in the safetensors file ``path``."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8:8 + n])[tensor]["data_offsets"][0]
    data[8 + n + begin + at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("load_integrity")
    model, opt = _state(0)
    single = fastckpt.save_state(model, opt, output_dir=root / "single")
    shards = fastckpt.save_state(model, opt, output_dir=root / "shards", max_shard_size="400KB")
    return single, shards


@pytest.mark.parametrize("file,tensor", [
    ("model.safetensors", "2.weight"),
    ("optimizer.safetensors", "state.0.weight.exp_avg_sq"),
])
def test_a_flip_in_a_single_file_is_refused_and_changes_nothing(saved, tmp_path, file, tensor):
    folder = shutil.copytree(saved[0], tmp_path / "ckpt")
    assert (folder / file).stat().st_size > 1 << 20
    _flip_tensor(folder / file, tensor)
    model, opt = _state(5)
    before = _snapshot(model, opt)
    with pytest.raises(IntegrityError) as info:
        fastckpt.load_state(model, opt, input_dir=folder)
    assert str(info.value).startswith(f'{folder / file}: tensor "{tensor}": crc32c ')
    assert "recorded in fastckpt.json (the file is damaged)" in str(info.value)
    assert _same(_snapshot(model, opt), before)
    fastckpt.load_state(model, opt, input_dir=folder, verify=False)  # the explicit opt-out reads it as it is
    assert not _same(_snapshot(model, opt), before)


def _fresh(seed: int):
    """A model and an optimizer that has not stepped: the load reads the optimizer state into fresh tensors,
    summing them as it reads (one pass), and sums the model file before phase 2."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("file,tensor", [
    ("optimizer.safetensors", "state.2.weight.exp_avg"),
    ("model.safetensors", "0.weight"),
])
@pytest.mark.parametrize("which", [0, 1])
def test_a_flip_is_refused_in_a_load_into_fresh_objects(saved, tmp_path, file, tensor, which):
    folder = shutil.copytree(saved[which], tmp_path / "ckpt")
    if which:
        index = json.loads((folder / f"{file}.index.json").read_text())["weight_map"] \
            if (folder / f"{file}.index.json").exists() else None
        path = folder / (index[tensor] if index else file)
    else:
        path = folder / file
    _flip_tensor(path, tensor, at=4097)
    model, opt = _fresh(5)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(IntegrityError) as info:
        fastckpt.load_state(model, opt, input_dir=folder)
    assert str(info.value).startswith(f'{path}: tensor "{tensor}": crc32c ')
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"] == {}  # the fresh state read before the check was never handed over
    model2, opt2 = _fresh(5)
    fastckpt.load_state(model2, opt2, input_dir=saved[which])  # intact: bit exact
    ref_model, ref_opt = _state(0)
    assert _same(_snapshot(model2, opt2), _snapshot(ref_model, ref_opt))


def test_a_flip_in_a_hugging_face_shard_is_refused_and_changes_nothing(saved, tmp_path):
    folder = shutil.copytree(saved[1], tmp_path / "ckpt")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index["0.weight"]
    assert len(set(index.values())) > 1
    _flip_tensor(shard, "0.weight", at=123_457)
    model, opt = _state(5)
    before = _snapshot(model, opt)
    with pytest.raises(IntegrityError, match=f'^{shard}: tensor "0.weight": crc32c '):
        fastckpt.load_state(model, opt, input_dir=folder)
    assert _same(_snapshot(model, opt), before)
    model2, _ = _state(5)
    with pytest.raises(IntegrityError, match='tensor "0.weight"'):
        fastckpt.load_state(model2, input_dir=folder, model_only=True)


def test_an_intact_checkpoint_loads_bit_exact(saved):
    model, opt = _state(0)
    want = _snapshot(model, opt)
    for folder in saved:
        m, o = _state(5)
        fastckpt.load_state(m, o, input_dir=folder)
        assert _same(_snapshot(m, o), want)


def test_a_flip_in_the_header_of_a_large_file_is_refused(saved, tmp_path):
    folder = shutil.copytree(saved[0], tmp_path / "ckpt")
    path = folder / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    at = data.index(b'\\"lr\\": 0.01')  # the saved learning rate, in the metadata: 0.01 becomes 0.03
    data[at + len(b'\\"lr\\": 0.01') - 1] ^= 0x02
    path.write_bytes(bytes(data))
    model, opt = _state(5)
    before = _snapshot(model, opt)
    with pytest.raises(IntegrityError, match="outside every tensor: the header or its padding"):
        fastckpt.load_state(model, opt, input_dir=folder)
    assert _same(_snapshot(model, opt), before)



@pytest.mark.parametrize("verify", [True, False])
def test_a_damaged_dtype_in_a_header_is_damage_not_a_cast_to_make(saved, tmp_path, verify):
    """A header byte turning "F32" into "I32" (same size) read as a dtype mismatch whose message advised
    cast=True; a verifying load owes the file's sums and reports the damage first (the dtype error its cause)."""
    folder = shutil.copytree(saved[0], tmp_path / "ckpt")
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    at = data.index(b'"dtype":"F32"')
    data[at + 9 : at + 10] = b"I"
    path.write_bytes(bytes(data))
    model, opt = _state(5)
    before = _snapshot(model, opt)
    if verify:
        with pytest.raises(IntegrityError, match="outside every tensor: the header or its padding") as info:
            fastckpt.load_state(model, opt, input_dir=folder)
        assert isinstance(info.value.__cause__, DtypeError)
    else:
        with pytest.raises(DtypeError, match="I32"):
            fastckpt.load_state(model, opt, input_dir=folder, verify=False)
    assert _same(_snapshot(model, opt), before)

def _dcp_state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(300, 300), "b": torch.randn(300)}, "step": 3}


def test_a_flip_in_a_fastckpt_dcp_chunk_is_refused_and_changes_nothing(tmp_path):
    fastckpt.dcp.save(_dcp_state(0), tmp_path / "dcp")
    files = json.loads((tmp_path / "dcp" / "fastckpt.json").read_text())["files"]
    name, tensor = next((n, t) for n, info in files.items() for t in info.get("tensors", {}) if "w" in t)
    _flip_tensor(tmp_path / "dcp" / name, tensor, at=77_777)
    live = _dcp_state(9)
    before = copy.deepcopy(live)
    with pytest.raises(IntegrityError, match=f'^{tmp_path / "dcp" / name}: tensor "{tensor}": crc32c '):
        fastckpt.dcp.load(live, tmp_path / "dcp")
    assert all(torch.equal(live["model"][k], before["model"][k]) for k in before["model"]) and live["step"] == 9 - 6
    fastckpt.dcp.load(live, tmp_path / "dcp", verify=False)
    assert not torch.equal(live["model"]["w"], before["model"]["w"])

"""Every part of a checkpoint is checked before anything is applied (issue 11 item 7): a damaged RNG state
(``Invalid mt19937 state``), scheduler, registered object or GradScaler state raises a ``CheckpointError`` naming
the file in phase 1, and the weights, optimizer state, scheduler and global RNGs are exactly as before.

The damage keeps the manifest's sizes and checksums consistent (they are recomputed), so these tests exercise the
structural checks, not the checksums: a state that is well-formed bytes but not a loadable state.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from helpers.common import assert_model_state, make_training_state, model_clone, rng_draws

import fastckpt
from fastckpt import _core


def _rewrite_checksums(folder, name):
    manifest = json.loads((folder / "fastckpt.json").read_text())
    size, crc, tensors, _err = _core.checksum_files([str(folder / name)])[0]
    entry = manifest["files"][name]
    entry["bytes"], entry["crc32c"] = size, f"{crc:08x}"
    if tensors is not None and "tensors" in entry:
        entry["tensors"] = {t: f"{c:08x}" for t, c in tensors}
    (folder / "fastckpt.json").write_text(json.dumps(manifest))


def _damage_tensor(folder, name, tensor, fill):
    path = folder / name
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    fill(memoryview(raw)[8 + n + begin:8 + n + end])
    path.write_bytes(bytes(raw))
    _rewrite_checksums(folder, name)


def _replace(folder, name, old: bytes, new: bytes):
    assert len(old) == len(new)
    path = folder / name
    raw = path.read_bytes()
    assert raw.count(old) == 1, (old, raw[:400])
    path.write_bytes(raw.replace(old, new))
    _rewrite_checksums(folder, name)


def _saved(tmp_path):
    model, opt, sched = make_training_state(1)
    folder = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c")
    return folder


def _expect_nothing_changed(folder, match, name):
    model, opt, sched = make_training_state(2)
    before = (model_clone(model), json.dumps(str(opt.state_dict())), sched.state_dict())
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    rng_before = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    with pytest.raises(fastckpt.CheckpointError, match=match) as info:
        fastckpt.load_state(model, opt, sched, input_dir=folder)
    assert name in str(info.value)
    assert_model_state(model, before[0])
    assert json.dumps(str(opt.state_dict())) == before[1]
    assert sched.state_dict() == before[2]
    random.setstate(rng_before[0])
    np.random.set_state(rng_before[1])
    torch.set_rng_state(rng_before[2])
    draws = rng_draws()
    random.setstate(rng_before[0])
    np.random.set_state(rng_before[1])
    torch.set_rng_state(rng_before[2])
    assert rng_draws() == draws
    return info.value


def test_invalid_mt19937_state_is_refused_before_weights_change(tmp_path):
    folder = _saved(tmp_path)

    def fill(view):
        view[:] = b"\xff" * len(view)

    _damage_tensor(folder, "random_states_0.safetensors", "torch", fill)
    err = _expect_nothing_changed(folder, "torch RNG state is invalid", "random_states_0.safetensors")
    assert isinstance(err, ValueError) and "mt19937" in str(err)


def test_invalid_python_rng_state_is_refused(tmp_path):
    folder = _saved(tmp_path)

    def fill(view):  # the last word is the Mersenne Twister position: 0..624
        view[-8:] = (10_000).to_bytes(8, "little")

    _damage_tensor(folder, "random_states_0.safetensors", "python", fill)
    _expect_nothing_changed(folder, "python RNG state is invalid", "random_states_0.safetensors")


def test_invalid_numpy_rng_position_is_refused(tmp_path):
    folder = _saved(tmp_path)
    raw = (folder / "random_states_0.safetensors").read_bytes()
    pos = raw[raw.index(b'pos\\": ') + 7:].split(b",")[0]
    _replace(folder, "random_states_0.safetensors", b'pos\\": ' + pos, b'pos\\": ' + b"9" * len(pos))
    _expect_nothing_changed(folder, "numpy RNG state is invalid", "random_states_0.safetensors")


def test_scheduler_state_of_the_wrong_kind_is_refused(tmp_path):
    folder = _saved(tmp_path)
    text = (folder / "scheduler.json").read_text()
    lrs = json.dumps(json.loads(text)["base_lrs"])
    as_string = json.dumps(lrs[1:-1])[: len(lrs)].ljust(len(lrs))  # same length: a str where a list was
    assert len(as_string) == len(lrs)
    _replace(folder, "scheduler.json", f'"base_lrs": {lrs}'.encode(), f'"base_lrs": {as_string}'.encode())
    _expect_nothing_changed(folder, "base_lrs", "scheduler.json")


# --------------------------------------------------------------------------------------------------------------
# through accelerate: registered objects, and a stock accelerate folder's RNG pickle
# --------------------------------------------------------------------------------------------------------------


class _Counter:
    def __init__(self, count: int):
        self.count = count
        self.shadow = torch.full((2,), float(count))

    def state_dict(self):
        return {"count": self.count, "shadow": self.shadow}

    def load_state_dict(self, state):
        self.count, self.shadow = state["count"], state["shadow"]


def _accelerated(new_accelerator, seed):
    model, opt, sched = make_training_state(seed)
    acc = new_accelerator()
    counter = _Counter(10 + seed)
    acc.register_for_checkpointing(counter)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, acc.unwrap_model(model), counter


def test_registered_object_state_of_the_wrong_kind_is_refused(tmp_path, new_accelerator):
    import fastckpt.accelerate

    acc, _model, _counter = _accelerated(new_accelerator, 1)
    folder = fastckpt.accelerate.save_state(acc, tmp_path / "c")
    _replace(folder, "custom_checkpoint_0.safetensors", b'\\"count\\": 11', b'\\"count\\": []')
    acc2, model2, counter2 = _accelerated(new_accelerator, 2)
    before = model_clone(model2)
    with pytest.raises(fastckpt.HeaderError, match=r"custom_checkpoint_0\.safetensors.*\['count'\]"):
        fastckpt.accelerate.load_state(acc2, folder)
    assert_model_state(model2, before)
    assert counter2.count == 12


def test_stock_accelerate_folder_with_invalid_mt19937_state_is_refused(tmp_path, new_accelerator):
    import fastckpt.accelerate

    acc, _model, _counter = _accelerated(new_accelerator, 3)
    acc.save_state(str(tmp_path / "stock"))
    pkl = tmp_path / "stock" / "random_states_0.pkl"
    from fastckpt._plan.accelerate_format import SAFE_GLOBALS

    with torch.serialization.safe_globals(SAFE_GLOBALS):
        states = torch.load(pkl, weights_only=True)
    states["torch_manual_seed"] = torch.full_like(states["torch_manual_seed"], 255)
    torch.save(states, pkl)
    acc2, model2, _counter2 = _accelerated(new_accelerator, 4)
    before = model_clone(model2)
    with pytest.raises(fastckpt.HeaderError, match=r"random_states_0\.pkl.*torch RNG state is invalid"):
        fastckpt.accelerate.load_state(acc2, tmp_path / "stock", trust_pickle=True)
    assert_model_state(model2, before)

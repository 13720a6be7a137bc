"""The checkpoint folder as files: modes (C13), overwriting while mapped (C14), device contexts (C15), truncation
and size checks (C16), names and dtypes refused at save without leftovers (C5, C6, C11, C12), and bytes that do not
depend on ``threads`` / ``durable``."""

from __future__ import annotations

import copy
import json
import os
import stat
from pathlib import Path

import pytest
import safetensors.torch as official
import torch
from helpers.common import (
    FakeConfig,
    TinyNet,
    assert_model_state,
    assert_nested_equal,
    assert_tensor_dicts_identical,
    assert_tensor_identical,
    batches,
    file_modes,
    model_clone,
    train,
)
from helpers.common import (
    make_training_state as _setup,
)
from torch import nn

import fastckpt
import fastckpt.torch as ft

# --------------------------------------------------------------------------------------------------------------
# C13: file modes
# --------------------------------------------------------------------------------------------------------------


def test_c13_new_checkpoint_files_follow_umask(tmp_path, umask022):
    model, opt, sched = _setup(seed=1)
    model.config = FakeConfig(a=1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "modes")
    modes = file_modes(ckpt)
    assert len(modes) == 6
    assert set(modes.values()) == {0o644}, {k: oct(v) for k, v in modes.items()}


def test_c13_overwrite_keeps_0640_for_every_file(tmp_path, umask022):
    model, opt, sched = _setup(seed=1)
    model.config = FakeConfig(a=1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "modes")
    for p in ckpt.iterdir():
        os.chmod(p, 0o640)
    train(model, opt, sched, batches(1))
    fastckpt.save_state(model, opt, sched, output_dir=ckpt)
    modes = file_modes(ckpt)
    assert len(modes) == 6
    assert set(modes.values()) == {0o640}, {k: oct(v) for k, v in modes.items()}
    fresh, fopt, fsched = _setup(seed=9)
    fastckpt.load_state(fresh, fopt, fsched, input_dir=ckpt)
    assert_model_state(fresh, model_clone(model))


def test_c13_save_file_modes(tmp_path, umask022):
    path = tmp_path / "m.safetensors"
    ft.save_file({"a": torch.ones(2)}, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    os.chmod(path, 0o640)
    ft.save_file({"a": torch.zeros(2)}, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert_tensor_dicts_identical(official.load_file(path), {"a": torch.zeros(2)})
    ft.save_model(TinyNet(), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


# --------------------------------------------------------------------------------------------------------------
# C14: overwrite while mapped
# --------------------------------------------------------------------------------------------------------------


def test_c14_save_state_over_a_checkpoint_whose_tensors_are_held(tmp_path):
    model, opt, sched = _setup(seed=1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "held")
    old = model_clone(model)
    held = ft.load_file(ckpt / "model.safetensors")
    lazy = ft.safe_open(ckpt / "model.safetensors", "pt")
    held_lazy = lazy.get_tensor("fc1.weight")
    train(model, opt, sched, batches(2))
    new = model_clone(model)
    try:
        fastckpt.save_state(model, opt, sched, output_dir=ckpt)
    except Exception as exc:  # a clear error before touching anything is allowed
        assert "held" in str(exc)
        expected_on_disk = old
    else:
        expected_on_disk = new
    fresh, fopt, fsched = _setup(seed=7)
    fastckpt.load_state(fresh, fopt, fsched, input_dir=ckpt)
    assert_model_state(fresh, expected_on_disk)
    assert_tensor_dicts_identical(held, old, ordered=False)  # held tensors keep their values
    assert_tensor_identical(held_lazy, old["fc1.weight"])
    assert_tensor_identical(lazy.get_tensor("fc2.bias"), old["fc2.bias"])


# --------------------------------------------------------------------------------------------------------------
# C15: meta-device context
# --------------------------------------------------------------------------------------------------------------


def test_c15_load_state_with_cpu_map_location_inside_meta_context(tmp_path):
    model, opt, sched = _setup(seed=1)
    train(model, opt, sched, batches(2))
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "meta")
    expected_model, expected_opt = model_clone(model), copy.deepcopy(opt.state_dict())
    fresh, fopt, fsched = _setup(seed=2)
    with torch.device("meta"):
        fastckpt.load_state(fresh, fopt, fsched, input_dir=ckpt, map_location="cpu")
    for k, v in fresh.state_dict().items():
        assert v.device == torch.device("cpu"), k
    assert_model_state(fresh, expected_model)
    assert_nested_equal(fopt.state_dict(), expected_opt)


# --------------------------------------------------------------------------------------------------------------
# C16: a truncated checkpoint
# --------------------------------------------------------------------------------------------------------------


def test_c16_truncated_model_file_in_checkpoint_named_error(tmp_path):
    model, opt, sched = _setup(seed=1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "trunc")
    path = ckpt / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 3)
    fresh, fopt, fsched = _setup(seed=2)
    before = model_clone(fresh)
    with pytest.raises((fastckpt.TruncatedFileError, fastckpt.IntegrityError)) as info:
        fastckpt.load_state(fresh, fopt, fsched, input_dir=ckpt)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "model.safetensors" in msg and str(size) in msg and str(size - 3) in msg
    assert_model_state(fresh, before)  # validated before anything is applied


# --------------------------------------------------------------------------------------------------------------
# C5, C6, C11, C12 through save_state; determinism across threads / durable
# --------------------------------------------------------------------------------------------------------------


def test_c5_float_buffer_and_its_int_view_in_one_model(tmp_path):
    class Aliased(nn.Module):
        def __init__(self, values):
            super().__init__()
            base = torch.tensor(values)
            self.register_buffer("as_float", base)
            self.register_buffer("as_int", base.view(torch.int32))

    saved = Aliased([1.0, -2.5, 3.25, 0.0])
    ckpt = fastckpt.save_state(saved, output_dir=tmp_path / "c5", model_only=True)
    on_disk = official.load_file(ckpt / "model.safetensors")
    assert_tensor_identical(on_disk["as_float"], saved.as_float)
    assert_tensor_identical(on_disk["as_int"], saved.as_int)
    fresh = Aliased([9.0, 9.0, 9.0, 9.0])
    fastckpt.load_state(fresh, input_dir=ckpt)
    assert_tensor_identical(fresh.as_float, saved.as_float)
    assert_tensor_identical(fresh.as_int, saved.as_int)


def test_c6_unsupported_dtype_in_model_names_key_and_dtype_and_leaves_nothing(tmp_path):
    model = nn.Linear(2, 2)
    model.register_buffer("rope_freqs", torch.zeros(3, dtype=torch.complex128))
    with pytest.raises(fastckpt.DtypeError) as info:
        fastckpt.save_state(model, output_dir=tmp_path / "c6")
    assert "rope_freqs" in str(info.value) and "complex128" in str(info.value)
    assert not isinstance(info.value, KeyError)
    assert list(tmp_path.iterdir()) == []


def test_c11_reserved_name_in_a_model_refused_leaving_nothing(tmp_path):
    model = nn.Module()
    model.register_buffer("__metadata__", torch.ones(2))
    with pytest.raises(ValueError) as info:
        fastckpt.save_state(model, output_dir=tmp_path / "c11")
    assert "__metadata__" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor a staging folder


def test_c12_utf8_fqns_round_trip_through_a_checkpoint(tmp_path):
    class Named(nn.Module):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.add_module("café", nn.Linear(2, 2))
            self.register_parameter("权重", nn.Parameter(torch.randn(3)))
            self.register_buffer("emoji😀", torch.randn(2))

        def forward(self, x):
            return self.café(x).sum() + self.权重.sum()

    model = Named(1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(torch.ones(1, 2)).backward()
    opt.step()
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "ünïcode")
    assert set(official.load_file(ckpt / "model.safetensors")) == {"café.weight", "café.bias", "权重", "emoji😀"}
    assert "state.权重.exp_avg" in official.load_file(ckpt / "optimizer.safetensors")
    saved_opt = copy.deepcopy(opt.state_dict())
    fresh = Named(2)
    fopt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fastckpt.load_state(fresh, fopt, input_dir=ckpt)
    assert_model_state(fresh, model_clone(model))
    assert_nested_equal(fopt.state_dict(), saved_opt)


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_checkpoint_bytes_do_not_depend_on_threads_or_durable(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 64))  # a few hundred KiB: several chunks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.zero_grad()
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    rng = torch.get_rng_state()
    folders = {}
    for threads, durable in [(1, True), (2, False), (8, True), (0, False)]:
        torch.set_rng_state(rng)
        folders[(threads, durable)] = _folder_bytes(fastckpt.save_state(
            model, opt, output_dir=tmp_path / f"t{threads}_{durable}", threads=threads, durable=durable))
    reference = folders[(1, True)]
    for key, files in folders.items():
        assert files.keys() == reference.keys(), key
        for name in files:
            assert files[name] == reference[name], (key, name)


def test_model_only_save_over_a_full_checkpoint_leaves_no_stale_parts(tmp_path):
    model, opt, sched = _setup(seed=1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c")
    fastckpt.save_state(model, opt, sched, output_dir=ckpt, model_only=True)
    assert sorted(p.name for p in ckpt.iterdir()) == ["fastckpt.json", "model.safetensors"]
    assert json.loads((ckpt / "fastckpt.json").read_text())["mode"] == "model_only"
    with pytest.raises(fastckpt.MissingStateError):
        fastckpt.load_state(*_setup(seed=2), input_dir=ckpt)


def test_file_size_differing_from_manifest_is_integrity_error(tmp_path):
    model, opt, sched = _setup(seed=1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "integ")
    path = ckpt / "optimizer.safetensors"
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x00" * 5)
    fresh, fopt, fsched = _setup(seed=2)
    before = model_clone(fresh)
    with pytest.raises(fastckpt.IntegrityError) as info:
        fastckpt.load_state(fresh, fopt, fsched, input_dir=ckpt)
    assert isinstance(info.value, ValueError)
    assert "optimizer.safetensors" in str(info.value)
    assert str(size) in str(info.value) and str(size + 5) in str(info.value)
    assert_model_state(fresh, before)


def test_c15_save_state_inside_meta_context(tmp_path):
    """The same kind as C15 on the save side: a default-device context must not leak into what is written."""
    model, opt, sched = _setup(seed=1)
    train(model, opt, sched, batches(2))
    with torch.device("meta"):
        ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "meta_save", step=4)
    fresh, fopt, fsched = _setup(seed=2)
    fastckpt.load_state(fresh, fopt, fsched, input_dir=ckpt)
    assert_model_state(fresh, model_clone(model))
    assert_nested_equal(fopt.state_dict(), opt.state_dict())


def test_str_paths_accepted(tmp_path):
    model, opt, sched = _setup(seed=1)
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=str(tmp_path / "s"))
    assert isinstance(ckpt, Path)
    fresh, fopt, fsched = _setup(seed=2)
    fastckpt.load_state(fresh, fopt, fsched, input_dir=str(ckpt))
    assert_model_state(fresh, model_clone(model))
    assert fastckpt.latest_checkpoint(str(tmp_path)) is None

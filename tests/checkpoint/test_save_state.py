"""``save_state`` / ``load_state``: full round trips into fresh objects, the checkpoint folder's layout and manifest,
and the cases that concern what a load restores: C1-C3 (tied weights, strided views), C25 (strict loading), C28
(dtype fidelity). File-level cases (C5, C6, C11-C16) are in test_checkpoint_files.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import safetensors.torch as official
import torch
from helpers.common import (
    SHARED_DTYPES,
    FakeConfig,
    TiedNet,
    TinyNet,
    assert_model_state,
    assert_nested_equal,
    assert_tensor_dicts_identical,
    assert_tensor_identical,
    batches,
    dtype_id,
    model_clone,
    random_tensor,
    read_split,
    rng_draws,
    scramble_rngs,
    tensor_bytes,
    train,
)
from helpers.common import (
    make_training_state as _setup,
)
from safetensors import safe_open as official_safe_open
from torch import nn

import fastckpt
import fastckpt.torch as ft


def _lrs_while_training(model, opt, sched, data) -> list[list[float]]:
    lrs = []
    for batch in data:
        train(model, opt, sched, [batch])
        lrs.append(list(sched.get_last_lr()))
    return lrs


# --------------------------------------------------------------------------------------------------------------
# full round trip
# --------------------------------------------------------------------------------------------------------------


def test_full_round_trip_bit_exact_into_fresh_objects(tmp_path):
    model, opt, sched = _setup(seed=1)
    train(model, opt, sched, batches(3))
    ckpt = tmp_path / "ckpt"
    returned = fastckpt.save_state(model, opt, sched, output_dir=ckpt, step=3)
    assert isinstance(returned, Path)
    assert returned.resolve() == ckpt.resolve()

    saved_model = model_clone(model)
    saved_opt = copy.deepcopy(opt.state_dict())
    saved_sched = copy.deepcopy(sched.state_dict())
    expected_draws = rng_draws()
    later = batches(4, seed=99)
    expected_lrs = _lrs_while_training(model, opt, sched, later)
    expected_final = model_clone(model)

    scramble_rngs()
    model2, opt2, sched2 = _setup(seed=2)
    train(model2, opt2, sched2, batches(1, seed=5))  # fresh objects that are not even at the same step
    result = fastckpt.load_state(model2, opt2, sched2, input_dir=ckpt)
    assert isinstance(result, fastckpt.LoadResult) and isinstance(result, tuple)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    missing, unexpected = result
    assert list(missing) == [] and list(unexpected) == []

    assert_model_state(model2, saved_model)
    assert_nested_equal(opt2.state_dict(), saved_opt, "optimizer")
    assert_nested_equal(sched2.state_dict(), saved_sched, "scheduler")
    assert rng_draws() == expected_draws
    assert _lrs_while_training(model2, opt2, sched2, later) == expected_lrs
    assert_model_state(model2, expected_final)


def test_full_checkpoint_files_and_manifest(tmp_path):
    model, opt, sched = _setup(seed=1)
    train(model, opt, sched, batches(2))
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "ckpt", step=2)
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == sorted(
        ["model.safetensors", "optimizer.safetensors", "scheduler.json", "random_states_0.safetensors",
         "fastckpt.json"]
    )
    manifest = json.loads((ckpt / "fastckpt.json").read_text())
    assert manifest["format"] == "fastckpt"
    assert manifest["format_version"] == 1
    assert manifest["mode"] == "full"
    assert set(manifest["files"]) == set(names) - {"fastckpt.json"}
    for name, info in manifest["files"].items():
        assert info["bytes"] == (ckpt / name).stat().st_size, name

    # model.safetensors: the plain state dict, metadata {"format": "pt"}, readable by the official reader
    with official_safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert_tensor_dicts_identical(official.load_file(ckpt / "model.safetensors"), dict(model.state_dict()),
                                  ordered=False)

    # optimizer.safetensors: state.{fqn}.{name}; param_groups with fqns in place of indices
    fqns = [n for n, _ in model.named_parameters()]
    opt_tensors = official.load_file(ckpt / "optimizer.safetensors")
    assert set(opt_tensors) == {f"state.{fqn}.{s}" for fqn in fqns for s in ("step", "exp_avg", "exp_avg_sq")}
    params = dict(model.named_parameters())
    for fqn in fqns:
        state = opt.state[params[fqn]]
        for s in ("step", "exp_avg", "exp_avg_sq"):
            assert_tensor_identical(opt_tensors[f"state.{fqn}.{s}"], state[s], f"{fqn}.{s}")
    with official_safe_open(str(ckpt / "optimizer.safetensors"), "pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
    assert len(groups) == 1 and groups[0]["params"] == fqns
    assert groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert groups[0]["weight_decay"] == 0.05

    json.loads((ckpt / "scheduler.json").read_text())  # plain JSON, no pickle
    rng = official.load_file(ckpt / "random_states_0.safetensors")
    assert int(rng["step"]) == 2
    for name in names:  # nothing pickled anywhere
        head = (ckpt / name).read_bytes()[:2]
        assert head not in (b"\x80\x02", b"\x80\x04", b"\x80\x05", b"PK"), name


class _ConfiguredNet(TinyNet):
    def __init__(self):
        super().__init__()
        self.config = FakeConfig(model_type="tiny", hidden=8)


def test_config_json_written_for_a_model_with_a_config(tmp_path):
    model = _ConfiguredNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    full = fastckpt.save_state(model, opt, output_dir=tmp_path / "full")
    assert (full / "config.json").read_text() == model.config.to_json_string()
    assert "config.json" in json.loads((full / "fastckpt.json").read_text())["files"]
    only = fastckpt.save_state(model, opt, output_dir=tmp_path / "only", model_only=True)
    assert sorted(p.name for p in only.iterdir()) == ["config.json", "fastckpt.json", "model.safetensors"]
    assert json.loads((only / "config.json").read_text()) == {"hidden": 8, "model_type": "tiny"}


def test_no_config_json_for_a_model_without_one(tmp_path):
    ckpt = fastckpt.save_state(TinyNet(), output_dir=tmp_path / "c", model_only=True)
    assert not (ckpt / "config.json").exists()


def test_lists_of_models_optimizers_schedulers(tmp_path):
    torch.manual_seed(1)
    m0, m1 = TinyNet(), nn.Linear(3, 2)
    o0 = torch.optim.AdamW(m0.parameters(), lr=1e-2)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    s0 = torch.optim.lr_scheduler.StepLR(o0, 1, gamma=0.9)
    s1 = torch.optim.lr_scheduler.ExponentialLR(o1, gamma=0.8)
    train(m0, o0, s0, batches(2))
    for x, _ in batches(2, d_in=3):
        o1.zero_grad()
        m1(x).sum().backward()
        o1.step()
        s1.step()
    ckpt = fastckpt.save_state([m0, m1], [o0, o1], [s0, s1], output_dir=tmp_path / "multi")
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == sorted(["model.safetensors", "model_1.safetensors", "optimizer.safetensors",
                            "optimizer_1.safetensors", "scheduler.json", "scheduler_1.json",
                            "random_states_0.safetensors", "fastckpt.json"])
    assert_tensor_dicts_identical(official.load_file(ckpt / "model_1.safetensors"), dict(m1.state_dict()),
                                  ordered=False)
    keys0 = set(official.load_file(ckpt / "optimizer.safetensors"))
    keys1 = set(official.load_file(ckpt / "optimizer_1.safetensors"))
    adam_names = ("step", "exp_avg", "exp_avg_sq")
    assert keys0 == {f"state.model_0.{n}.{s}" for n, _ in m0.named_parameters() for s in adam_names}
    assert keys1 == {f"state.model_1.{n}.momentum_buffer" for n, _ in m1.named_parameters()}

    expected = [model_clone(m0), model_clone(m1), copy.deepcopy(o0.state_dict()), copy.deepcopy(o1.state_dict()),
                s0.state_dict(), s1.state_dict()]
    torch.manual_seed(7)
    n0, n1 = TinyNet(), nn.Linear(3, 2)
    p0 = torch.optim.AdamW(n0.parameters(), lr=1e-2)
    p1 = torch.optim.SGD(n1.parameters(), lr=0.1, momentum=0.9)
    t0 = torch.optim.lr_scheduler.StepLR(p0, 1, gamma=0.9)
    t1 = torch.optim.lr_scheduler.ExponentialLR(p1, gamma=0.8)
    result = fastckpt.load_state([n0, n1], [p0, p1], [t0, t1], input_dir=ckpt)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert_model_state(n0, expected[0])
    assert_model_state(n1, expected[1])
    assert_nested_equal(p0.state_dict(), expected[2], "optimizer 0")
    assert_nested_equal(p1.state_dict(), expected[3], "optimizer 1")
    assert_nested_equal(t0.state_dict(), expected[4], "scheduler 0")
    assert_nested_equal(t1.state_dict(), expected[5], "scheduler 1")


def test_save_does_not_change_the_live_objects(tmp_path):
    model, opt, sched = _setup(seed=3)
    train(model, opt, sched, batches(2))
    before = (model_clone(model), copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict()))
    fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "c")
    assert_model_state(model, before[0])
    assert_nested_equal(opt.state_dict(), before[1])
    assert_nested_equal(sched.state_dict(), before[2])


def test_every_shared_dtype_round_trips_through_save_state(tmp_path):
    class AllDtypes(nn.Module):
        def __init__(self, seed):
            super().__init__()
            for i, (dtype, _) in enumerate(SHARED_DTYPES):
                self.register_buffer(f"buf_{dtype_id(dtype)}", random_tensor(dtype, (3, 4), seed=seed + i))
            self.register_buffer("scalar_f64", torch.tensor(seed + 0.25, dtype=torch.float64))
            self.w = nn.Parameter(torch.full((2,), float(seed)))

    model = AllDtypes(seed=10)
    ckpt = fastckpt.save_state(model, output_dir=tmp_path / "dtypes")
    expected = model_clone(model)
    on_disk = official.load_file(ckpt / "model.safetensors")
    assert_tensor_dicts_identical(on_disk, expected, ordered=False)
    fresh = AllDtypes(seed=50)
    assert fastckpt.load_state(fresh, input_dir=ckpt) == ([], [])
    assert_model_state(fresh, expected)


def test_zero_element_tensors_round_trip_with_optimizer(tmp_path):
    class WithEmpty(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.empty = nn.Parameter(torch.zeros(0, 4))
            self.register_buffer("empty_buf", torch.zeros(3, 0, dtype=torch.int64))

        def forward(self, x):
            return self.lin(x) + self.empty.sum()

    torch.manual_seed(0)
    model = WithEmpty()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for x, _ in batches(2, d_in=2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "z")
    saved_model, saved_opt = model_clone(model), copy.deepcopy(opt.state_dict())
    torch.manual_seed(1)
    fresh = WithEmpty()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fastckpt.load_state(fresh, fresh_opt, input_dir=ckpt)
    assert_model_state(fresh, saved_model)
    assert tuple(fresh.empty.shape) == (0, 4) and tuple(fresh.empty_buf.shape) == (3, 0)
    assert_nested_equal(fresh_opt.state_dict(), saved_opt)


def test_buffers_and_int_state_restored(tmp_path):
    """BatchNorm's running stats and its int64 num_batches_tracked are part of the model file."""
    model, opt, sched = _setup(seed=4)
    train(model, opt, sched, batches(3))
    assert int(model.bn.num_batches_tracked) == 3
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "bn")
    fresh, fopt, fsched = _setup(seed=5)
    fastckpt.load_state(fresh, fopt, fsched, input_dir=ckpt)
    assert int(fresh.bn.num_batches_tracked) == 3
    assert fresh.bn.num_batches_tracked.dtype == torch.int64
    assert_tensor_identical(fresh.bn.running_var, model.bn.running_var)


def test_load_state_of_missing_folder_is_missing_state_error(tmp_path):
    with pytest.raises(fastckpt.MissingStateError) as info:
        fastckpt.load_state(TinyNet(), input_dir=tmp_path / "does_not_exist")
    assert isinstance(info.value, FileNotFoundError)
    assert "does_not_exist" in str(info.value)


def test_load_state_of_folder_without_manifest_is_refused(tmp_path):
    model = TinyNet()
    folder = tmp_path / "plain"
    folder.mkdir()
    ft.save_file(dict(model.state_dict()), folder / "model.safetensors")
    before = model_clone(model)
    with pytest.raises(fastckpt.MissingStateError) as info:
        fastckpt.load_state(TinyNet(), input_dir=folder)
    assert "fastckpt.json" in str(info.value)
    assert_model_state(model, before)


# --------------------------------------------------------------------------------------------------------------
# C1 / C2: tied weights
# --------------------------------------------------------------------------------------------------------------


def test_c1_tied_weights_save_state_one_copy_tie_holds(tmp_path):
    torch.manual_seed(1)
    model = TiedNet()
    ckpt = fastckpt.save_state(model, output_dir=tmp_path / "tied", model_only=True)
    _, _, header, data = read_split(ckpt / "model.safetensors")
    assert [k for k in header if k != "__metadata__"] == ["emb.weight"]
    assert header["__metadata__"] == {"format": "pt", "head.weight": "emb.weight"}
    assert len(data) == 10 * 4 * 4

    torch.manual_seed(2)
    fresh = TiedNet()
    result = fastckpt.load_state(fresh, input_dir=ckpt)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert fresh.head.weight is fresh.emb.weight
    assert_tensor_identical(fresh.emb.weight.detach(), model.emb.weight.detach())
    # Hugging Face / safetensors' load_model understand the alias too
    theirs = TiedNet()
    official.load_model(theirs, ckpt / "model.safetensors")
    assert_tensor_identical(theirs.head.weight.detach(), model.emb.weight.detach())


def test_c2_tied_weights_with_adamw_strict_full_load(tmp_path):
    torch.manual_seed(1)
    model = TiedNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.tensor([1, 3, 5, 7])
    opt.zero_grad()
    nn.functional.cross_entropy(model(idx), torch.tensor([2, 4, 6, 8])).backward()
    opt.step()
    assert len(opt.state) == 1
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "c2")
    opt_keys = set(official.load_file(ckpt / "optimizer.safetensors"))
    assert opt_keys == {"state.emb.weight.step", "state.emb.weight.exp_avg", "state.emb.weight.exp_avg_sq"}

    saved_opt = copy.deepcopy(opt.state_dict())
    torch.manual_seed(2)
    fresh = TiedNet()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    result = fastckpt.load_state(fresh, fresh_opt, input_dir=ckpt, strict=True)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert fresh.head.weight is fresh.emb.weight
    assert len(fresh_opt.state) == 1
    assert_nested_equal(fresh_opt.state_dict(), saved_opt, "optimizer")
    assert_tensor_identical(fresh.emb.weight.detach(), model.emb.weight.detach())

def test_c1_tied_checkpoint_loads_into_an_untied_model(tmp_path):
    class Untied(TiedNet):
        def __init__(self):
            super().__init__()
            self.head.weight = nn.Parameter(torch.zeros(10, 4))

    torch.manual_seed(1)
    tied = TiedNet()
    ckpt = fastckpt.save_state(tied, output_dir=tmp_path / "tied", model_only=True)
    untied = Untied()
    assert fastckpt.load_state(untied, input_dir=ckpt) == ([], [])
    assert_tensor_identical(untied.head.weight.detach(), tied.emb.weight.detach())
    assert_tensor_identical(untied.emb.weight.detach(), tied.emb.weight.detach())



# --------------------------------------------------------------------------------------------------------------
# C3: strided views
# --------------------------------------------------------------------------------------------------------------


class Strided(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(6, 4)
        self.lin.weight = nn.Parameter(torch.randn(4, 6).t())  # (6, 4), transposed view
        self.conv = nn.Conv2d(3, 5, 3).to(memory_format=torch.channels_last)


def test_c3_strided_params_row_major_on_disk_live_params_untouched(tmp_path):
    model = Strided(seed=3)
    assert tuple(model.lin.weight.shape) == (6, 4) and not model.lin.weight.is_contiguous()
    assert not model.conv.weight.is_contiguous()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt.zero_grad()
    (model.lin.weight.sum() + model.conv.weight.square().sum()).backward()
    opt.step()
    before = {k: (v.detach().clone(), v.stride(), v.data_ptr()) for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())

    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "strided")
    for k, v in model.state_dict().items():  # live params not modified: same memory, layout and values
        clone, stride, ptr = before[k]
        assert v.stride() == stride and v.data_ptr() == ptr, k
        assert_tensor_identical(v, clone, k)
    n, _, header, data = read_split(ckpt / "model.safetensors")
    for k, (clone, _, _) in before.items():
        begin, end = header[k]["data_offsets"]
        assert data[begin:end] == tensor_bytes(clone), k  # logical row-major order
        assert header[k]["shape"] == list(clone.shape)

    fresh_plain = nn.Module()  # a contiguous destination
    fresh_plain.lin = nn.Linear(6, 4)
    fresh_plain.lin.weight = nn.Parameter(torch.zeros(6, 4))
    fresh_plain.conv = nn.Conv2d(3, 5, 3)
    fastckpt.load_state(fresh_plain, input_dir=ckpt, model_only=True)
    for k, (clone, _, _) in before.items():
        assert_tensor_identical(fresh_plain.state_dict()[k], clone, k)

    fresh = Strided(seed=4)  # a strided destination: filled in place, layout kept
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    strides = {k: v.stride() for k, v in fresh.state_dict().items()}
    fastckpt.load_state(fresh, fresh_opt, input_dir=ckpt)
    for k, v in fresh.state_dict().items():
        assert v.stride() == strides[k], k
        assert_tensor_identical(v, before[k][0], k)
    assert_nested_equal(fresh_opt.state_dict(), saved_opt, "optimizer")



# --------------------------------------------------------------------------------------------------------------
# C25: strict / non-strict
# --------------------------------------------------------------------------------------------------------------


class _Saved(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(2, 2)
        self.extra = nn.Parameter(torch.full((3,), 7.0))


class _Live(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(2, 2)
        self.missing = nn.Parameter(torch.full((2,), -1.0))


def test_c25_strict_load_names_missing_and_unexpected(tmp_path):
    torch.manual_seed(1)
    ckpt = fastckpt.save_state(_Saved(), output_dir=tmp_path / "c25", model_only=True)
    torch.manual_seed(2)
    live = _Live()
    with pytest.raises(fastckpt.KeyMismatchError) as info:
        fastckpt.load_state(live, input_dir=ckpt)
    assert isinstance(info.value, KeyError)
    assert "extra" in str(info.value) and "missing" in str(info.value)
    with pytest.raises(fastckpt.KeyMismatchError):
        fastckpt.load_state(live, input_dir=ckpt, model_only=True, strict=True)


def test_c25_non_strict_returns_both_lists_and_loads_the_rest(tmp_path):
    torch.manual_seed(1)
    saved = _Saved()
    ckpt = fastckpt.save_state(saved, output_dir=tmp_path / "c25", model_only=True)
    torch.manual_seed(2)
    live = _Live()
    result = fastckpt.load_state(live, input_dir=ckpt, strict=False)
    assert isinstance(result, fastckpt.LoadResult)
    assert list(result.missing_keys) == ["missing"]
    assert list(result.unexpected_keys) == ["extra"]
    assert_tensor_dicts_identical(dict(live.shared.state_dict()), dict(saved.shared.state_dict()))
    assert_tensor_identical(live.missing.detach(), torch.full((2,), -1.0))  # untouched


# --------------------------------------------------------------------------------------------------------------
# C28: dtype fidelity
# --------------------------------------------------------------------------------------------------------------


def test_c28_bf16_checkpoint_into_f32_model_is_a_dtype_error(tmp_path):
    torch.manual_seed(1)
    saved = nn.Linear(3, 2).to(torch.bfloat16)
    ckpt = fastckpt.save_state(saved, output_dir=tmp_path / "bf16", model_only=True)
    torch.manual_seed(2)
    live = nn.Linear(3, 2)
    before = model_clone(live)
    with pytest.raises(fastckpt.DtypeError) as info:
        fastckpt.load_state(live, input_dir=ckpt)
    msg = str(info.value)
    assert isinstance(info.value, TypeError)
    assert "weight" in msg or "bias" in msg
    assert "bfloat16" in msg or "BF16" in msg
    assert "float32" in msg or "F32" in msg
    assert_model_state(live, before)  # never a silent cast, nothing half-applied
    assert live.weight.dtype == torch.float32


def test_c28_complex64_and_bf16_buffers_keep_their_dtype(tmp_path):
    class Rotary(nn.Module):
        def __init__(self, seed):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            angles = torch.rand(4, 3, generator=g)
            self.register_buffer("freqs_cis", torch.polar(torch.ones(4, 3), angles))
            self.register_buffer("scale", torch.rand(5, generator=g).to(torch.bfloat16))

    saved = Rotary(1)
    ckpt = fastckpt.save_state(saved, output_dir=tmp_path / "rot", model_only=True)
    live = Rotary(2)
    fastckpt.load_state(live, input_dir=ckpt)
    assert live.freqs_cis.dtype == torch.complex64 and live.scale.dtype == torch.bfloat16
    assert_model_state(live, model_clone(saved))


def test_c28_complex64_into_float_buffer_is_a_dtype_error(tmp_path):
    saved = nn.Module()
    saved.register_buffer("freqs", torch.polar(torch.ones(3), torch.arange(3.0)))
    ckpt = fastckpt.save_state(saved, output_dir=tmp_path / "c", model_only=True)
    live = nn.Module()
    live.register_buffer("freqs", torch.zeros(3))
    with pytest.raises(fastckpt.DtypeError) as info:
        fastckpt.load_state(live, input_dir=ckpt)
    assert "freqs" in str(info.value)
    assert "complex64" in str(info.value) or "C64" in str(info.value)
    assert_tensor_identical(live.freqs, torch.zeros(3))


def test_shape_mismatch_is_refused_before_anything_changes(tmp_path):
    torch.manual_seed(1)
    ckpt = fastckpt.save_state(nn.Linear(3, 2), output_dir=tmp_path / "s", model_only=True)
    live = nn.Linear(4, 2)
    before = model_clone(live)
    with pytest.raises(fastckpt.CheckpointError) as info:
        fastckpt.load_state(live, input_dir=ckpt)
    assert "weight" in str(info.value)
    assert "2, 3" in str(info.value) and "2, 4" in str(info.value)  # both shapes named
    assert_model_state(live, before)

"""Optimizer state through save_state / load_state: every simply constructed ``torch.optim`` optimizer round-trips
bit-exactly and the steps after a resume equal those of an uninterrupted run; the file is keyed by fqn; C20
(map_location) and C26 (param_groups that do not cover a live parameter)."""

from __future__ import annotations

import copy
import json

import pytest
import safetensors.torch as official
import torch
from helpers.common import (
    assert_model_state,
    assert_nested_equal,
    assert_tensor_identical,
    batches,
    make_tiny,
    model_clone,
    requires_cuda,
    train,
)
from safetensors import safe_open as official_safe_open
from torch import nn

import fastckpt

O = torch.optim  # noqa: E741 - short alias for the table below
OPTIMIZERS = {
    "Adam": lambda p: O.Adam(p, lr=1e-2),
    "Adam_amsgrad": lambda p: O.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.01),
    "Adam_fused": lambda p: O.Adam(p, lr=1e-2, fused=True),
    "AdamW": lambda p: O.AdamW(p, lr=1e-2, weight_decay=0.1),
    "AdamW_foreach": lambda p: O.AdamW(p, lr=1e-2, foreach=True),
    "SGD": lambda p: O.SGD(p, lr=0.05),
    "SGD_momentum": lambda p: O.SGD(p, lr=0.05, momentum=0.9),
    "SGD_nesterov": lambda p: O.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "Adagrad": lambda p: O.Adagrad(p, lr=0.1, lr_decay=0.01),
    "RMSprop": lambda p: O.RMSprop(p, lr=1e-2, momentum=0.9, centered=True),
    "Adamax": lambda p: O.Adamax(p, lr=1e-2),
    "NAdam": lambda p: O.NAdam(p, lr=1e-2),
    "NAdam_decoupled": lambda p: O.NAdam(p, lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True),
    "RAdam": lambda p: O.RAdam(p, lr=1e-2),
    "ASGD": lambda p: O.ASGD(p, lr=1e-2, t0=1),
    "Rprop": lambda p: O.Rprop(p, lr=1e-2),
    "Adadelta": lambda p: O.Adadelta(p, lr=1.0),
    "Adafactor": lambda p: O.Adafactor(p, lr=1e-2),
    "LBFGS": lambda p: O.LBFGS(p, lr=0.5, max_iter=3, history_size=3),
}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_optimizer_round_trip_and_resume_equals_uninterrupted_run(tmp_path, kind):
    closure = kind == "LBFGS"
    make = OPTIMIZERS[kind]
    model = make_tiny(1)
    opt = make(model.parameters())
    train(model, opt, None, batches(3), closure_optimizer=closure)
    assert len(opt.state) > 0 or kind == "SGD"  # plain SGD keeps no state
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / kind)
    saved_opt = copy.deepcopy(opt.state_dict())
    later = batches(2, seed=77)
    train(model, opt, None, later, closure_optimizer=closure)
    expected_model, expected_opt = model_clone(model), copy.deepcopy(opt.state_dict())

    fresh = make_tiny(2)
    fresh_opt = make(fresh.parameters())
    result = fastckpt.load_state(fresh, fresh_opt, input_dir=ckpt)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert_nested_equal(fresh_opt.state_dict(), saved_opt, f"{kind} after load")
    train(fresh, fresh_opt, None, later, closure_optimizer=closure)
    assert_model_state(fresh, expected_model)
    assert_nested_equal(fresh_opt.state_dict(), expected_opt, f"{kind} after resume")


def test_sparse_adam_round_trip(tmp_path):
    def setup(seed):
        torch.manual_seed(seed)
        emb = nn.Embedding(10, 4, sparse=True)
        return emb, O.SparseAdam(emb.parameters(), lr=1e-2)

    def steps(emb, opt, idxs):
        for idx in idxs:
            opt.zero_grad()
            emb(idx).square().sum().backward()
            opt.step()

    emb, opt = setup(1)
    steps(emb, opt, [torch.tensor([1, 2]), torch.tensor([2, 5])])
    ckpt = fastckpt.save_state(emb, opt, output_dir=tmp_path / "sparse")
    saved = copy.deepcopy(opt.state_dict())
    later = [torch.tensor([5, 7]), torch.tensor([1, 9])]
    steps(emb, opt, later)
    expected = model_clone(emb)

    fresh, fopt = setup(2)
    fastckpt.load_state(fresh, fopt, input_dir=ckpt)
    assert_nested_equal(fopt.state_dict(), saved, "SparseAdam")
    steps(fresh, fopt, later)
    assert_model_state(fresh, expected)


def test_several_param_groups_with_their_own_hyperparameters(tmp_path):
    def setup(seed):
        model = make_tiny(seed)
        opt = O.AdamW(
            [
                {"params": list(model.fc1.parameters()), "lr": 1e-2, "betas": (0.8, 0.9)},
                {"params": list(model.bn.parameters()), "lr": 5e-3, "weight_decay": 0.0},
                {"params": list(model.fc2.parameters())},
            ],
            lr=1e-3,
            weight_decay=0.2,
        )
        return model, opt

    model, opt = setup(1)
    train(model, opt, None, batches(2))
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "groups")
    with official_safe_open(str(ckpt / "optimizer.safetensors"), "pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
    assert [g["params"] for g in groups] == [
        ["fc1.weight", "fc1.bias"], ["bn.weight", "bn.bias"], ["fc2.weight", "fc2.bias"]]
    saved = copy.deepcopy(opt.state_dict())
    fresh, fopt = setup(2)
    fastckpt.load_state(fresh, fopt, input_dir=ckpt)
    assert_nested_equal(fopt.state_dict(), saved)
    assert fopt.param_groups[0]["betas"] == (0.8, 0.9)
    assert [g["lr"] for g in fopt.param_groups] == [1e-2, 5e-3, 1e-3]


def test_state_is_keyed_by_fqn_not_position(tmp_path):
    """Load into an optimizer that lists the same parameters in another order: each gets its own moments."""
    model = make_tiny(1)
    opt = O.AdamW(list(model.parameters()), lr=1e-2)
    train(model, opt, None, batches(2))
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "fqn")
    fresh = make_tiny(2)
    fopt = O.AdamW(list(reversed(list(fresh.parameters()))), lr=1e-2)
    fastckpt.load_state(fresh, fopt, input_dir=ckpt)
    saved = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert_tensor_identical(fopt.state[p][key], opt.state[saved[name]][key], f"{name}.{key}")


def test_optimizer_saved_before_any_step(tmp_path):
    model = make_tiny(1)
    opt = O.Adam(model.parameters(), lr=3e-3)
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "nostep")
    assert official.load_file(ckpt / "optimizer.safetensors") == {}
    fresh = make_tiny(2)
    fopt = O.Adam(fresh.parameters(), lr=1.0)
    fastckpt.load_state(fresh, fopt, input_dir=ckpt)
    assert len(fopt.state) == 0
    assert fopt.param_groups[0]["lr"] == 3e-3
    assert_nested_equal(fopt.state_dict(), opt.state_dict())


def test_float_lr_kept_exactly(tmp_path):
    """A float lr that is not a short decimal survives exactly (no JSON rounding)."""
    model = make_tiny(1)
    lr = 1 / 3 * 1e-2
    opt = O.SGD(model.parameters(), lr=lr, momentum=0.9)
    train(model, opt, None, batches(1))
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "lr")
    fresh = make_tiny(2)
    fopt = O.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    fastckpt.load_state(fresh, fopt, input_dir=ckpt)
    assert fopt.param_groups[0]["lr"] == lr


# --------------------------------------------------------------------------------------------------------------
# C20: map_location
# --------------------------------------------------------------------------------------------------------------


def _placement(opt) -> dict:
    return {
        (i, name): (v.device, v.dtype, tuple(v.shape)) if torch.is_tensor(v) else type(v)
        for i, state in enumerate(opt.state.values())
        for name, v in state.items()
    }


@pytest.mark.parametrize("map_location", ["cpu", torch.device("cpu"), None])
def test_c20_adam_state_where_a_fresh_adam_puts_it(tmp_path, map_location):
    model = make_tiny(1)
    opt = O.Adam(model.parameters(), lr=1e-2)
    train(model, opt, None, batches(2))
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "c20")
    later = batches(2, seed=8)
    train(model, opt, None, later)
    expected = model_clone(model)

    reference = make_tiny(3)  # where a fresh Adam of this kind keeps step and moments
    ref_opt = O.Adam(reference.parameters(), lr=1e-2)
    train(reference, ref_opt, None, batches(1))

    fresh = make_tiny(2)
    fopt = O.Adam(fresh.parameters(), lr=1e-2)
    fastckpt.load_state(fresh, fopt, input_dir=ckpt, map_location=map_location)
    assert _placement(fopt) == _placement(ref_opt)
    for p in fresh.parameters():
        assert fopt.state[p]["step"].device == torch.device("cpu")
        assert fopt.state[p]["step"].dtype == torch.float32 and fopt.state[p]["step"].shape == ()
        assert float(fopt.state[p]["step"]) == 2.0
    train(fresh, fopt, None, later)  # the next step runs, and equals the uninterrupted run
    assert_model_state(fresh, expected)


@requires_cuda
def test_c20_cuda_adam_loaded_with_cpu_map_location(tmp_path):
    model = make_tiny(1).cuda()
    opt = O.Adam(model.parameters(), lr=1e-2)
    data = [(x.cuda(), y.cuda()) for x, y in batches(2)]
    train(model, opt, None, data)
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "c20cuda")
    reference = make_tiny(3).cuda()
    ref_opt = O.Adam(reference.parameters(), lr=1e-2)
    train(reference, ref_opt, None, data[:1])

    fresh = make_tiny(2).cuda()
    fopt = O.Adam(fresh.parameters(), lr=1e-2)
    fastckpt.load_state(fresh, fopt, input_dir=ckpt, map_location="cpu")
    assert _placement(fopt) == _placement(ref_opt)
    assert all(v.is_cuda for v in fresh.state_dict().values())
    later = [(x.cuda(), y.cuda()) for x, y in batches(1, seed=8)]
    train(fresh, fopt, None, later)
    train(model, opt, None, later)
    assert_model_state(fresh, model_clone(model))


@requires_cuda
def test_model_on_cuda_loads_cpu_checkpoint_onto_its_device(tmp_path):
    """map_location=None: tensors go to the device of the object they are loaded into."""
    model = make_tiny(1)
    ckpt = fastckpt.save_state(model, output_dir=tmp_path / "cpu_ckpt", model_only=True)
    fresh = make_tiny(2).cuda()
    fastckpt.load_state(fresh, input_dir=ckpt)
    for k, v in fresh.state_dict().items():
        assert v.is_cuda, k
        assert_tensor_identical(v.cpu(), model.state_dict()[k], k)


# --------------------------------------------------------------------------------------------------------------
# C26: param_groups that do not cover a live parameter
# --------------------------------------------------------------------------------------------------------------


def _partial_checkpoint(tmp_path):
    model = make_tiny(1)
    opt = O.AdamW(model.fc1.parameters(), lr=1e-2)  # fc1 only: bn and fc2 are in no saved param group
    train(model, opt, None, batches(2))
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "partial")
    return model, opt, ckpt


def test_c26_strict_load_names_the_uncovered_param_and_changes_nothing(tmp_path):
    model, opt, ckpt = _partial_checkpoint(tmp_path)
    fresh = make_tiny(2)
    fopt = O.AdamW(fresh.parameters(), lr=1e-2)
    train(fresh, fopt, None, batches(1, seed=3))
    weights_before, opt_before = model_clone(fresh), copy.deepcopy(fopt.state_dict())
    with pytest.raises(fastckpt.KeyMismatchError) as info:
        fastckpt.load_state(fresh, fopt, input_dir=ckpt, strict=True)
    assert "fc2.weight" in str(info.value)
    assert "bn.weight" in str(info.value)
    assert_model_state(fresh, weights_before)
    assert_nested_equal(fopt.state_dict(), opt_before)


def test_c26_non_strict_uncovered_param_starts_fresh(tmp_path):
    model, opt, ckpt = _partial_checkpoint(tmp_path)
    fresh = make_tiny(2)
    fopt = O.AdamW(fresh.parameters(), lr=1e-2)
    fastckpt.load_state(fresh, fopt, input_dir=ckpt, strict=False)
    assert_model_state(fresh, model_clone(model))
    for name in ("fc1.weight", "fc1.bias"):
        p_saved, p_fresh = dict(model.named_parameters())[name], dict(fresh.named_parameters())[name]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert_tensor_identical(fopt.state[p_fresh][key], opt.state[p_saved][key], f"{name}.{key}")
    for name in ("bn.weight", "bn.bias", "fc2.weight", "fc2.bias"):
        assert len(fopt.state[dict(fresh.named_parameters())[name]]) == 0, name
    train(fresh, fopt, None, batches(1, seed=4))  # the next step runs; the uncovered params start at step 1
    assert float(fopt.state[fresh.fc2.weight]["step"]) == 1.0
    assert float(fopt.state[fresh.fc1.weight]["step"]) == 3.0


def test_c26_param_without_state_yet_is_not_uncovered(tmp_path):
    """Optimizers create state lazily: a covered parameter that never had a gradient loads fine under strict."""
    model = make_tiny(1)
    opt = O.AdamW(model.parameters(), lr=1e-2)
    model.fc2.bias.requires_grad_(False)  # never gets a gradient, so never gets state
    train(model, opt, None, batches(2))
    model.fc2.bias.requires_grad_(True)
    assert len(opt.state[model.fc2.bias]) == 0
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "lazy")
    saved = copy.deepcopy(opt.state_dict())
    fresh = make_tiny(2)
    fopt = O.AdamW(fresh.parameters(), lr=1e-2)
    result = fastckpt.load_state(fresh, fopt, input_dir=ckpt, strict=True)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert len(fopt.state[fresh.fc2.bias]) == 0
    assert_nested_equal(fopt.state_dict(), saved)


def _trained_then_frozen(tmp_path):
    """make_tiny trained 2 AdamW steps over every parameter and saved; then a fresh model with ``fc1`` frozen."""
    model = make_tiny(1)
    opt = O.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, None, batches(2))
    ckpt = fastckpt.save_state(model, opt, output_dir=tmp_path / "all")
    fresh = make_tiny(2)
    fresh.fc1.requires_grad_(False)
    return model, opt, ckpt, fresh


def test_c31_frozen_at_load_but_still_in_the_optimizer_gets_its_state_exactly(tmp_path):
    model, opt, ckpt, fresh = _trained_then_frozen(tmp_path)
    fopt = O.AdamW(fresh.parameters(), lr=1e-2)  # the frozen fc1 stays in the optimizer's groups
    result = fastckpt.load_state(fresh, fopt, input_dir=ckpt)
    assert (result.missing_keys, result.unexpected_keys, result.skipped) == ([], [], [])
    assert_nested_equal(fopt.state_dict(), opt.state_dict())


def test_strict_false_lists_the_dropped_state_of_parameters_frozen_since(tmp_path):
    """Issue 27.3 (composer#1002): resumed with more layers frozen and an optimizer over the trainable ones only,
    the saved state of the frozen parameters cannot be applied: strict refuses, strict=False applies the rest and
    ``LoadResult.skipped`` names each dropped parameter and its state."""
    model, opt, ckpt, fresh = _trained_then_frozen(tmp_path)
    fopt = O.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    with pytest.raises(fastckpt.KeyMismatchError, match=r"fc1\.weight"):
        fastckpt.load_state(fresh, fopt, input_dir=ckpt)
    result = fastckpt.load_state(fresh, fopt, input_dir=ckpt, strict=False)
    where = ckpt / "optimizer.safetensors"
    assert result.skipped == [
        f"{where}: optimizer state of '{name}' (step, exp_avg, exp_avg_sq) not applied: the live optimizer does not "
        "optimize that parameter (frozen since the save, or left out of its param_groups)"
        for name in ("fc1.weight", "fc1.bias")]
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    saved = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        if p.requires_grad:
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert_tensor_identical(fopt.state[p][key], opt.state[saved[name]][key], f"{name}.{key}")
    fresh_all = make_tiny(2)
    all_opt = O.AdamW(fresh_all.parameters(), lr=1e-2)
    assert fastckpt.load_state(fresh_all, all_opt, input_dir=ckpt, strict=False).skipped == []  # nothing dropped

"""``fastckpt.torch.save_model`` / ``load_model`` against the official ones: tied weights stored once and re-tied
(C1), strided parameters gathered in row-major order without touching the live ones (C3), the same
``(missing, unexpected)`` as the official loader.
"""

from __future__ import annotations

import safetensors.torch as official
import torch
from helpers.common import (
    TiedNet,
    assert_tensor_dicts_identical,
    assert_tensor_identical,
    read_split,
)
from torch import nn

import fastckpt.torch as ft

# --------------------------------------------------------------------------------------------------------------
# save_model / load_model (C1 tied weights, C3 strided views)
# --------------------------------------------------------------------------------------------------------------


def test_c1_tied_weights_save_model_one_copy_and_tie_holds(tmp_path):
    torch.manual_seed(1)
    model = TiedNet()
    path, ref = tmp_path / "ours.safetensors", tmp_path / "official.safetensors"
    ft.save_model(model, path)
    official.save_model(model, ref)
    assert path.read_bytes() == ref.read_bytes()  # one metadata key (the alias): byte identical
    _, _, header, data = read_split(path)
    assert [k for k in header if k != "__metadata__"] == ["emb.weight"]
    assert header["__metadata__"] == {"head.weight": "emb.weight"}
    assert len(data) == 10 * 4 * 4  # one copy

    torch.manual_seed(2)
    fresh = TiedNet()
    missing, unexpected = ft.load_model(fresh, path)
    assert list(missing) == [] and list(unexpected) == []
    assert fresh.head.weight is fresh.emb.weight
    assert fresh.head.weight.data_ptr() == fresh.emb.weight.data_ptr()
    assert_tensor_identical(fresh.emb.weight.detach(), model.emb.weight.detach())
    with torch.no_grad():
        fresh.emb.weight.add_(1.0)
    assert torch.equal(fresh.head.weight, fresh.emb.weight)  # still one storage after an update


def test_load_model_returns_same_missing_and_unexpected_as_official(tmp_path):
    class A(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(2, 2)
            self.extra = nn.Linear(2, 1)

    class B(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(2, 2)
            self.other = nn.Linear(1, 1)

    path = tmp_path / "a.safetensors"
    official.save_model(A(), path)
    ours_model, their_model = B(), B()
    ours = ft.load_model(ours_model, path, strict=False)
    theirs = official.load_model(their_model, path, strict=False)
    assert len(ours) == 2
    assert sorted(ours[0]) == sorted(theirs[0]) == ["other.bias", "other.weight"]
    assert sorted(ours[1]) == sorted(theirs[1]) == ["extra.bias", "extra.weight"]
    assert_tensor_dicts_identical(dict(ours_model.shared.state_dict()), dict(their_model.shared.state_dict()))


def test_c3_strided_params_save_model_row_major_and_live_params_untouched(tmp_path):
    torch.manual_seed(3)
    model = nn.Module()
    model.lin = nn.Linear(6, 4)
    model.lin.weight = nn.Parameter(torch.randn(4, 6).t())  # (6, 4) transposed view, not contiguous
    model.conv = nn.Conv2d(3, 5, 3).to(memory_format=torch.channels_last)
    assert not model.lin.weight.is_contiguous() and not model.conv.weight.is_contiguous()
    before = {k: (v.detach().clone(), v.stride(), v.data_ptr()) for k, v in model.state_dict().items()}

    path, ref = tmp_path / "ours.safetensors", tmp_path / "official.safetensors"
    ft.save_model(model, path)
    official.save_model(model, ref)  # force_contiguous=True: the official writer stores row-major bytes
    assert path.read_bytes() == ref.read_bytes()

    for k, v in model.state_dict().items():
        clone, stride, ptr = before[k]
        assert v.stride() == stride and v.data_ptr() == ptr, k
        assert_tensor_identical(v, clone, k)
    loaded = ft.load_file(path)
    for k, (clone, _, _) in before.items():
        assert_tensor_identical(loaded[k], clone.contiguous(), k)
        assert loaded[k].is_contiguous()


def test_c1_tied_file_loads_into_an_untied_model(tmp_path):
    """The alias recorded in the metadata fills the dropped name (safetensors' load_model does the same)."""

    class Untied(TiedNet):
        def __init__(self):
            super().__init__()
            self.head.weight = nn.Parameter(torch.zeros(10, 4))

    torch.manual_seed(1)
    tied = TiedNet()
    path = tmp_path / "tied.safetensors"
    ft.save_model(tied, path)
    untied = Untied()
    missing, unexpected = ft.load_model(untied, path)
    assert list(missing) == [] and list(unexpected) == []
    assert_tensor_identical(untied.head.weight.detach(), tied.emb.weight.detach())
    assert_tensor_identical(untied.emb.weight.detach(), tied.emb.weight.detach())

"""fp16 / bf16 models loading an fp32 checkpoint (issue 12, item 8): refused by default with a DtypeError that names
``cast=True``, under ``strict=False`` too; with ``cast=True`` every tensor is cast exactly as torch's
``load_state_dict`` casts it (``copy_``), in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastckpt


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    m.register_buffer("steps", torch.tensor([3, 4]))  # int64: stays int64 on .to(dtype)
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_checkpoint_into_a_half_model(tmp_path, dtype):
    saved = _model()
    ckpt = fastckpt.save_state(saved, output_dir=tmp_path / "c", model_only=True)
    half = _model(dtype)
    with torch.no_grad():
        for p in half.parameters():
            p.zero_()
    for strict in (True, False):
        with pytest.raises(fastckpt.DtypeError, match=r"cast=True"):
            fastckpt.load_state(half, input_dir=ckpt, model_only=True, strict=strict)
    assert all(torch.count_nonzero(p) == 0 for p in half.parameters())
    reference = _model(dtype)
    reference.load_state_dict(saved.state_dict())  # torch's own cast
    weight = half[0].weight
    fastckpt.load_state(half, input_dir=ckpt, model_only=True, cast=True)
    assert half[0].weight is weight and weight.dtype == dtype
    for (name, a), b in zip(half.state_dict().items(), reference.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_cast_of_a_full_checkpoint_through_the_optimizer_path(tmp_path):
    saved = _model()
    opt = torch.optim.SGD(saved.parameters(), lr=0.1)
    ckpt = fastckpt.save_state(saved, opt, output_dir=tmp_path / "c")
    half = _model(torch.bfloat16)
    fastckpt.load_state(half, torch.optim.SGD(half.parameters(), lr=0.1), input_dir=ckpt, cast=True)
    assert torch.equal(half[1].bias, saved[1].bias.to(torch.bfloat16))

"""The private torch helpers fastckpt uses have fallbacks of its own, and the fallbacks give what torch's give:
DCP's ``_traverse.set_element`` (the reader puts non-tensor values back into nested state_dicts) and
``torch._debug_has_internal_overlap`` (a load refuses destinations whose elements share memory)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastckpt._state.destinations import has_internal_overlap
from fastckpt.dcp.traverse import set_element

ROOT = Path(__file__).resolve().parents[2]

# (starting state_dict, path, value): new keys, nested dicts and lists made on the way, lists padded, overwrites
CASES = [
    ({}, ("a",), 1),
    ({}, ("optim", "param_groups", 0, "lr"), 0.1),
    ({"optim": {"param_groups": [{"lr": 0.1}]}}, ("optim", "param_groups", 2, "lr"), 0.3),
    ({"optim": {"param_groups": [{"lr": 0.1}]}}, ("optim", "param_groups", 0, "betas"), (0.9, 0.99)),
    ({}, ("x", 3), "s"),
    ({"x": [None, [1]]}, ("x", 0, 1), 7),
    ({"x": [None, [1]]}, ("x", 1, 0), 8),
    ({"x": {"y": 1}}, ("x", "y"), {"z": [1, 2]}),
    ({}, ("m", 0, 0, "k"), None),
]


@pytest.mark.parametrize(("start", "path", "value"), CASES)
def test_fallback_set_element_matches_dcps(start, path, value):
    traverse = pytest.importorskip("torch.distributed.checkpoint._traverse")
    ours, theirs = copy.deepcopy(start), copy.deepcopy(start)
    set_element(ours, path, value)
    traverse.set_element(theirs, path, value)
    assert ours == theirs
    assert type(ours) is type(theirs) and repr(ours) == repr(theirs)  # lists stay lists, tuples tuples


def test_fallback_set_element_refuses_an_empty_path():
    with pytest.raises(ValueError, match="empty object path"):
        set_element({}, (), 1)


BLOCKED = """
import sys
import torch.distributed.checkpoint._traverse as traverse   # DCP itself imports it; as if this torch had no
del traverse.set_element                                      # set_element there: the import in boxes.py fails
sys.path.insert(0, sys.argv[2])
import warnings
warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
import fastckpt.dcp, fastckpt.dcp.boxes, fastckpt.dcp.traverse
from helpers.dcp_state import full_state, mismatches, template
assert fastckpt.dcp.boxes.set_element is fastckpt.dcp.traverse.set_element, fastckpt.dcp.boxes.set_element
state = full_state()
import torch
# lists holding tensors are walked by DCP's flattening, so the plain values in them come back through set_element
# at paths with list indices: ("nested", "groups", 1, "betas")
state["nested"] = {"groups": [{"lr": 0.5, "w": torch.arange(3.0)}, {"betas": (0.9, 0.95), "w": torch.ones(2)}],
                   "step": 7}
fastckpt.dcp.save(state, sys.argv[1])
got = template(state)
got["nested"] = {"groups": [{"lr": 0.0, "w": torch.zeros(3)}, {"betas": None, "w": torch.zeros(2)}], "step": 0}
fastckpt.dcp.load(got, sys.argv[1])
assert mismatches(state, got) == [], mismatches(state, got)
g = got["nested"]["groups"]
assert (g[0]["lr"], g[1]["betas"], got["nested"]["step"]) == (0.5, (0.9, 0.95), 7), got["nested"]
assert torch.equal(g[0]["w"], torch.arange(3.0)) and torch.equal(g[1]["w"], torch.ones(2))
print("fallback ok")
"""


def test_dcp_load_of_nested_values_without_torchs_private_traverse(tmp_path):
    out = subprocess.run([sys.executable, "-c", BLOCKED, str(tmp_path / "ckpt"), str(ROOT / "tests")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("fallback ok")


def _layouts() -> dict[str, torch.Tensor]:
    base = torch.arange(24.0)
    return {
        "contiguous": base.view(4, 6),
        "transposed": base.view(4, 6).t(),
        "channels_last": torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "sliced": base.view(4, 6)[:, ::2],
        "expanded": torch.zeros(1, 4).expand(3, 4),
        "overlapping_as_strided": base.as_strided((3, 4), (2, 1)),
        "stride_zero_inner": base.as_strided((4, 3), (6, 0)),
    }


def test_overlap_check_without_torchs_private_probe_agrees_with_it(monkeypatch):
    layouts = _layouts()
    with_probe = {name: has_internal_overlap(t) for name, t in layouts.items()}
    monkeypatch.delattr(torch, "_debug_has_internal_overlap")
    without = {name: has_internal_overlap(t) for name, t in layouts.items()}
    assert without == with_probe
    assert without == {"contiguous": False, "transposed": False, "channels_last": False, "sliced": False,
                       "expanded": True, "overlapping_as_strided": True, "stride_zero_inner": True}


def test_no_dist_is_passed_only_to_a_dcp_call_that_takes_it():
    import torch.distributed.checkpoint as dcp

    from fastckpt._io.group.torch_compat import no_dist_kwargs

    def old_save(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None, process_group=None):
        """dcp.save's signature in torch 2.6"""

    assert no_dist_kwargs(old_save, True) == {}
    assert no_dist_kwargs(lambda state_dict, *, no_dist=False: None, True) == {"no_dist": True}
    expected = {"no_dist": False} if "no_dist" in __import__("inspect").signature(dcp.save).parameters else {}
    assert no_dist_kwargs(dcp.save, False) == expected

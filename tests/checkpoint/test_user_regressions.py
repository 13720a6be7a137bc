"""Regressions found by a new user's hostile session: each refuses bad input before anything on disk or in
memory changes, with the right exception type."""

from __future__ import annotations

import os

import pytest
import torch

import fastckpt
from fastckpt.torch import save_file


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _full(tmp_path, seed=0):
    m = _net(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(1, 4)).sum().backward()
    opt.step()
    return m, opt, fastckpt.save_state(m, opt, output_dir=tmp_path / f"full{seed}")


def test_output_dir_that_is_a_file_is_refused_and_kept(tmp_path):
    precious = tmp_path / "afile"
    precious.write_text("precious")
    with pytest.raises(NotADirectoryError):
        fastckpt.save_state(_net(), output_dir=precious, model_only=True)
    assert precious.read_text() == "precious"


@pytest.mark.parametrize("where", [".", "..", "cwd"])
def test_output_dir_holding_the_working_directory_is_refused(tmp_path, monkeypatch, where):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("hi")
    monkeypatch.chdir(work)
    with pytest.raises(ValueError, match="contains the current working directory"):
        fastckpt.save_state(_net(), output_dir=os.getcwd() if where == "cwd" else where, model_only=True)
    assert os.getcwd() == str(work) and (work / "notes.txt").read_text() == "hi"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_empty_output_dir_is_refused(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        fastckpt.save_state(_net(), output_dir="", model_only=True)


def test_empty_project_dir_is_refused_not_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for call in (lambda: fastckpt.save_state(_net(), project_dir="", model_only=True),
                 lambda: fastckpt.load_state(_net(), project_dir="", model_only=True)):
        with pytest.raises(ValueError, match="project_dir is an empty path"):
            call()
    assert list(tmp_path.iterdir()) == []  # nothing written where the process runs


def test_symlinked_output_dir_keeps_the_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "latest"
    link.symlink_to(real)
    m = _net(3)
    fastckpt.save_state(m, output_dir=link, model_only=True)
    assert link.is_symlink() and os.readlink(link) == str(real)
    fresh = _net(4)
    fastckpt.load_state(fresh, input_dir=real, model_only=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), m.state_dict().values()))


def test_meta_model_load_is_refused(tmp_path):
    _, _, path = _full(tmp_path)
    with torch.device("meta"):
        m = _net()
    with pytest.raises(ValueError, match="meta device"):
        fastckpt.load_state(m, input_dir=path, model_only=True)


def test_bad_map_location_is_refused_before_any_weight_changes(tmp_path):
    _, _, path = _full(tmp_path)
    m = _net(9)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    before = [t.clone() for t in m.state_dict().values()]
    for bad in ("meta", "bogus"):
        with pytest.raises(ValueError, match="map_location"):
            fastckpt.load_state(m, opt, input_dir=path, map_location=bad)
    assert all(torch.equal(a, b) for a, b in zip(before, m.state_dict().values()))


def test_model_only_load_survives_pruned_optimizer_files(tmp_path):
    m, _, path = _full(tmp_path)
    (path / "optimizer.safetensors").unlink()
    (path / "random_states_0.safetensors").write_bytes(b"damaged")
    fresh = _net(5)
    fastckpt.load_state(fresh, input_dir=path, model_only=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), m.state_dict().values()))
    with pytest.raises(fastckpt.IntegrityError, match="optimizer.safetensors"):
        fastckpt.load_state(_net(6), torch.optim.AdamW(_net(6).parameters()), input_dir=path)


def test_bad_total_limit_is_refused_before_saving(tmp_path):
    for bad in (0, -1):
        with pytest.raises(ValueError, match="total_limit"):
            fastckpt.save_state(_net(), project_dir=tmp_path, total_limit=bad, model_only=True)
    assert not (tmp_path / "checkpoints").exists()


def test_optimizer_of_another_class_or_group_layout_is_refused_when_strict(tmp_path):
    _, _, path = _full(tmp_path)
    m = _net(7)
    before = [t.clone() for t in m.state_dict().values()]
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(fastckpt.KeyMismatchError, match="AdamW"):
        fastckpt.load_state(m, sgd, input_dir=path)
    two_groups = torch.optim.AdamW([{"params": m[0].parameters()}, {"params": m[1].parameters(), "lr": 1.0}])
    with pytest.raises(fastckpt.KeyMismatchError, match="1 param_groups were saved"):
        fastckpt.load_state(m, two_groups, input_dir=path)
    assert all(torch.equal(a, b) for a, b in zip(before, m.state_dict().values()))


@pytest.mark.parametrize(("kwargs", "exc"), [
    ({"threads": -1}, ValueError),
    ({"step": -1}, ValueError),
    ({"step": 2**70}, ValueError),
    ({"step": "abc"}, ValueError),
])
def test_bad_save_arguments_are_refused(tmp_path, kwargs, exc):
    with pytest.raises(exc):
        fastckpt.save_state(_net(), output_dir=tmp_path / "c", **kwargs)
    assert not (tmp_path / "c").exists()


def test_wrong_object_kinds_are_named(tmp_path):
    m = _net()
    with pytest.raises(TypeError, match=r"optimizer\[0\] is a str.*input_dir="):
        fastckpt.save_state(m, str(tmp_path))
    with pytest.raises(TypeError, match=r"model\[0\] is a AdamW"):
        fastckpt.save_state(torch.optim.AdamW(m.parameters()), output_dir=tmp_path / "x")
    with pytest.raises(TypeError, match="model is None"):
        fastckpt.save_state(None, output_dir=tmp_path / "y")
    with pytest.raises(TypeError, match=r"scheduler\[0\] is a AdamW"):
        fastckpt.save_state(m, None, torch.optim.AdamW(m.parameters()), output_dir=tmp_path / "z")


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_and_bad_metadata_key_messages(tmp_path):
    q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    with pytest.raises(ValueError, match="quantized"):
        save_file({"q": q}, tmp_path / "q.safetensors")
    with pytest.raises(TypeError, match="metadata keys must be str: got int 1"):
        save_file({"a": torch.ones(1)}, tmp_path / "m.safetensors", metadata={1: "v"})


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_data_parallel_wrapper_is_saved_under_the_plain_names_and_loads_either_way(tmp_path):
    # DDP / DataParallel prefix every key with ``module.``: saved as accelerate's unwrap_model does, so a resume
    # on one process (no wrapper) and from_pretrained read the same folder (a new user's 2-process DDP run)
    from safetensors.torch import load_file

    model = _net(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    wrapped = torch.nn.DataParallel(model)  # what DDP does to the names, on a CPU-only machine
    folder = fastckpt.save_state(wrapped, opt, output_dir=tmp_path / "ckpt")
    assert sorted(load_file(folder / "model.safetensors")) == sorted(model.state_dict())
    plain, plain_opt = _net(2), None
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    assert fastckpt.load_state(plain, plain_opt, input_dir=folder) == ([], [])
    assert _state_equal(plain, model)
    for (_, a), (_, b) in zip(sorted(opt.state_dict()["state"].items()), sorted(plain_opt.state_dict()["state"].items())):
        assert all(torch.equal(a[k], b[k]) for k in a)
    again = torch.nn.DataParallel(_net(3))
    assert fastckpt.load_state(again, input_dir=folder, model_only=True) == ([], [])
    assert _state_equal(again.module, model)


def test_a_model_file_saved_with_the_module_prefix_loads_into_the_bare_model(tmp_path):
    # a checkpoint an earlier version saved from the wrapper: every model key ``module.*``
    from safetensors.torch import load_file

    model = _net(4)
    holder = torch.nn.Module()
    holder.add_module("module", model)  # the names a wrapper's state_dict has, without being one
    folder = fastckpt.save_state(holder, model_only=True, output_dir=tmp_path / "prefixed")
    assert sorted(load_file(folder / "model.safetensors")) == sorted(f"module.{k}" for k in model.state_dict())
    fresh = _net(5)
    assert fastckpt.load_state(fresh, input_dir=folder, model_only=True) == ([], [])
    assert _state_equal(fresh, model)


def test_a_path_under_a_file_is_refused_naming_the_file(tmp_path):
    precious = tmp_path / "afile"
    precious.write_text("precious")
    with pytest.raises(NotADirectoryError, match="lies under a file") as info:
        fastckpt.save_state(_net(), output_dir=precious / "sub", model_only=True)
    assert info.value.filename == str(precious)
    with pytest.raises(NotADirectoryError, match="^.*path .* lies under a file"):
        fastckpt.save({"w": torch.ones(2)}, precious / "sub" / "deeper")
    with pytest.raises(NotADirectoryError, match="path exists and is not a folder"):  # fastckpt.save's argument
        fastckpt.save({"w": torch.ones(2)}, precious)
    assert precious.read_text() == "precious"

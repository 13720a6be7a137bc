"""Integrity: the crc32c checksums recorded in the manifest while writing are exact (against a pure-Python
reference), do not depend on threads or chunking, and ``load_state(verify=True)``, ``verify_checkpoint`` and
``fastckpt verify`` find damage (a flipped bit in a tensor, in a header, in a JSON file; a truncated or missing
file), name the file and the tensor with both values, and change nothing. ``fastckpt inspect`` shows what a
checkpoint holds. Damaged copies are made beside a committed checkpoint, which still loads bit-exact afterwards."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers.common import (
    assert_calls_overlap,
    assert_model_state,
    batches,
    make_training_state,
    model_clone,
    read_split,
    tensor_order,
    train,
)
from helpers.crc32c_ref import crc32c, crc32c_hex
from helpers.fault_log import record

import fastckpt
from fastckpt import _core
from fastckpt.cli import main as cli


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A committed full checkpoint and the model state it holds."""
    model, opt, sched = make_training_state(seed=21)
    train(model, opt, sched, batches(2))
    ckpt = fastckpt.save_state(model, opt, sched, output_dir=tmp_path_factory.mktemp("integrity") / "good")
    return ckpt, model_clone(model)


@pytest.fixture
def copy(good, tmp_path):
    """A copy of the good checkpoint to damage; afterwards the original still loads bit-exact."""
    ckpt, state = good
    yield shutil.copytree(ckpt, tmp_path / "copy")
    fresh, fopt, fsched = make_training_state(seed=99)
    fastckpt.load_state(fresh, fopt, fsched, input_dir=ckpt, verify=True)
    assert_model_state(fresh, state)


def _manifest(folder):
    return json.loads((folder / "fastckpt.json").read_text())


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _tensor_offset(path, name: str) -> int:
    n, _, header, _ = read_split(path)
    return 8 + n + header[name]["data_offsets"][0]


def test_recorded_checksums_equal_a_reference_crc32c_of_every_file_and_tensor(good):
    ckpt, _ = good
    files = _manifest(ckpt)["files"]
    assert sorted(files) == ["model.safetensors", "optimizer.safetensors", "random_states_0.safetensors",
                             "scheduler.json"]
    for name, info in files.items():
        data = (ckpt / name).read_bytes()
        assert info["bytes"] == len(data)
        assert info["crc32c"] == crc32c_hex(data), name
        if name.endswith(".safetensors"):
            n, _, header, body = read_split(ckpt / name)
            want = {t: crc32c_hex(body[header[t]["data_offsets"][0]:header[t]["data_offsets"][1]])
                    for t in tensor_order(header)}
            assert info["tensors"] == want, name
            assert list(info["tensors"]) == tensor_order(header), "recorded in file order"
        else:
            assert "tensors" not in info
    report = fastckpt.verify_checkpoint(ckpt)
    assert report.ok and set(report.files.values()) == {"ok"}
    assert report.tensors_checked == sum(len(i.get("tensors", {})) for i in files.values())
    assert report.bytes_checked == sum(i["bytes"] for i in files.values())


def test_checksums_do_not_depend_on_threads_or_chunks(tmp_path):
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, 300_001, dtype=np.uint8)
    m = rng.integers(0, 256, (64, 48), dtype=np.uint8).view(np.float32)  # 64 x 12 float32
    sources = [("a", "U8", [a.size], a, 0, None), ("t", "F32", [12, 64], m.view(np.uint8), 0, [4, 48]),
               ("z", "F16", [0], b"", 0, None)]
    digests = set()
    for threads, chunk in [(1, 8 << 20), (2, 7), (4, 4096), (3, 100_003)]:
        ((size, crc, tensors, hashes),) = _core.write_files_checked([(tmp_path / "f.safetensors", sources, None)],
                                                                    threads=threads, chunk_bytes=chunk, durable=False)
        digests.add((size, crc, tuple(tensors), tuple(hashes)))
    assert len(digests) == 1
    ((size, crc, tensors, hashes),) = digests
    assert [h for _, h in hashes] == _core.hash_tensors(sorted(sources, key=lambda s: [n for n, _ in tensors].index(s[0])))
    assert _core.hash_files([str(tmp_path / "f.safetensors")]) == [(list(hashes), None)]
    data = (tmp_path / "f.safetensors").read_bytes()
    assert (size, crc) == (len(data), crc32c(data))
    _, _, header, body = read_split(tmp_path / "f.safetensors")
    b, e = header["t"]["data_offsets"]
    assert body[b:e] == np.ascontiguousarray(m.T).tobytes()
    assert dict(tensors) == {"a": crc32c(a.tobytes()), "t": crc32c(body[b:e]), "z": 0}
    assert [name for name, _ in tensors] == tensor_order(header)
    assert _core.checksum_files([str(tmp_path / "f.safetensors")], threads=2, chunk_bytes=1000) == \
        [(size, crc, list(tensors), None)]
    assert _core.crc32c(b"123456789") == 0xE3069283 == crc32c(b"123456789")
    assert _core.crc32c(b"6789", _core.crc32c(b"12345")) == 0xE3069283


def test_verify_names_the_damaged_tensor_and_load_changes_nothing(copy, capsys):
    path = copy / "model.safetensors"
    want = _manifest(copy)["files"]["model.safetensors"]["tensors"]["fc2.weight"]
    _flip(path, _tensor_offset(path, "fc2.weight") + 5)
    got = crc32c_hex(read_split(path)[3][read_split(path)[2]["fc2.weight"]["data_offsets"][0]:
                                       read_split(path)[2]["fc2.weight"]["data_offsets"][1]])
    live, lopt, lsched = make_training_state(seed=3)
    before = model_clone(live)
    with pytest.raises(fastckpt.IntegrityError) as info:
        fastckpt.load_state(live, lopt, lsched, input_dir=copy, verify=True)
    assert str(info.value) == (f"{path}: tensor \"fc2.weight\": crc32c {got} read, {want} recorded in fastckpt.json "
                               "(the file is damaged)")
    assert isinstance(info.value, ValueError)
    assert_model_state(live, before)
    assert lopt.state_dict()["state"] == {}
    assert cli(["verify", str(copy)]) == 1
    out, err = capsys.readouterr()
    assert "BAD  model.safetensors" in out and "ok   scheduler.json" in out and "DAMAGED: 1 problem(s)" in out
    msg = (f"{copy}: 1 integrity problem:\n  {path}: tensor 'fc2.weight': crc32c {got} on disk, {want} "
           "recorded in fastckpt.json")
    assert f"IntegrityError: {msg}" in err
    record("faults")


@pytest.mark.parametrize("where", ["header", "scheduler.json", "truncated", "missing", "two_tensors"])
def test_verify_finds_every_kind_of_damage(copy, where):
    model = copy / "model.safetensors"
    size = model.stat().st_size
    if where == "header":  # a byte of the JSON header that keeps it valid: "pt" -> "pu"
        data = model.read_bytes()
        _flip(model, data.index(b'"pt"') + 2)
        expected = [f"{model}: crc32c {crc32c_hex(model.read_bytes())} on disk, "
                    f"{_manifest(copy)['files']['model.safetensors']['crc32c']} recorded in fastckpt.json "
                    "(outside every tensor: the header or its padding)"]
    elif where == "scheduler.json":
        _flip(copy / "scheduler.json", 3)
        expected = [f"{copy / 'scheduler.json'}: crc32c {crc32c_hex((copy / 'scheduler.json').read_bytes())} on disk, "
                    f"{_manifest(copy)['files']['scheduler.json']['crc32c']} recorded in fastckpt.json"]
    elif where == "truncated":  # C16 inside a checkpoint
        with open(model, "r+b") as f:
            f.truncate(size - 3)
        expected = [f"{model}: {size - 3} bytes on disk, {size} recorded in fastckpt.json",
                    f"{model}: its header is damaged, so no tensor can be checked: {model}: truncated safetensors "
                    f"file: the data section needs {size} bytes, found {size - 3}"]
    elif where == "missing":
        (copy / "optimizer.safetensors").unlink()
        info = _manifest(copy)["files"]["optimizer.safetensors"]
        expected = [f"{copy / 'optimizer.safetensors'}: listed in fastckpt.json ({info['bytes']} bytes) but missing"]
    else:  # two tensors of one file: both named, in file order
        _flip(model, _tensor_offset(model, "fc1.bias"))
        _flip(model, _tensor_offset(model, "bn.running_var") + 1)
        _, _, header, body = read_split(model)
        recorded = _manifest(copy)["files"]["model.safetensors"]["tensors"]
        expected = [f"{model}: tensor {t!r}: crc32c "
                    f"{crc32c_hex(body[header[t]['data_offsets'][0]:header[t]['data_offsets'][1]])} on disk, "
                    f"{recorded[t]} recorded in fastckpt.json"
                    for t in tensor_order(header) if t in ("fc1.bias", "bn.running_var")]
    report = fastckpt.check_checkpoint(copy, threads=2)
    assert report.problems == expected
    with pytest.raises(fastckpt.IntegrityError):
        fastckpt.verify_checkpoint(copy)
    record("faults")


def test_checkpoints_without_recorded_checksums_still_verify_sizes(copy, capsys):
    manifest = _manifest(copy)
    for info in manifest["files"].values():
        info.pop("crc32c")
        info.pop("tensors", None)
    (copy / "fastckpt.json").write_text(json.dumps(manifest))
    report = fastckpt.verify_checkpoint(copy)
    assert set(report.files.values()) == {"no checksum recorded"} and report.tensors_checked == 0
    assert cli(["verify", str(copy)]) == 0
    assert "NOTE model.safetensors: no checksum recorded" in capsys.readouterr().out
    with open(copy / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(fastckpt.IntegrityError, match="100 bytes on disk"):
        fastckpt.load_state(make_training_state(seed=1)[0], input_dir=copy, model_only=True, verify=True)


def test_cli_verify_file_and_not_a_checkpoint(good, tmp_path, capsys):
    ckpt, _ = good
    assert cli(["verify", str(ckpt / "model.safetensors")]) == 0  # checked against the manifest beside it
    out = capsys.readouterr().out
    data = (ckpt / "model.safetensors").read_bytes()
    assert f"{ckpt / 'model.safetensors'}: intact: 1 files, 9 tensors (9 with xxh3-128 content hashes), {len(data):,} bytes checked" in out
    lone = tmp_path / "lone" / "model.safetensors"  # a file with no manifest beside it
    lone.parent.mkdir()
    lone.write_bytes(data)
    assert cli(["verify", str(lone)]) == 0
    out = capsys.readouterr().out
    assert f"valid safetensors file: 9 tensors, {len(data):,} bytes read, crc32c {crc32c_hex(data)}" in out
    assert cli(["verify", str(tmp_path)]) == 2
    assert "no fastckpt.json" in capsys.readouterr().err
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{}  ")
    assert cli(["verify", str(tmp_path / "bad.safetensors")]) == 1
    assert capsys.readouterr().err.startswith(f"TruncatedFileError: {tmp_path / 'bad.safetensors'}: ")


def test_verify_checkpoint_reports_the_folder_it_was_given_and_refuses_none(good):
    ckpt, _ = good
    report = fastckpt.verify_checkpoint(str(ckpt))
    assert report.ok and report.folder == ckpt  # a local folder is reported as a Path, as given
    with pytest.raises(TypeError, match="folder is None"):  # not "the project's newest checkpoint"
        fastckpt.verify_checkpoint(None)


def test_cli_inspect_shows_parts_tensors_dtypes_shapes_sizes_and_mode(good, capsys):
    ckpt, _ = good
    assert cli(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert f"{ckpt}: checkpoint, layout fastckpt" in out
    assert "mode full, step 0, models 1, optimizers 1, schedulers 1, format_version 1" in out
    manifest = _manifest(ckpt)
    for name, info in manifest["files"].items():
        assert f"{info['bytes']:>14,} B  crc32c {info['crc32c']}" in out and name in out
    data_bytes = len(read_split(ckpt / "model.safetensors")[3])
    assert f"model.safetensors: 9 tensors, {data_bytes:,} bytes of data ({data_bytes} B)" in out
    assert "fc1.weight" in out and "F32" in out and "[8, 4]" in out and "128 B" in out
    assert "bn.num_batches_tracked" in out and "I64" in out
    assert cli(["inspect", "--json", str(ckpt)]) == 0
    desc = json.loads(capsys.readouterr().out)
    assert desc["mode"] == "full" and desc["layout"] == "fastckpt"
    model = next(f for f in desc["tensor_files"] if f["file"] == "model.safetensors")
    assert {"name": "fc1.weight", "dtype": "F32", "shape": [8, 4], "bytes": 128} in model["tensors"]
    assert cli(["inspect", "--limit", "2", str(ckpt / "model.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "safetensors file" in out and "... and 7 more (--limit 0 shows all)" in out


def test_checksum_files_releases_the_gil(tmp_path):
    payload = np.full(128 << 20, 3, np.uint8)
    _core.write_file(tmp_path / "big.safetensors", [("x", "U8", [payload.size], payload, 0, None)], None,
                     durable=False)
    assert_calls_overlap(lambda i: _core.checksum_files([str(tmp_path / "big.safetensors")], threads=1))

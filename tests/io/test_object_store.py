"""``s3://`` checkpoints against a real S3 API server (moto, tests/helpers/s3_server.py): round trips bit-exact
(single file, sharded, multipart), re-saves, automatic naming, ``latest_checkpoint`` and ``total_limit`` rotation by
committed manifests only, and hostile manifests and objects (a load that refuses changes nothing)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from helpers.common import assert_model_state, make_training_state, model_clone
from helpers.crash_worker import build_state
from helpers.procs import expected_fingerprint, loaded_fingerprint
from helpers.s3_server import BUCKET, client, key_prefix, keys

import fastckpt
from fastckpt.errors import HeaderError, IntegrityError, MissingStateError

MiB = 1 << 20


def _objects(url: str) -> dict[str, str]:
    """``{name: key}`` of the committed save's objects under ``url`` (names relative to its save-id prefix)."""
    found = {}
    for key in keys(key_prefix(url) + "/"):
        rest = key[len(key_prefix(url)) + 1:]
        if rest.startswith("save-"):
            found[rest.split("/", 1)[1]] = key
    return found


def _manifests(url: str) -> list[str]:
    return [k.rsplit("/", 1)[1] for k in keys(key_prefix(url) + "/manifests/")]


def _get(key: str) -> bytes:
    return client().get_object(Bucket=BUCKET, Key=key)["Body"].read()


def _put(key: str, data: bytes) -> None:
    client().put_object(Bucket=BUCKET, Key=key, Body=data)


def test_full_state_round_trip_is_bit_exact_and_objects_match_a_local_save(s3_url, tmp_path):
    model, opt, sched = build_state(3, 2)
    returned = fastckpt.save_state(model, opt, sched, output_dir=s3_url, step=7)
    assert returned == s3_url
    assert _manifests(s3_url) == ["0000000000.json"]
    local = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "local", step=7)
    objects = _objects(s3_url)
    assert sorted(objects) == sorted(p.name for p in local.iterdir() if p.name != "fastckpt.json")
    for name, key in objects.items():
        if name.endswith(".safetensors"):  # the official reader reads the object's bytes as the local file's
            remote = safetensors.torch.load(_get(key))
            for k, v in safetensors.torch.load_file(local / name).items():
                assert torch.equal(remote[k], v), (name, k)
    assert loaded_fingerprint(s3_url, 2) == expected_fingerprint(3, 2)


def _no_local_folders(monkeypatch) -> None:
    import tempfile

    def refuse(*args, **kwargs):
        raise AssertionError("an s3:// save of CPU tensors made a local folder")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)


def test_a_save_uploads_from_memory_the_bytes_and_checksums_a_local_save_writes(s3_url, tmp_path, monkeypatch):
    """No local folder is made (the objects are serialized from the tensors' memory as they go out); every object
    holds exactly the bytes of the local save's file and the manifest object records the local manifest's sizes
    and checksums (crc32c per file and tensor, content hashes), multipart (5 MiB parts) or not."""
    model, opt, sched = build_state(6, 12)
    local = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "local", step=3)
    _no_local_folders(monkeypatch)
    fastckpt.save_state(model, opt, sched, output_dir=s3_url, step=3,
                        storage_options={"part_size": str(5 * MiB), "concurrency": "3"})
    monkeypatch.undo()
    objects = _objects(s3_url)
    assert sorted(objects) == sorted(p.name for p in local.iterdir() if p.name != "fastckpt.json")
    assert max((local / n).stat().st_size for n in objects) > 10 * MiB  # at least one object of 3+ parts
    for name, key in objects.items():
        assert _get(key) == (local / name).read_bytes(), name
    committed = json.loads(_get(keys(key_prefix(s3_url) + "/manifests/")[0]))
    local_manifest = json.loads((local / "fastckpt.json").read_text())
    assert committed["manifest"]["files"] == local_manifest["files"]
    assert {n: o["crc32c"] for n, o in committed["objects"].items()} == {
        n: e["crc32c"] for n, e in local_manifest["files"].items()}
    assert loaded_fingerprint(s3_url, 12) == expected_fingerprint(6, 12)


def test_dcp_object_groups_close_before_the_tensor_that_would_pass_the_limit():
    from fastckpt._io.storage.object.parts import object_groups

    assert object_groups({"a": 8, "b": 8, "c": 8}, 16, 16) == [["a", "b"], ["c"]]
    assert object_groups({"a": 30, "b": 1, "c": 1}, 16, 16) == [["a"], ["b", "c"]]
    assert object_groups({f"t{i}": 10 for i in range(8)}, 16, 2) == [[f"t{i}" for i in range(4)],
                                                                      [f"t{i}" for i in range(4, 8)]]
    assert object_groups({}, 16, 4) == [[]]


def test_dcp_save_uploads_strided_and_tied_tensors_from_memory_bit_exact(s3_url, tmp_path, monkeypatch):
    """A rank's tensors go straight from memory into objects of about one part each, uploaded in parallel (a
    transposed and a row-strided view gathered as they go out; tied views stored once)."""
    import fastckpt.dcp

    g = torch.Generator().manual_seed(1)
    base = torch.randn(1536, 1024, generator=g)
    state = {"t": base.t(), "rows": base[::3], "same": base, "tied": base, "small": torch.arange(5)}
    _no_local_folders(monkeypatch)
    fastckpt.dcp.save(state, s3_url, storage_options={"part_size": str(5 * MiB), "concurrency": "2"})
    monkeypatch.undo()
    fastckpt.dcp.save(state, tmp_path / "local")
    # 14 MiB over 2 requests in flight: objects of at most 7 MiB of tensors, each one PUT (the 6 MiB ones too)
    shards = {n: k for n, k in _objects(s3_url).items() if n.endswith(".safetensors")}
    assert sorted(shards) == ["shard-00000-of-00001.00001.safetensors", "shard-00000-of-00001.00002.safetensors",
                              "shard-00000-of-00001.safetensors"]
    assert not [k for k in keys(key_prefix(s3_url) + "/") if k.endswith(".fastckpt-upload")]
    stored = {}
    for key in shards.values():
        stored.update(safetensors.torch.load(_get(key)))
    local = safetensors.torch.load_file(tmp_path / "local" / "shard-00000-of-00001.safetensors")
    assert sorted(stored) == sorted(local)
    for k, v in local.items():
        assert torch.equal(stored[k], v), k
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    fastckpt.dcp.load(target, s3_url)
    for k, v in state.items():
        assert torch.equal(target[k], v), k


def _watch_fetches(monkeypatch, tmp_path) -> list[dict[str, str]]:
    """Point the temp folder at an empty ``tmp_path/tmp`` and record, as each fetched checkpoint is released, what
    its folder held: ``{relative path: what it is}`` ("memfd" for a link to an in-memory file)."""
    import os
    import tempfile

    from fastckpt._io.storage.object import fetch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    seen: list[dict[str, str]] = []
    close = fetch._MemoryFolder.close

    def record(space) -> None:
        found = {}
        for root in space.roots:
            for dirpath, _dirs, files in os.walk(root):
                for name in files:
                    path = os.path.join(dirpath, name)
                    rel = os.path.relpath(path, root)
                    if os.path.islink(path) and os.readlink(path).startswith("/proc/self/fd/"):  # names the memfd
                        found[rel] = "memfd" if os.readlink(os.readlink(path)).startswith("/memfd:") else "link"
                    elif os.path.islink(path):  # to a file of the space's temp folder (counted there)
                        assert os.path.realpath(path).startswith(str(space.disk)), path
                    else:
                        found[rel] = "file"
        if space.roots:
            seen.append(found)
        close(space)

    monkeypatch.setattr(fetch._MemoryFolder, "close", record)
    return seen


@pytest.mark.parametrize("reader", ["load_state", "dcp", "verify"])
def test_a_load_from_s3_writes_nothing_to_local_disk(reader, s3_url, tmp_path, monkeypatch):
    """Every object of the checkpoint is read into its own in-memory file (memfd) by ranged reads: the folder the
    local loader reads holds links to them only, the temp folder stays empty, and the load is bit-exact."""
    import fastckpt.dcp

    if reader == "dcp":
        state = {"w": torch.randn(700, 1024), "b": torch.arange(7)}
        fastckpt.dcp.save(state, s3_url, storage_options={"part_size": str(5 * MiB)})
    else:
        model, opt, sched = build_state(6, 12)
        fastckpt.save_state(model, opt, sched, output_dir=s3_url, step=3,
                            storage_options={"part_size": str(5 * MiB), "concurrency": "3"})
    seen = _watch_fetches(monkeypatch, tmp_path)
    if reader == "dcp":
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        fastckpt.dcp.load(target, s3_url, storage_options={"part_size": str(5 * MiB)})
        for k, v in state.items():
            assert torch.equal(target[k], v), k
    elif reader == "verify":
        assert fastckpt.verify_checkpoint(s3_url).ok
    else:
        live = build_state(7, 12)
        fastckpt.load_state(*live, input_dir=s3_url, storage_options={"part_size": str(5 * MiB)})
        assert_model_state(live[0], model_clone(model))
    import gc

    gc.collect()  # a DCP reader releases its fetch when it goes
    assert len(seen) == 1 and seen[0]
    assert set(seen[0].values()) == {"memfd"}, seen[0]
    wanted = sorted([*_objects(s3_url), "fastckpt.json"])
    if reader == "dcp":  # a DCP load plans from the chunk index: the full dcp_metadata.json (for tools) is not fetched
        wanted.remove("dcp_metadata.json")
    assert sorted(n.split("/", 1)[1] for n in seen[0]) == wanted
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_checkpoint_larger_than_the_memory_available_is_read_into_a_temp_folder(s3_url, tmp_path, monkeypatch,
                                                                                     caplog):
    from fastckpt._io.storage.object import fetch

    model, opt, sched = build_state(6, 2)
    fastckpt.save_state(model, opt, sched, output_dir=s3_url)
    seen = _watch_fetches(monkeypatch, tmp_path)
    monkeypatch.setattr(fetch, "memory_available", lambda: 1000)
    live = build_state(7, 2)
    with caplog.at_level("WARNING", logger="fastckpt"):
        fastckpt.load_state(*live, input_dir=s3_url)
    assert_model_state(live[0], model_clone(model))
    assert "more than the 1000 bytes of memory available: read into a local temp folder" in caplog.text
    assert len(seen) == 1 and set(seen[0].values()) == {"file"}
    assert list((tmp_path / "tmp").iterdir()) == []  # removed after the load


def test_sharded_multipart_round_trip(s3_url):
    """max_shard_size splits the model; 5 MiB parts make each 8 MiB shard a multipart upload (2 parts)."""
    model, opt, sched = build_state(4, 16)
    options = {"part_size": str(5 * MiB), "concurrency": "4"}
    fastckpt.save_state(model, opt, sched, output_dir=s3_url, max_shard_size="8MiB", storage_options=options)
    names = sorted(_objects(s3_url))
    assert "model.safetensors.index.json" in names and sum(n.startswith("model-0") for n in names) >= 2
    assert not [k for k in keys(key_prefix(s3_url) + "/") if k.endswith(".fastckpt-upload")]
    fresh, fopt, fsched = build_state(5, 16)
    fastckpt.load_state(fresh, fopt, fsched, input_dir=s3_url, storage_options=options, verify=True)
    from helpers.procs import fingerprint

    assert fingerprint(fresh, fopt, fsched) == expected_fingerprint(4, 16)


def test_model_only_round_trip_and_model_only_load_of_a_full_save(s3_url):
    model, opt, sched = make_training_state(0)
    fastckpt.save_state(model, opt, sched, output_dir=s3_url + "/full")
    fastckpt.save_state(model, model_only=True, output_dir=s3_url + "/weights")
    assert sorted(_objects(s3_url + "/weights")) == ["model.safetensors"]
    for where in ("/full", "/weights"):
        fresh = make_training_state(1)[0]
        fastckpt.load_state(fresh, input_dir=s3_url + where, model_only=True)
        assert_model_state(fresh, model_clone(model))
    with pytest.raises(MissingStateError):
        fastckpt.load_state(*make_training_state(1), input_dir=s3_url + "/weights")


def test_resave_replaces_the_state_and_removes_the_old_objects_after_the_commit(s3_url):
    fastckpt.save_state(*build_state(1, 1), output_dir=s3_url)
    first = set(keys(key_prefix(s3_url) + "/"))
    fastckpt.save_state(*build_state(2, 1), output_dir=s3_url)
    assert _manifests(s3_url) == ["0000000001.json"]
    assert not first & set(keys(key_prefix(s3_url) + "/"))
    assert loaded_fingerprint(s3_url, 1) == expected_fingerprint(2, 1)


def test_project_naming_rotation_and_latest_by_committed_manifests(s3_url):
    model, opt, sched = make_training_state(0)
    assert fastckpt.latest_checkpoint(s3_url) is None
    saved = [fastckpt.save_state(model, opt, sched, project_dir=s3_url, total_limit=2) for _ in range(3)]
    assert saved == [f"{s3_url}/checkpoints/checkpoint_{n}" for n in range(3)]
    snap = fastckpt.save_state(model, model_only=True, project_dir=s3_url, total_limit=1)
    assert snap == f"{s3_url}/model_only/checkpoint_0"
    assert fastckpt.latest_checkpoint(s3_url) == saved[2]
    assert fastckpt.latest_checkpoint(s3_url, model_only=True) == snap
    assert not keys(key_prefix(saved[0]) + "/")  # rotated away, every object
    assert _manifests(saved[1]) and _manifests(saved[2])
    # a save that never committed (objects, no manifest) is neither latest nor counted for the next number
    _put(key_prefix(s3_url) + "/checkpoints/checkpoint_9/save-0000000000-deadbeef/model.safetensors", b"junk")
    assert fastckpt.latest_checkpoint(s3_url) == saved[2]
    model2 = make_training_state(1)[0]
    fastckpt.load_state(model2, project_dir=s3_url, model_only=True)
    assert_model_state(model2, model_clone(model))
    assert fastckpt.save_state(model, opt, sched, project_dir=s3_url) == f"{s3_url}/checkpoints/checkpoint_3"


def test_no_committed_checkpoint_is_missing_state(s3_url):
    with pytest.raises(MissingStateError, match="no committed checkpoint"):
        fastckpt.load_state(make_training_state(0)[0], input_dir=s3_url, model_only=True)
    with pytest.raises(MissingStateError, match="no committed full checkpoint"):
        fastckpt.load_state(*make_training_state(0), project_dir=s3_url)


@pytest.fixture
def committed(s3_url):
    """A committed full checkpoint at ``s3_url``, and the live objects a refused load must leave untouched."""
    fastckpt.save_state(*make_training_state(0), output_dir=s3_url)
    live = make_training_state(1)
    return s3_url, live, model_clone(live[0])


def _expect_refused(committed, error, match):
    url, live, before = committed
    with pytest.raises(error, match=match):
        fastckpt.load_state(*live, input_dir=url)
    assert_model_state(live[0], before)


def test_object_of_another_size_is_refused(committed):
    key = _objects(committed[0])["model.safetensors"]
    _put(key, _get(key)[:-4])
    _expect_refused(committed, IntegrityError, rf"s3://{BUCKET}/{key}: \d+ bytes stored, \d+ recorded")


def test_object_with_a_flipped_byte_names_object_and_tensor(committed):
    key = _objects(committed[0])["model.safetensors"]
    data = bytearray(_get(key))
    data[-1] ^= 0x40  # the last byte belongs to the last tensor in the file
    _put(key, bytes(data))
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    _expect_refused(committed, IntegrityError, rf"(?s)s3://{BUCKET}/{key}: crc32c .* recorded.*s3://{BUCKET}/{key}: tensor '{last}'")
    with pytest.raises(IntegrityError, match=last):
        fastckpt.verify_checkpoint(committed[0])


def test_missing_object_is_refused(committed):
    key = _objects(committed[0])["optimizer.safetensors"]
    client().delete_object(Bucket=BUCKET, Key=key)
    _expect_refused(committed, IntegrityError, rf"s3://{BUCKET}/{key}: missing")


def test_object_the_manifest_does_not_list_is_refused(committed):
    key = _objects(committed[0])["model.safetensors"].rsplit("/", 1)[0] + "/model_1.safetensors"
    _put(key, b"x")
    _expect_refused(committed, IntegrityError, rf"s3://{BUCKET}/{key}: not in the manifest")


@pytest.mark.parametrize("body", [b"{not json", b"[]", json.dumps({"format": "fastckpt-object/1"}).encode(),
                                  json.dumps({"format": "fastckpt-object/1", "save_id": "save-1-a", "manifest": {},
                                              "objects": {"../../x": {"bytes": 1, "crc32c": "0"}}}).encode()])
def test_malformed_manifest_is_a_header_error(committed, body):
    url = committed[0]
    _put(f"{key_prefix(url)}/manifests/{_manifests(url)[-1]}", body)
    _expect_refused(committed, HeaderError, "manifests/0000000000.json")


def test_verify_reads_every_object(committed):
    report = fastckpt.verify_checkpoint(committed[0])
    assert report.ok and set(report.files) == set(_objects(committed[0]))


def test_cli_verify_and_inspect_read_s3_checkpoints(committed, capsys):
    from fastckpt.cli import main

    url = committed[0]
    assert main(["verify", url]) == 0
    assert main(["inspect", url]) == 0
    out = capsys.readouterr()
    assert "every object matches its manifest" in out.err and "fc1.weight" in out.out
    key = _objects(url)["model.safetensors"]
    _put(key, _get(key)[:-1] + bytes([_get(key)[-1] ^ 1]))
    assert main(["verify", url]) == 1
    assert f"s3://{BUCKET}/{key}: crc32c" in capsys.readouterr().err
    assert main(["verify", url + "-nothing-here"]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
    assert main(["verify", url + "/a{b}"]) == 2  # a key prefix S3 advises against: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("fastckpt verify: ") and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_what_names_an_s3_checkpoint_names_its_url_not_the_copy_in_memory(committed, capsys):
    """Outputs, reports, errors and warnings of reads from s3:// name the URL: the fetched copy is gone by then."""
    from fastckpt.cli import main

    url, live, before = committed
    assert main(["verify", url]) == 0
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert url in out and "/dev/shm" not in out and "fastckpt-s3-" not in out, out
    report = fastckpt.verify_checkpoint(url)
    assert report.folder == url
    fastckpt.save_state(live[0], model_only=True, output_dir=url + "-weights")
    with pytest.raises(MissingStateError) as info:
        fastckpt.load_state(*live, input_dir=url + "-weights")
    assert str(info.value).startswith(f"{url}-weights: saved with model_only=True"), info.value
    assert_model_state(live[0], before)


def test_storage_options_that_are_not_a_mapping_are_a_type_error(s3_url):
    with pytest.raises(TypeError, match="storage_options must be a mapping of S3 settings.*got str"):
        fastckpt.load_state(torch.nn.Linear(2, 2), input_dir=s3_url, storage_options="endpoint=x")


def test_a_manifest_whose_number_is_not_its_name_is_refused(committed):
    url = committed[0]
    key = f"{key_prefix(url)}/manifests/0000000000.json"
    _put(key, json.dumps(dict(json.loads(_get(key)), number=7)).encode())
    _expect_refused(committed, HeaderError, r"0000000000\.json: records number 7, its name says 0")


def test_consolidate_an_s3_dcp_checkpoint_into_a_local_model_folder(s3_url, tmp_path):
    from helpers.dcp_state import full_state

    import fastckpt.dcp
    from fastckpt.cli import main

    state = {k: v for k, v in full_state().items() if isinstance(v, torch.Tensor)}
    fastckpt.dcp.save(state, s3_url)
    fastckpt.dcp.save(state, tmp_path / "local")
    assert main(["consolidate", s3_url, str(tmp_path / "from_s3")]) == 0
    assert main(["consolidate", str(tmp_path / "local"), str(tmp_path / "from_local")]) == 0
    names = sorted(p.name for p in (tmp_path / "from_local").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "from_s3").iterdir())
    for name in names:
        assert (tmp_path / "from_s3" / name).read_bytes() == (tmp_path / "from_local" / name).read_bytes(), name


def test_bad_storage_options_are_value_errors(s3_url):
    model = make_training_state(0)[0]
    with pytest.raises(ValueError, match='"no_such_key" is not an S3 setting'):
        fastckpt.save_state(model, model_only=True, output_dir=s3_url, storage_options={"no_such_key": "1"})
    with pytest.raises(ValueError, match="part_size 1024 is outside"):
        fastckpt.save_state(model, model_only=True, output_dir=s3_url, storage_options={"part_size": 1024})
    with pytest.raises(ValueError, match="names no key prefix"):
        fastckpt.save_state(model, model_only=True, output_dir=f"s3://{BUCKET}")
    with pytest.raises(ValueError, match="the key prefix holds '#'"):
        fastckpt.save_state(model, model_only=True, output_dir=s3_url + "/a#b")
    with pytest.raises(ValueError, match="is local but project_dir"):
        fastckpt.save_state(model, model_only=True, output_dir="local", project_dir=s3_url)
    assert not keys(key_prefix(s3_url))


def _tensor_at(data: bytes, at: int) -> str:
    """The name of the tensor whose bytes hold offset ``at`` of the safetensors file ``data``."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    rel = at - 8 - size
    return next(k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][0] <= rel < v["data_offsets"][1])


def test_a_flipped_byte_in_a_middle_part_is_found_before_the_model_or_optimizer_change(s3_url):
    """A byte flipped in the middle of a multipart object (5 MiB ranged reads): IntegrityError naming the object and
    the tensor, and the live model and optimizer are bit-identical afterwards (every object is checked before the
    local loader runs, which itself reads into fresh memory and applies last)."""
    model, opt, sched = build_state(6, 12)
    fastckpt.save_state(model, opt, sched, output_dir=s3_url, storage_options={"part_size": str(5 * MiB)})
    key = _objects(s3_url)["model.safetensors"]
    data = bytearray(_get(key))
    at = len(data) // 2
    data[at] ^= 0x01
    _put(key, bytes(data))
    live = build_state(7, 12)
    model_before = model_clone(live[0])
    opt_before = {k: [t.clone() for t in v.values() if isinstance(t, torch.Tensor)]
                  for k, v in live[1].state_dict()["state"].items()}
    with pytest.raises(IntegrityError, match=rf"(?s)s3://{BUCKET}/{key}: crc32c .*tensor '{_tensor_at(bytes(data), at)}'"):
        fastckpt.load_state(*live, input_dir=s3_url, storage_options={"part_size": str(5 * MiB)})
    assert_model_state(live[0], model_before)
    after = live[1].state_dict()["state"]
    for k, tensors in opt_before.items():
        now = [t for t in after[k].values() if isinstance(t, torch.Tensor)]
        assert all(torch.equal(a, b) for a, b in zip(now, tensors, strict=True)), k


def test_a_manifest_object_that_disagrees_with_its_checkpoint_manifest_is_refused(committed):
    url = committed[0]
    key = keys(key_prefix(url) + "/manifests/")[-1]
    body = json.loads(_get(key))
    body["manifest"]["files"]["model.safetensors"]["crc32c"] = "00000000"
    _put(key, json.dumps(body).encode())
    _expect_refused(committed, IntegrityError, r"model.safetensors: the manifest object records crc32c [0-9a-f]{8}, "
                                               r"its checkpoint manifest 00000000")


@pytest.mark.parametrize("damage", ["flip", "truncate", "unlisted", "missing"])
def test_hostile_objects_fail_a_dcp_load_naming_the_object_and_leave_the_destinations_unchanged(damage, s3_url):
    import fastckpt.dcp

    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(300, 1024, generator=g), "b": torch.randn(700, 1024, generator=g)}
    fastckpt.dcp.save(state, s3_url)
    key = next(k for n, k in _objects(s3_url).items() if n.endswith(".safetensors"))
    data = bytearray(_get(key))
    match = rf"(?s)s3://{BUCKET}/{key}"
    if damage == "flip":
        data[-5] ^= 0x10
        _put(key, bytes(data))
        match += rf": crc32c .*tensor '{_tensor_at(bytes(data), len(data) - 5)}'"
    elif damage == "truncate":
        _put(key, bytes(data[:-1]))
        match += r": \d+ bytes stored, \d+ recorded"
    elif damage == "unlisted":
        key = key.rsplit("/", 1)[0] + "/extra.safetensors"
        _put(key, bytes(data))
        match = rf"s3://{BUCKET}/{key}: not in the manifest"
    else:
        client().delete_object(Bucket=BUCKET, Key=key)
        match += ": missing"
    target = {k: torch.full_like(v, 7.0) for k, v in state.items()}
    with pytest.raises(IntegrityError, match=match):
        fastckpt.dcp.load(target, s3_url)
    for v in target.values():
        assert torch.equal(v, torch.full_like(v, 7.0))

"""Tiered saves (``save_state(..., remote="s3://...")``): committed locally first, then that folder uploaded in the
background and committed remotely. Round trips from the remote are bit-exact; the local folder loads while the
upload is held; an upload failure surfaces from ``wait()`` naming the object and leaves the previous remote
checkpoint; ``total_limit`` rotates both tiers (the remote one only after the newer remote commit); a process
killed mid-upload leaves the previous remote checkpoint as the latest."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from helpers.crash_worker import BigNet, build_state
from helpers.procs import WORKER, expected_fingerprint, finish, loaded_fingerprint, wait_ready, worker_env
from helpers.s3_server import BUCKET, Faults, key_prefix, keys, proxy_options

import fastckpt

MiB = 1 << 20


def _held_uploads() -> tuple[threading.Event, threading.Event, Faults]:
    held, release = threading.Event(), threading.Event()

    def hold(method: str, path: str) -> None:
        if method == "PUT" and "/save-" in path:
            held.set()
            release.wait(120)

    return held, release, Faults(hold=hold)


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_from_the_remote_is_bit_exact_after_wait(async_save, s3_url, tmp_path):
    model, opt, sched = build_state(4, 2)
    handle = fastckpt.save_state(model, opt, sched, output_dir=tmp_path / "ckpt", remote=s3_url, step=3,
                                 async_save=async_save)
    assert isinstance(handle, fastckpt.TieredSave)
    assert handle.wait_local() == (tmp_path / "ckpt").absolute()
    assert handle.wait() == s3_url and handle.done() and handle.exception() is None
    fresh = BigNet(2)
    fastckpt.load_state(fresh, input_dir=s3_url, model_only=True)
    for (name, saved), (_, loaded) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(saved, loaded), name
    assert loaded_fingerprint(s3_url, 2) == expected_fingerprint(4, 2)
    assert loaded_fingerprint(tmp_path / "ckpt", 2) == expected_fingerprint(4, 2)


def test_the_local_folder_loads_before_the_upload_finishes(proxy, s3_url, tmp_path):
    held, release, proxy.faults = _held_uploads()
    try:
        handle = fastckpt.save_state(*build_state(5, 1), output_dir=tmp_path / "ckpt", remote=s3_url,
                                     storage_options=proxy_options(proxy))
        assert held.wait(120), "the upload never started"
        assert not handle.done()
        assert loaded_fingerprint(handle.wait_local(), 1) == expected_fingerprint(5, 1)
        assert keys(key_prefix(s3_url) + "/manifests/") == []  # nothing committed remotely yet
        with pytest.raises(TimeoutError, match="not committed within"):
            handle.wait(timeout=0.01)
    finally:
        release.set()
    assert handle.wait(120) == s3_url
    proxy.faults = Faults()
    assert loaded_fingerprint(s3_url, 1) == expected_fingerprint(5, 1)


def test_an_upload_failure_surfaces_from_wait_naming_the_object_and_leaves_the_previous_remote(proxy, s3_url,
                                                                                               tmp_path):
    fastckpt.save_state(*build_state(1, 1), output_dir=s3_url)  # the previous remote checkpoint
    before = keys(key_prefix(s3_url) + "/")
    proxy.faults = Faults(kind="503", count=None, match=lambda method, path: method == "PUT" and "/save-" in path)
    handle = fastckpt.save_state(*build_state(2, 1), output_dir=tmp_path / "ckpt", remote=s3_url,
                                 storage_options=proxy_options(proxy, retries=2))
    with pytest.raises(OSError, match=rf"s3://{BUCKET}/{key_prefix(s3_url)}/save-\d+-[0-9a-f]+/[\w.]+: .*after 2 retries"):
        handle.wait(120)
    assert isinstance(handle.exception(), OSError)
    proxy.faults = Faults()
    assert keys(key_prefix(s3_url) + "/") == before
    assert loaded_fingerprint(s3_url, 1) == expected_fingerprint(1, 1)
    assert loaded_fingerprint(tmp_path / "ckpt", 1) == expected_fingerprint(2, 1)  # the local commit stands
    fastckpt.save_state(*build_state(3, 1), output_dir=tmp_path / "ckpt", remote=s3_url).wait()  # reported once


def test_an_unwaited_upload_failure_is_raised_by_the_next_tiered_save(proxy, s3_url, tmp_path):
    proxy.faults = Faults(kind="503", count=None, match=lambda method, path: method == "PUT" and "/save-" in path)
    fastckpt.save_state(*build_state(2, 1), output_dir=tmp_path / "a", remote=s3_url,
                        storage_options=proxy_options(proxy, retries=1))
    with pytest.raises(OSError, match="after 1 retries") as info:
        fastckpt.save_state(*build_state(3, 1), output_dir=tmp_path / "b", remote=s3_url)
    assert any("earlier tiered save" in note for note in info.value.__notes__)
    assert not (tmp_path / "b").exists()  # the new save was not made


def _numbers(url: str) -> list[int]:
    found = {k.split("/checkpoints/checkpoint_", 1)[1].split("/", 1)[0] for k in keys(key_prefix(url) + "/checkpoints/")}
    return sorted(int(n) for n in found)


def test_total_limit_rotates_both_tiers_the_remote_only_after_the_newer_remote_commit(proxy, s3_url, tmp_path):
    options = proxy_options(proxy)
    for seed in (1, 2):
        fastckpt.save_state(*build_state(seed, 1), project_dir=tmp_path, remote=s3_url, total_limit=2,
                            storage_options=options).wait()
    assert _numbers(s3_url) == [0, 1]
    held, release, proxy.faults = _held_uploads()
    try:
        handle = fastckpt.save_state(*build_state(3, 1), project_dir=tmp_path, remote=s3_url, total_limit=2,
                                     storage_options=options)
        assert held.wait(120)
        assert handle.remote == f"{s3_url}/checkpoints/checkpoint_2"
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
        assert fastckpt.latest_checkpoint(s3_url, storage_options=options) == f"{s3_url}/checkpoints/checkpoint_1"
        assert 0 in _numbers(s3_url)  # the remote keeps checkpoint_0 until checkpoint_2 is committed there
    finally:
        release.set()
    assert handle.wait(120) == f"{s3_url}/checkpoints/checkpoint_2"
    proxy.faults = Faults()
    assert _numbers(s3_url) == [1, 2]
    assert fastckpt.latest_checkpoint(s3_url) == f"{s3_url}/checkpoints/checkpoint_2"
    assert loaded_fingerprint(f"{s3_url}/checkpoints/checkpoint_2", 1) == expected_fingerprint(3, 1)
    assert loaded_fingerprint(f"{s3_url}/checkpoints/checkpoint_1", 1) == expected_fingerprint(2, 1)


def test_a_process_killed_before_the_upload_committed_leaves_the_previous_remote_latest(proxy, s3_url, tmp_path):
    fastckpt.save_state(*build_state(1, 1), project_dir=tmp_path, remote=s3_url).wait()
    held, release = threading.Event(), threading.Event()

    def hold(method: str, path: str) -> None:
        if method == "PUT" and "/checkpoint_1/save-" in path and "partNumber=2&" in path + "&":
            held.set()
            release.wait(120)

    proxy.faults = Faults(hold=hold)
    env = worker_env() | {"AWS_ENDPOINT_URL": proxy.endpoint}
    worker = subprocess.Popen([sys.executable, str(WORKER), "2", "40", str(tmp_path), "--auto", "--remote", s3_url],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
    try:
        wait_ready(worker)
        assert worker.stdout.readline().strip() == f"local {tmp_path / 'checkpoints' / 'checkpoint_1'}"
        assert held.wait(120), "the worker never sent a second multipart part"
        worker.kill()
        status, lines, err = finish(worker)
    finally:
        release.set()
        worker.kill()
    assert status == -9, (status, lines, err)
    proxy.faults = Faults()
    latest = fastckpt.latest_checkpoint(s3_url)
    assert latest == f"{s3_url}/checkpoints/checkpoint_0"
    assert loaded_fingerprint(latest, 1) == expected_fingerprint(1, 1)
    assert loaded_fingerprint(tmp_path / "checkpoints" / "checkpoint_1", 40) == expected_fingerprint(2, 40)


def test_a_normal_exit_finishes_the_upload(s3_url, tmp_path):
    script = ("import sys; sys.path.insert(0, sys.argv[3]); import fastckpt; from helpers.crash_worker import "
              "build_state; fastckpt.save_state(*build_state(6, 1), output_dir=sys.argv[1], remote=sys.argv[2])")
    tests = str(WORKER.parents[1])
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ckpt"), s3_url, tests], env=worker_env(),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert loaded_fingerprint(s3_url, 1) == expected_fingerprint(6, 1)


@pytest.mark.parametrize("where, match", [
    ({"output_dir": "ckpt", "remote": "/mnt/backup"}, "not an s3:// URL"),
    ({"output_dir": "s3://b/x", "remote": "s3://b/y"}, "local tier"),
    ({"output_dir": "ckpt", "remote": "gs://b/y"}, "gs://"),
])
def test_bad_tiers_are_refused_before_anything_is_written(where, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=match):
        fastckpt.save_state(*build_state(1, 1), **where)
    assert list(tmp_path.iterdir()) == []


def test_a_plain_save_never_rotates_away_the_folder_a_tiered_save_is_uploading(proxy, s3_url, tmp_path):
    held, release, proxy.faults = _held_uploads()
    try:
        handle = fastckpt.save_state(*build_state(1, 1), project_dir=tmp_path, remote=s3_url, total_limit=1,
                                     storage_options=proxy_options(proxy))
        assert held.wait(120), "the upload never started"
        uploading = handle.wait_local()
        for seed in (2, 3):  # plain saves of the same project with total_limit=1 while the upload is held
            fastckpt.save_state(*build_state(seed, 1), project_dir=tmp_path, total_limit=1)
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_2"]
        assert loaded_fingerprint(uploading, 1) == expected_fingerprint(1, 1)
    finally:
        release.set()
    assert handle.wait(120) == f"{s3_url}/checkpoints/checkpoint_0"
    proxy.faults = Faults()
    assert loaded_fingerprint(handle.remote, 1) == expected_fingerprint(1, 1)
    fastckpt.save_state(*build_state(4, 1), project_dir=tmp_path, total_limit=1)  # the upload ended: rotated now
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_3"]


def test_the_handle_says_where_it_uploads_and_how_far_it_got(s3_url, tmp_path):
    handle = fastckpt.save_state(*build_state(6, 1), output_dir=tmp_path / "ckpt", remote=s3_url)
    handle.wait(120)
    assert repr(handle) == f"TieredSave({str((tmp_path / 'ckpt').absolute())!r} -> {s3_url!r}, committed)"

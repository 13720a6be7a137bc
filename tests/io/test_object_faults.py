"""``s3://`` saves under faults, through a proxy in front of the moto server (tests/helpers/s3_server.py):
throttling (503 SlowDown) and dropped connections are retried (bounded) and the save commits exactly; unbounded
faults fail with an error naming the object and commit nothing; a save killed mid-upload leaves no manifest and the
next save aborts its multipart uploads; two savers racing for one checkpoint: exactly one wins."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from helpers.crash_worker import build_state
from helpers.procs import WORKER, expected_fingerprint, finish, loaded_fingerprint, wait_ready, worker_env
from helpers.s3_server import BUCKET, Faults, key_prefix, keys, pending_uploads, proxy_options

import fastckpt
from fastckpt.errors import ConcurrentSaveError

MiB = 1 << 20


@pytest.mark.parametrize("kind", ["503", "drop"])
def test_throttling_and_dropped_connections_are_retried_and_the_save_commits_exactly(kind, proxy, s3_url):
    proxy.faults = Faults(kind=kind, count=4, match=lambda method, path: method == "PUT" and "partNumber=" in path)
    fastckpt.save_state(*build_state(1, 12), output_dir=s3_url, storage_options=proxy_options(proxy))
    assert proxy.faults.injected == 4
    proxy.faults = Faults()
    assert loaded_fingerprint(s3_url, 12) == expected_fingerprint(1, 12)
    assert pending_uploads(key_prefix(s3_url)) == []


@pytest.mark.parametrize("kind", ["503", "drop"])
def test_unbounded_faults_fail_naming_the_object_and_commit_nothing(kind, proxy, s3_url):
    fastckpt.save_state(*build_state(1, 1), output_dir=s3_url)  # the previous checkpoint, written directly
    before = keys(key_prefix(s3_url) + "/")
    proxy.faults = Faults(kind=kind, count=None, match=lambda method, path: method == "PUT" and "/save-" in path)
    with pytest.raises(OSError, match=rf"s3://{BUCKET}/{key_prefix(s3_url)}/save-\d+-[0-9a-f]+/[\w.]+: .*after 2 retries"):
        fastckpt.save_state(*build_state(2, 1), output_dir=s3_url, storage_options=proxy_options(proxy, retries=2))
    assert proxy.faults.injected >= 3  # the first try and 2 retries, at least for one object
    proxy.faults = Faults()
    assert keys(key_prefix(s3_url) + "/") == before  # nothing of the failed save is left, the manifest unchanged
    assert loaded_fingerprint(s3_url, 1) == expected_fingerprint(1, 1)


def test_a_save_killed_mid_upload_leaves_the_previous_checkpoint_and_the_next_save_aborts_its_uploads(proxy, s3_url):
    fastckpt.save_state(*build_state(1, 1), output_dir=s3_url)
    held, release = threading.Event(), threading.Event()

    def hold(method: str, path: str) -> None:
        if method == "PUT" and "partNumber=2&" in path + "&":
            held.set()
            release.wait(120)

    proxy.faults = Faults(hold=hold)
    env = worker_env() | {"AWS_ENDPOINT_URL": proxy.endpoint}
    worker = subprocess.Popen([sys.executable, str(WORKER), "2", "40", s3_url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_ready(worker)
        assert held.wait(120), "the worker never sent a second multipart part"
        worker.kill()
        status, lines, err = finish(worker)
    finally:
        release.set()
        worker.kill()
    assert status == -9, (status, lines, err)
    proxy.faults = Faults()
    prefix = key_prefix(s3_url)
    assert [k for k in keys(prefix + "/manifests/")] == [f"{prefix}/manifests/0000000000.json"]
    marked = {k.removesuffix(".fastckpt-upload") for k in keys(prefix + "/") if k.endswith(".fastckpt-upload")}
    assert marked and marked <= set(pending_uploads(prefix)), "the held upload is open and recorded by its marker"
    assert loaded_fingerprint(s3_url, 1) == expected_fingerprint(1, 1)  # never loaded: the previous state

    fastckpt.save_state(*build_state(3, 1), output_dir=s3_url)
    # every upload the killed save recorded is aborted (one it started but was killed before recording, in the
    # one request between the two, is left to the bucket's AbortIncompleteMultipartUpload rule: README)
    assert not marked & set(pending_uploads(prefix))
    remaining = keys(prefix + "/")
    assert [k for k in remaining if "/manifests/" in k] == [f"{prefix}/manifests/0000000001.json"]
    assert len({k.split("/")[1] for k in remaining if "/save-" in k}) == 1  # only the committed save's objects
    assert loaded_fingerprint(s3_url, 1) == expected_fingerprint(3, 1)


def test_two_savers_racing_for_one_checkpoint_one_wins_with_one_complete_state(proxy, s3_url):
    arrived = threading.Barrier(2, timeout=120)

    def hold(method: str, path: str) -> None:
        if method == "PUT" and "/manifests/" in path:
            arrived.wait()  # both have uploaded everything and ask for the same manifest number

    proxy.faults = Faults(hold=hold, serialize=lambda method, path: method == "PUT" and "/manifests/" in path)
    results: dict[int, object] = {}

    def save(seed: int) -> None:
        try:
            results[seed] = fastckpt.save_state(*build_state(seed, 1), output_dir=s3_url,
                                                storage_options=proxy_options(proxy))
        except Exception as exc:
            results[seed] = exc

    threads = [threading.Thread(target=save, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    proxy.faults = Faults()
    won = [seed for seed, r in results.items() if r == s3_url]
    lost = [r for r in results.values() if isinstance(r, ConcurrentSaveError)]
    assert len(won) == 1 and len(lost) == 1, results
    assert "another save committed" in str(lost[0]) and "manifests/0000000000.json" in str(lost[0])
    assert loaded_fingerprint(s3_url, 1) == expected_fingerprint(won[0], 1)
    prefix = key_prefix(s3_url)
    assert len({k.split("/")[1] for k in keys(prefix + "/") if "/save-" in k}) == 1

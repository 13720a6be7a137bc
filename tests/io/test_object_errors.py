"""Issue 27 item 7: object-store failures a user meets first come back as the builtin a caller catches for them,
saying what to fix, without S3's raw XML: refused credentials are a PermissionError, a missing bucket a
FileNotFoundError, an endpoint nobody answers at a ConnectionError; each names the URL. A checksum mismatch of
fetched bytes says "in the store", not "on disk". Against the moto server (tests/helpers/s3_server.py), with moto's
own IAM check switched on for the credential case."""

from __future__ import annotations

import pytest
import torch
from helpers.s3_server import BUCKET, client, free_port, key_prefix, keys

import fastckpt

FAST = {"max_retries": "1", "retry_backoff": "0.01"}


def _model() -> torch.nn.Module:
    return torch.nn.Linear(8, 4)


@pytest.mark.parametrize("op", ["save", "load"])
def test_a_missing_bucket_is_a_file_not_found_error_naming_it_and_the_fix(s3_endpoint, op):
    model = _model()
    with pytest.raises(FileNotFoundError) as info:
        if op == "save":
            fastckpt.save_state(model, model_only=True, output_dir="s3://no-such-bucket/run", storage_options=FAST)
        else:
            fastckpt.load_state(model, input_dir="s3://no-such-bucket/run", model_only=True, storage_options=FAST)
    assert str(info.value) == (
        f's3://no-such-bucket/run/manifests: bucket "no-such-bucket" does not exist at {s3_endpoint}; create it '
        "first, or fix the bucket name in the URL or the endpoint (AWS_ENDPOINT_URL or storage_options' endpoint_url)")


@pytest.mark.parametrize("op", ["save", "load"])
def test_refused_credentials_are_a_permission_error_naming_the_variables(s3_url, op):
    from moto.core.authorization import enable_iam_authentication

    model = _model()
    if op == "load":
        fastckpt.save_state(model, model_only=True, output_dir=s3_url)
    before = keys(key_prefix(s3_url))
    with enable_iam_authentication(), pytest.raises(PermissionError) as info:  # moto knows no key now
        if op == "save":
            fastckpt.save_state(model, model_only=True, output_dir=s3_url, storage_options=FAST)
        else:
            fastckpt.load_state(model, input_dir=s3_url, model_only=True, storage_options=FAST)
    assert str(info.value) == (
        f"{s3_url}/manifests: the store refused the credentials (InvalidAccessKeyId: The AWS Access Key Id you provided "
        "does not exist in our records.); check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), "
        "or storage_options' aws_access_key_id / aws_secret_access_key, and that this key may read and write bucket "
        f'"{BUCKET}"')
    assert keys(key_prefix(s3_url)) == before


def test_an_endpoint_nobody_answers_at_is_a_connection_error_naming_it(s3_url):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConnectionError) as info:
        fastckpt.save_state(_model(), model_only=True, output_dir=s3_url,
                            storage_options={**FAST, "endpoint_url": endpoint})
    assert str(info.value).startswith(f"{s3_url}/manifests: cannot connect to the object store at {endpoint} (")
    assert str(info.value).endswith("after 1 retries); check AWS_ENDPOINT_URL or storage_options' endpoint_url and "
                                    "that the server is running and reachable from here")
    assert "<?xml" not in str(info.value)


def test_a_checksum_mismatch_of_fetched_bytes_says_in_the_store(s3_url):
    model = _model()
    fastckpt.save_state(model, model_only=True, output_dir=s3_url)
    (key,) = [k for k in keys(key_prefix(s3_url)) if k.endswith("model.safetensors")]
    data = bytearray(client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[-3] ^= 0xFF  # inside the last tensor, same size
    client().put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with pytest.raises(fastckpt.IntegrityError) as info:
        fastckpt.verify_checkpoint(s3_url)
    message = str(info.value)
    assert f"s3://{BUCKET}/{key}: tensor 'weight': crc32c " in message and " in the store, " in message
    assert "on disk" not in message
    with pytest.raises(fastckpt.IntegrityError) as loaded:
        fastckpt.load_state(_model(), input_dir=s3_url, model_only=True)
    assert " in the store, " in str(loaded.value) and "on disk" not in str(loaded.value)

"""Content hashes (xxh3-128 over 256 KiB blocks): a property of the bytes only (same for a strided view and its
contiguous copy, for any name, threads or chunk size); the writer's, ``hash_tensors``' and ``hash_files``' values
agree; any changed byte, in any block, changes it; a converted tensor's hash is the hash of its converted bytes."""

from __future__ import annotations

import pytest
import torch

from fastckpt import _core
from fastckpt._format.tensors import tensor_source

BLOCK = 256 << 10


def _hash(t: torch.Tensor, name: str = "t", convert: str | None = None, threads: int = 0) -> str:
    return _core.hash_tensors([tensor_source(name, t, convert)], threads=threads)[0]


@pytest.mark.parametrize("nbytes", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17])
def test_writer_memory_and_disk_hashes_agree(tmp_path, nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    want = _hash(data)
    for chunk in (7, 4096, BLOCK + 3, 8 << 20):
        path = tmp_path / f"f{chunk}.safetensors"
        (_size, _crc, _tensors, hashes), = _core.write_files_checked(
            [(str(path), [tensor_source("t", data)], None)], durable=False, threads=3, chunk_bytes=chunk)
        assert hashes == [("t", want)]
        assert _core.hash_files([str(path)]) == [([("t", want)], None)]
    assert len(want) == 32 and set(want) <= set("0123456789abcdef")


def test_a_property_of_the_bytes_only():
    base = torch.randn(300, 700)
    view = base.t()
    assert _hash(view) == _hash(view.contiguous()) != _hash(base)
    assert _hash(base, "a") == _hash(base, "b")
    assert _hash(base, threads=1) == _hash(base, threads=4)
    assert _hash(base.view(torch.int32)) == _hash(base)  # same bytes, same hash (dtype is compared separately)


def test_every_changed_byte_changes_it():
    data = torch.randint(0, 256, (3 * BLOCK,), dtype=torch.uint8)
    seen = {_hash(data)}
    for at in (0, BLOCK - 1, BLOCK, 2 * BLOCK + 5, 3 * BLOCK - 1):
        changed = data.clone()
        changed[at] ^= 1
        seen.add(_hash(changed))
    assert len(seen) == 6
    assert _hash(data[:-1]) != _hash(data)  # the length counts


def test_a_converted_tensor_hashes_as_its_converted_bytes():
    t = torch.randn(1000, 333)
    assert _hash(t, convert="BF16") == _hash(t.to(torch.bfloat16))
    assert _hash(t.t(), convert="F16") == _hash(t.t().contiguous().to(torch.float16))

"""Cold reads (issue 26): ``fastckpt.torch.load_file`` on a file not in the page cache hints the kernel to read it
ahead and views the private mapping, and the core coalesces adjacent tensors into one ``preadv``; both return
exactly what the official safetensors reader returns, and a short file is a ``TruncatedFileError``."""

from __future__ import annotations

import os

import pytest
import safetensors.torch as official
import torch
from helpers.common import SHARED_DTYPES, assert_tensor_dicts_identical, random_tensor

import fastckpt
import fastckpt.torch as ft
from fastckpt import _core


def _drop(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _many(tmp_path, writer):
    """A file of many small and medium tensors of every shared dtype (adjacent in the file), written by ``writer``."""
    tensors = {}
    for i in range(120):
        dtype = SHARED_DTYPES[i % len(SHARED_DTYPES)][0]
        shape = ((i * 37) % 300 + 1,) if i % 3 else (i % 7, 129)  # a few empty ones too
        tensors[f"t{i:03d}"] = random_tensor(dtype, shape, seed=i)
    tensors["big"] = torch.randn(3 << 20, generator=torch.Generator().manual_seed(26))  # 12 MiB: two 8 MiB reads
    path = tmp_path / "many.safetensors"
    writer(tensors, str(path))
    return path


@pytest.mark.parametrize("writer", [official.save_file, ft.save_file], ids=["official", "fastckpt"])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_cold_load_equals_the_official_reader(tmp_path, writer, backend):
    path = _many(tmp_path, writer)
    want = official.load_file(str(path))
    _drop(path)
    if _core.SafetensorsFile(str(path)).looks_cached():
        pytest.skip("the page cache kept the file (a mapping elsewhere holds it)")
    got = ft.load_file(path, backend=backend)
    assert_tensor_dicts_identical(got, want)
    got["big"].add_(1)  # private and writable: the file is unchanged
    assert_tensor_dicts_identical(ft.load_file(path, backend=backend), want)


def test_a_file_cut_after_open_is_truncated_naming_the_tensor(tmp_path):
    path = _many(tmp_path, ft.save_file)
    file = _core.SafetensorsFile(str(path), mmap=False)
    entries = {e[0]: e for e in file.tensors()}
    _, _, _, begin, end = entries["t050"]
    os.truncate(path, file.data_start + begin + 3)
    targets = [(name, bytearray(e[4] - e[3])) for name, e in entries.items() if e[4] > e[3]]
    with pytest.raises(fastckpt.TruncatedFileError, match='tensor "t050"'):
        file.read_into(targets)

"""An async save to a destination that can never be written fails at the call, as the synchronous save does.

Every ``async_save`` mode of every entry point (``save_state``, ``fastckpt.save``, the accelerate save that the
Trainer reaches, the Lightning plugin) raises at the call the exception the synchronous save raises (the same class,
the same message) and leaves nothing behind: no staging folder or lock, no save in flight, no failure that a later
save, ``finish_pending`` or the exit report would raise. The async call claims its folder as the synchronous save
does before its first byte (``fastckpt._io.storage.local.commit.claim_target``).
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import fastckpt
import fastckpt.lightning
from fastckpt._io.async_save import writer as _async
from fastckpt._io.storage.local import staging
from fastckpt.errors import DestinationNotWritableError

MODES = (True, "stream", "snapshot")


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _saves(model, optimizer):
    """``{entry point: save(path, mode)}`` of the entry points every mode of this module checks."""
    return {
        "save_state": lambda path, mode: fastckpt.save_state(model, optimizer, output_dir=path, async_save=mode),
        "save": lambda path, mode: fastckpt.save({"model": model.state_dict(), "step": 3}, path, async_save=mode,
                                                 optimizers=optimizer if mode is True else None),
    }


def _raised(save, path, mode) -> BaseException:
    try:
        result = save(path, mode)
    except Exception as exc:  # noqa: BLE001 - the exception itself is what is compared
        return exc
    if mode:  # what this module is about: an async save that starts and fails later
        with pytest.raises(Exception) as later:
            result.wait()
        pytest.fail(f"{mode!r} to {path}: started, then failed in the background: {later.value!r}")
    pytest.fail(f"a save to {path} succeeded")


def _pending() -> int:
    """Saves the default saver still tracks, once every earlier one is finished and reported."""
    _async.finish_pending(wait=True)
    with _async.default_saver()._lock:
        return len(_async.default_saver()._pending)


def _assert_nothing_started(pending_before: int) -> None:
    """No save in flight or failed was added; nothing for the next save or the exit report to raise."""
    saver = _async.default_saver()
    with saver._lock:
        assert len(saver._pending) == pending_before, saver._pending
    assert saver.unreported() == []
    _async.finish_pending(wait=True)  # raises an unreported failure: none


def _check(save, path, *, expect: type, errno_: int | None = None, folder=None) -> None:
    """Every mode raises at the call what the synchronous save raises; nothing is left in ``folder``."""
    before = sorted(os.listdir(folder)) if folder is not None else None
    sync = _raised(save, path, False)
    assert isinstance(sync, expect), repr(sync)
    if errno_ is not None:
        assert isinstance(sync, DestinationNotWritableError) and sync.errno == errno_, repr(sync)
        assert sync.filename == os.path.abspath(path) and ".lock" not in str(sync), repr(sync)
    pending = _pending()
    for mode in MODES:
        exc = _raised(save, path, mode)
        assert type(exc) is type(sync) and str(exc) == str(sync), (mode, exc, sync)
        _assert_nothing_started(pending)
        if folder is not None:
            assert sorted(os.listdir(folder)) == before, (mode, os.listdir(folder))


@pytest.mark.parametrize("entry", ["save_state", "save"])
@pytest.mark.parametrize(("where", "expect", "code"), [
    ("/proc/x", FileNotFoundError, errno.ENOENT),  # a folder that takes no files
    ("/sys/x", PermissionError, errno.EACCES),  # refused even to root
    ("/proc/x/y", FileNotFoundError, errno.ENOENT),  # its parent cannot be made
])
def test_a_folder_that_takes_no_files_fails_the_call(entry, where, expect, code):
    model, optimizer = _model_and_optimizer()
    _check(_saves(model, optimizer)[entry], where, expect=expect, errno_=code)


@pytest.mark.parametrize("entry", ["save_state", "save"])
def test_a_file_or_a_path_under_a_file_fails_the_call(tmp_path, entry):
    model, optimizer = _model_and_optimizer()
    (tmp_path / "file").write_text("not a folder")
    for path in (tmp_path / "file", tmp_path / "file" / "ckpt"):
        _check(_saves(model, optimizer)[entry], path, expect=NotADirectoryError, folder=tmp_path)


@pytest.mark.parametrize("entry", ["save_state", "save"])
def test_a_read_only_file_system_fails_the_call_and_leaves_nothing(tmp_path, monkeypatch, entry):
    """The staging folder's lock cannot be made (EROFS, as on a read-only mount; a read-only folder stops no root):
    a DestinationNotWritableError that is a plain OSError of that errno, naming the folder given."""
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and str(tmp_path) in os.fspath(path):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(staging.os, "open", read_only)
    model, optimizer = _model_and_optimizer()
    _check(_saves(model, optimizer)[entry], tmp_path / "ckpt", expect=DestinationNotWritableError, errno_=errno.EROFS,
           folder=tmp_path)


def test_the_lightning_plugin_fails_the_call(tmp_path):
    state = {"state_dict": {"w": torch.ones(3)}, "global_step": 1}
    for where, expect in (("/proc/x/y.ckpt", FileNotFoundError), ("/sys/x.ckpt", PermissionError)):
        sync, pending = None, _pending()
        for mode in (False, True, "snapshot"):
            with pytest.raises(expect) as info:
                fastckpt.lightning.CheckpointIO(async_save=mode).save_checkpoint(state, where)
            assert isinstance(info.value, DestinationNotWritableError), repr(info.value)
            sync = sync or info.value
            assert type(info.value) is type(sync) and str(info.value) == str(sync), (mode, info.value, sync)
            _assert_nothing_started(pending)


def test_the_accelerate_save_the_trainer_reaches_fails_the_call(new_accelerator):
    import fastckpt.accelerate

    accelerator = new_accelerator()
    model, optimizer = _model_and_optimizer()
    model, optimizer = accelerator.prepare(model, optimizer)

    def save(path, mode):
        return fastckpt.accelerate.save_state(accelerator, output_dir=path, async_save=mode)

    for where, expect in (("/proc/x", FileNotFoundError), ("/proc/x/y", FileNotFoundError),
                          ("/sys/x", PermissionError)):
        _check(save, where, expect=expect, errno_=errno.EACCES if expect is PermissionError else errno.ENOENT)


def test_an_async_save_to_a_writable_folder_still_commits(tmp_path):
    """The claim at the call is the staging folder the writer then fills: the save commits and nothing else stays."""
    model, optimizer = _model_and_optimizer()
    for i, mode in enumerate(MODES):
        for entry, save in _saves(model, optimizer).items():
            folder = tmp_path / f"{entry}_{i}" / "ckpt"
            assert save(folder, mode).wait() == folder
            assert sorted(os.listdir(folder.parent)) == ["ckpt"]
    _async.finish_pending(wait=True)
    assert _async.default_saver().unreported() == []

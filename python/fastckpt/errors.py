"""fastckpt's exception hierarchy.

Every error fastckpt raises on purpose derives from :class:`CheckpointError` *and* from the builtin a caller
would already catch for that kind of failure (the convention of orjson and polars): a malformed file is a
``ValueError``, a missing part of a checkpoint is a ``FileNotFoundError``, a missing or unexpected tensor name is
a ``KeyError``, a dtype that cannot be stored or loaded is a ``TypeError``. A save destination that takes no files
is a :class:`DestinationNotWritableError`, which is also the builtin ``OSError`` subclass of its errno
(``PermissionError``, ``FileNotFoundError``...); other plain I/O failures (a disk filling up mid-write) stay the
builtin ``OSError`` subclasses.

The Rust core (``fastckpt._core``) raises these same classes: its one error enum is mapped onto them in the
bindings, so a caller never sees a Rust-only exception type.
"""

from __future__ import annotations

import pickle

__all__ = [
    "CheckpointError",
    "FrozenWeightsError",
    "HeaderError",
    "TruncatedFileError",
    "MissingStateError",
    "KeyMismatchError",
    "IntegrityError",
    "ShapeMismatchError",
    "DtypeError",
    "TensorSubclassError",
    "UnsafePickleError",
    "ClosedFileError",
    "MetaTensorError",
    "CollectiveTimeoutError",
    "CheckpointChangedError",
    "ConcurrentModificationError",
    "SaveCancelledError",
    "ConcurrentSaveError",
    "OptionError",
    "OptionTypeError",
    "DurableSaveError",
    "DestinationNotWritableError",
    "TierSkippedWarning",
    "MemoryTierFullWarning",
    "ResumeWarning",
]


class CheckpointError(Exception):
    """Root of every error fastckpt raises on purpose."""


class HeaderError(CheckpointError, ValueError):
    """A safetensors header (or a checkpoint's JSON) is malformed: bad length, JSON, dtype, shape or offsets."""


class TruncatedFileError(HeaderError):
    """A file is shorter than its header says (expected and actual sizes in bytes are in the message)."""


class MissingStateError(CheckpointError, FileNotFoundError):
    """A checkpoint lacks a part the caller asked for (e.g. a full load of a model-only checkpoint)."""


class KeyMismatchError(CheckpointError, KeyError):
    """Missing or unexpected tensor names (fqns) in a strict load, or an unknown tensor name."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument; show the message as written
        return str(self.args[0]) if self.args else ""


class IntegrityError(CheckpointError, ValueError):
    """Stored bytes do not match the checksums or sizes recorded when the checkpoint was written."""


class DtypeError(CheckpointError, TypeError):
    """A dtype that cannot be stored, or a stored dtype that does not match its destination."""


class TensorSubclassError(CheckpointError, TypeError):
    """A tensor subclass fastckpt cannot store or fill exactly: not a traceable wrapper subclass (no
    ``__tensor_flatten__``), a nested one, one whose flatten context JSON cannot hold, or a saved subclass meeting a
    live tensor of another class or settings. Raised before anything is written or changed; the message names the
    tensor and its type."""


class ShapeMismatchError(CheckpointError, ValueError):
    """A stored tensor's shape differs from the shape of the live tensor it is loaded into."""


class FrozenWeightsError(CheckpointError, ValueError):
    """A trainable-only checkpoint is loaded into a model whose frozen weights differ from the ones it was saved
    with (another base model, or changed frozen tensors); the message names the first tensor that differs."""


class UnsafePickleError(CheckpointError, pickle.UnpicklingError):
    """A pickled file (accelerate's ``.bin`` / ``.pkl``) needs full unpickling, which can run arbitrary code.

    Raised unless the load passes ``trust_pickle=True``; the message names the file and the global it needs.
    """


class ClosedFileError(CheckpointError, ValueError):
    """A ``safe_open`` handle was used after its ``with`` block (safetensors: "File is closed")."""


class MetaTensorError(CheckpointError, NotImplementedError):
    """A tensor on the meta device has no data to save (safetensors raises NotImplementedError too)."""


class CollectiveTimeoutError(CheckpointError, TimeoutError):
    """Another process of a multi-process save or load did not take part in time (it died, or never called the
    same function): raised within the ``timeout`` passed to the call instead of waiting forever.

    The message names the operation, the step it waited at, the processes that did not arrive and the seconds.
    """


class CheckpointChangedError(IntegrityError):
    """Another save replaced or rewrote the checkpoint while it was being read (its files no longer belong to the
    manifest that was read first). Nothing was changed: retry the load (``load_state`` already retried)."""


class ConcurrentModificationError(CheckpointError, RuntimeError):
    """A tensor of an async save was changed in place before it was written or copied.

    ``save_state(..., async_save=True)`` writes parameters and optimizer state after the call returns, up to
    their optimizer's next ``step()``; an in-place change outside that step (an EMA update, manual clipping,
    ``load_state_dict``), or a write torch does not track (``p.data``, a ``.numpy()`` view, another thread:
    found by the content hashes taken at the call), would tear the checkpoint, so the save fails instead: nothing
    is committed and the previous checkpoint stays. The message names the tensor; call ``wait()`` on the handle
    before such changes, or pass ``async_save="snapshot"`` to copy the whole state at the call.
    """


class SaveCancelledError(CheckpointError, InterruptedError):
    """An async save was cancelled before its commit (``AsyncSave.cancel()``, or a second Ctrl-C after one that
    interrupted ``wait()``): nothing was committed and the previous checkpoint stays."""


class ConcurrentSaveError(CheckpointError, FileExistsError):
    """Another save committed the same object-store checkpoint first (both raced for its next manifest; the
    conditional create let exactly one win). The committed state is the other save's, complete; this save's objects
    were removed. The message names the manifest object."""


class OptionError(CheckpointError, ValueError):
    """An option of a fastckpt object has a value it cannot work with (a ``keep=0``, an infinite interval, a memory
    folder that cannot be written): raised at construction, before anything is installed, started or written. The
    message names the option and the value given."""


class OptionTypeError(OptionError, TypeError):
    """An option of the wrong type (``continuous="no"``, ``every_n_steps=True``): an :class:`OptionError` that is
    also a ``TypeError``. The message names the option, the type and the value given."""


class DurableSaveError(CheckpointError, OSError):
    """A background copy of a checkpoint to the durable tier (or its upload) failed: nothing was committed there and
    the previous durable checkpoint is still the latest. Raised on every process at its next
    ``CheckpointManager.step()`` or ``close()``; the message names the step, the folder and the original error
    (its ``__cause__`` on the process that made the copy)."""


class DestinationNotWritableError(CheckpointError, OSError):
    """A save's destination takes no new files: its folder (or a folder above it) cannot be made, is read-only, on a
    file system that takes no files (``/proc``, ``/sys``), full, or this process may not write it. Raised before the
    save writes its first byte, at the call, by synchronous and asynchronous saves alike; nothing is left behind and
    a previous checkpoint there is intact. The message names the folder the caller gave and the reason; ``errno``,
    ``strerror`` and ``filename`` are set as the OSError's.

    Raised as an instance of the builtin ``OSError`` subclass of its errno too (:meth:`of`), so ``except
    PermissionError`` / ``except FileNotFoundError`` / ``except OSError`` still catch it."""

    @staticmethod
    def of(code: int | None, message: str, filename: str) -> DestinationNotWritableError:
        """The error for ``code`` (an errno): an instance of this class and of the builtin ``OSError`` subclass
        Python gives that errno (``EACCES``: ``PermissionError``; ``ENOENT``: ``FileNotFoundError``; ``EROFS``:
        plain ``OSError``)."""
        builtin = type(OSError(code, "")) if code is not None else OSError
        return _with_builtin(builtin)(code, message, filename)

    def __reduce__(self) -> tuple[object, ...]:  # the per-errno classes are made on demand: pickle by errno
        return _rebuild, (self.errno, self.strerror, self.filename)


_BY_BUILTIN: dict[type, type] = {OSError: DestinationNotWritableError}


def _with_builtin(builtin: type) -> type:
    if builtin not in _BY_BUILTIN:
        _BY_BUILTIN[builtin] = type("DestinationNotWritableError", (DestinationNotWritableError, builtin),
                                    {"__module__": __name__, "__doc__": DestinationNotWritableError.__doc__})
    return _BY_BUILTIN[builtin]


def _rebuild(code: int | None, message: str, filename: str) -> DestinationNotWritableError:
    return DestinationNotWritableError.of(code, message, filename)



class TierSkippedWarning(UserWarning):
    """A checkpoint tier (the memory tier, a peer's replica, the local or the remote durable tier) held a damaged,
    partial or unreadable checkpoint, so a restore skipped it and went on to the next one. The message names the
    tier, the folder (or URL), the step and the error; nothing of it was applied."""


class MemoryTierFullWarning(UserWarning):
    """The memory tier had no room for a ``CheckpointManager`` save (``ENOSPC`` / ``EDQUOT`` / ``ENOMEM`` writing
    into ``/dev/shm`` or the ``memory=`` folder): the partial snapshot was removed and the step was saved to the
    durable tier instead, in ``step()``. The message names the memory folder, the bytes the state needs and the
    remedies (``memory=False``, a larger tmpfs, a smaller state)."""


class ResumeWarning(UserWarning):
    """A resume restores less than a full training state: the message names the folder and what starts fresh (e.g.
    the optimizer, scheduler and RNG states of a Trainer resumed from a ``save_only_model`` checkpoint), so the run
    from there differs from an uninterrupted one. A warning, not an error: the run goes on as the caller asked."""

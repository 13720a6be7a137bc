"""Hash at the call: the proof that a streaming async save writes the state as of the call.

A streaming save (:mod:`fastckpt._io.async_save.stream`) writes parameters and optimizer state from the live tensors
after ``save_state`` has returned. Version counters see every in-place op that goes through torch's autograd
bookkeeping, but not writes through ``p.data`` (its own counter), ``.numpy()`` views, raw pointers, or an op
still running on another thread. So with ``async_save=True`` the call also takes the xxh3-128 content hash of
every streamed tensor (``_core.hash_tensors``: all blocks in parallel, GIL released, as the bytes would be
stored), and the writer's own per-tensor hashes of the bytes it wrote (``_core.write_files_checked``, the
manifest's ``"xxh3"`` fields) must match them before the commit: any change between the call and the moment the
writer (or a step's copy) read the tensor fails the save with
:class:`~fastckpt.errors.ConcurrentModificationError`, and nothing is committed.

The hashes are never recalled from :mod:`fastckpt._io.tensor_hashes` (its memory trusts version counters).

What is left: the writer hashes a chunk of live memory and then writes it (through the page cache, ``durable=False``
or no O_DIRECT; a durable O_DIRECT write copies the chunk into its bounce buffer first, so hash and bytes are the
same by construction). A change landing between those two steps is caught by the crc32c re-check of the live
tensor at commit (:meth:`~fastckpt._io.async_save.stream.StreamingSave.before_commit`) unless it was undone before the
commit or the tensor's optimizer stepped meanwhile (its values then change anyway and are not re-checked).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastckpt.errors import ConcurrentModificationError

__all__ = ["call_hashes", "check_written"]


def call_hashes(deferred: list[Any], *, threads: int = 0) -> dict[str, str]:
    """``{"file:tensor": xxh3-128 hex}`` of the streamed CPU tensors ``deferred`` (``_Deferred`` records), as
    stored (converted to each one's ``convert_to``), hashed now in one parallel pass in the core."""
    from fastckpt import _core
    from fastckpt._format.tensors import tensor_source

    mine = [d for d in deferred if d.tensor.device.type == "cpu"]
    if not mine:
        return {}
    digests = _core.hash_tensors([tensor_source(d.name, d.tensor.detach(), d.convert_to) for d in mine],
                                 threads=threads)
    return {d.name: h for d, h in zip(mine, digests)}


def check_written(target: Path, hashes: dict[str, str], checksums: dict[str, Any]) -> None:
    """Raise unless every tensor hashed at the call was written with the same content hash.

    Args:
        target: the checkpoint folder (for the message).
        hashes: :func:`call_hashes`' result.
        checksums: the manifest's checksum fields per file (``{"xxh3": {tensor: hex}}``).

    Raises:
        ConcurrentModificationError: a tensor written with other bytes than it held at the call, or whose
            written hash is missing (it cannot be proven unchanged); names the tensor and both hashes.
    """
    for key, at_call in hashes.items():
        file, _, name = key.partition(":")
        written = checksums.get(file, {}).get("xxh3", {}).get(name)
        if written == at_call:
            continue
        raise ConcurrentModificationError(
            f"async save to {target}: tensor {key!r} was changed after save_state returned and before it was "
            f"written (xxh3-128 at the call {at_call}, of the bytes written {written}): a write torch does not "
            "track (p.data, a .numpy() view, another thread) or an in-place change outside optimizer.step(). "
            "Call handle.wait() before changing saved tensors, or pass async_save='snapshot' to copy the whole "
            f"state at the call. Nothing was committed; the previous checkpoint at {target} (if any) is intact."
        )

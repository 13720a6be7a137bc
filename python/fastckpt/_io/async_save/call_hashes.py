"""The proof that a streaming async save writes the state as of the call: a write guard or a hash at the call.

A streaming save (:mod:`fastckpt._io.async_save.stream`) writes parameters and optimizer state from the live tensors
after ``save_state`` has returned. Version counters see every in-place op that goes through torch's autograd
bookkeeping, but not writes through ``p.data`` (its own counter), ``.numpy()`` views, raw pointers, or an op
still running on another thread. So with ``async_save=True`` the call also pins every streamed tensor
(:class:`CallProof`), in one of two ways:

- *guarded* (where the kernel allows, :mod:`fastckpt._io.async_save.write_guard`): its whole pages are
  write-protected in asynchronous mode (a page-table update, no pass over the bytes) and its few end bytes copied.
  When the tensor becomes safe (its optimizer's step, or the commit), the content hash of the call's end bytes and
  the live pages between them is taken, and then the kernel is asked whether any of those pages was written
  since the call: if one was, the save fails; if none was, that hash is the hash of the tensor as of the call.
  A copy the step takes of a tensor not yet written gets the call's end bytes before the writer sees it.
- *hashed at the call* (every other tensor): its xxh3-128 content hash is taken at the call
  (``_core.hash_tensors``: all blocks in parallel, GIL released, as the bytes would be stored).

Either way, the writer's own per-tensor hashes of the bytes it wrote (``_core.write_files_checked``, the
manifest's ``"xxh3"`` fields) must match those hashes before the commit: any change between the call and the
moment the writer (or a step's copy) read the tensor fails the save with
:class:`~fastckpt.errors.ConcurrentModificationError`, and nothing is committed.

The hashes are never recalled from :mod:`fastckpt._io.tensor_hashes` (its memory trusts version counters).

What is left for a tensor hashed at the call: the writer hashes a chunk of live memory and then writes it (through
the page cache, ``durable=False`` or no O_DIRECT; a durable O_DIRECT write copies the chunk into its bounce buffer
first, so hash and bytes are the same by construction). A change landing between those two steps is caught by the
crc32c re-check of the live tensor at commit (:meth:`~fastckpt._io.async_save.stream.StreamingSave.before_commit`)
unless it was undone before the commit or the tensor's optimizer stepped meanwhile. A guarded tensor has no such
gap: any write to its pages before it became safe is reported by the kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastckpt._io.async_save.write_guard import Guarded, WriteGuard
from fastckpt.errors import CheckpointError, ConcurrentModificationError

__all__ = ["CallProof", "call_hashes", "check_written"]


def _guardable(d: Any) -> bool:
    """A contiguous CPU tensor stored as it is in memory (not converted while written)."""
    from fastckpt._format.dtypes import to_safetensors_dtype
    from fastckpt._format.tensors import convert_target

    t = d.tensor
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return False
    return convert_target(d.name, to_safetensors_dtype(t.dtype, name=d.name), d.convert_to) is None


class CallProof:
    """The call's hold on every streamed CPU tensor of one save (``_Deferred`` records): guards or hashes.

    Args:
        deferred: the streamed tensors (``_Deferred``: ``id``, ``name`` ``"file:tensor"``, ``tensor``,
            ``convert_to``).
        target: the checkpoint folder (for messages).

    Attributes:
        hashes: ``{"file:tensor": xxh3-128 hex}``: taken at the call for the tensors not guarded; a guarded
            tensor's joins once :meth:`settle` proved it.
        guarded: ``{id: Guarded}`` of the guarded tensors.
    """

    def __init__(self, deferred: list[Any], target: Path) -> None:
        self.target = target
        self.guard = WriteGuard.open()
        self.guarded: dict[int, Guarded] = {}
        self._copies: dict[int, Any] = {}
        try:
            if self.guard is not None:
                able = [d for d in deferred if _guardable(d)]
                for d, g in zip(able, self.guard.guard_many([d.tensor for d in able])):
                    if g is not None:
                        self.guarded[d.id] = g
            self.hashes = call_hashes([d for d in deferred if d.id not in self.guarded])
        except BaseException:
            self.close()
            raise

    def patch_copy(self, d: Any, copy: Any) -> None:
        """``copy`` (uint8 numpy) was just made of guarded tensor ``d``: give it the call's end bytes, keep it."""
        g = self.guarded.get(d.id)
        if g is not None:
            g.patch(copy)
            self._copies[d.id] = copy

    def settle(self, deferred: list[Any]) -> None:
        """Prove the guarded tensors among ``deferred`` unchanged since the call and release them: hash each (its
        copy, or the call's end bytes and its live pages), then ask the kernel whether a page was written.

        Raises:
            ConcurrentModificationError: a page of one of them was written since the call (names the tensor and
                the byte offset); every one of them is released anyway.
            CheckpointError: the kernel refused to say whether a page was written (names the tensor).
        """
        mine = [d for d in deferred if d.id in self.guarded and not self.guarded[d.id].released]
        if not mine or self.guard is None:
            return
        from fastckpt import _core

        pieces = [[self._copies[d.id]] if d.id in self._copies else self.guarded[d.id].pieces(d.tensor)
                  for d in mine]
        digests = _core.hash_pieces(pieces)
        changed = []
        for d, digest in zip(mine, digests):
            g = self.guarded[d.id]
            try:
                first = self.guard.release(g)
            except OSError as exc:  # PAGEMAP_SCAN refused after the guard was set: nothing proves the bytes
                raise CheckpointError(
                    f"async save to {self.target}: could not ask the kernel whether tensor {d.name!r} was written "
                    f"after save_state returned ({exc}); nothing was committed, the previous checkpoint at "
                    f"{self.target} (if any) is intact. Pass async_save='snapshot' to copy the state at the call."
                ) from exc
            if first is None:
                self.hashes[d.name] = digest
            else:
                changed.append((d, first + len(g.head)))
        if changed:
            d, offset = changed[0]
            raise ConcurrentModificationError(
                f"async save to {self.target}: tensor {d.name!r} was written after save_state returned and before "
                f"it was saved (the kernel reports a write to its page at byte {offset:,} of {d.nbytes:,}; "
                f"{len(changed)} tensor(s) changed): a write torch does not track (p.data, a .numpy() view, another "
                "thread, a syscall) or an in-place change outside optimizer.step(). Call handle.wait() before "
                "changing saved tensors, or pass async_save='snapshot' to copy the whole state at the call. Nothing "
                f"was committed; the previous checkpoint at {self.target} (if any) is intact."
            )

    def close(self) -> None:
        """Release every tensor still guarded (the save ended); idempotent."""
        if self.guard is not None:
            self.guard.close()
        self._copies.clear()


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

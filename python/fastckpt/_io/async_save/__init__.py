"""Async saving: the save returns, the bytes go out in the background, the commit reports its outcome.

writer (the background writer, one save in flight per target), modes (the ``async_save`` modes as writers with
one verb, chosen once: ``False`` / ``True`` / ``"snapshot"`` / ``"stream"``), snapshot (a copy of the state at the
call) and host_pool (its reused pinned host buffers), cuda (device copies on a side stream), stream (writing straight from the live tensors), call_hashes (the write guards or
hashes taken at the call that prove a streamed save wrote the state as of the call), write_guard (userfaultfd
write-protection: which pages were written since the call), cancel (stopping a save in flight), outcome
(a save's result, waited on with no lock its writer needs), exit_report (failures nobody waited on, reported at
interpreter exit).

May import: layers 0-1, the shared ``_io`` modules, ``_io.group``, ``_io.storage.base`` and ``_io.storage.local``.
"""

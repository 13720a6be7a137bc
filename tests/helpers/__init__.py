"""Test helpers, in one place: ``common`` (tensors, models, files, exact comparisons), ``accelerate_state``
(prepared accelerate training states), ``procs`` / ``crash_worker`` / ``fault_log`` (the fault tests' worker
processes), ``crc32c_ref`` (a reference crc32c), ``mp_accelerate_worker`` (the torchrun scenarios), ``dcp_state`` / ``dcp_worker`` (the fastckpt.dcp state and its
torchrun scenarios)."""

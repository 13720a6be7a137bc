"""Layer 2: where the bytes of a checkpoint live and how they get there crash-safely.

Sub-packages by concern, each importing only the ones listed before it (``tests/architecture`` checks the order):

- shared modules here: files (``FilePart`` / ``SavePlan``, what a writer takes), log, location (the one check of a
  path's URL scheme), sizes (``"10GB"`` / ``"512MiB"`` to bytes), safe_open (the safetensors-compatible reader), device_load (pinned bounce buffers, side
  streams), tensor_hashes (content hashes of live tensors);
- ``group``: process-group plumbing (sessions, participation, store waits);
- ``storage``: where checkpoints live, the interface (``storage.base``) and one sub-package per backend:
  ``storage.local`` (folders), ``storage.object`` (``s3://``), ``storage.tiered`` (local, then remote);
- ``async_save``: background writing, snapshots, streaming from live tensors;
- ``dcp``: DCP metadata and parts, consolidation.

May import: layers 0-1 (``_core``, ``errors``, ``_version``, ``_format``) and other ``_io`` modules, in that order.
"""

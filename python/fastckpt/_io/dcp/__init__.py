"""torch.distributed.checkpoint (DCP) files: reading DCP metadata and parts (files) and consolidating a sharded save
into plain safetensors files (consolidate).

May import: layers 0-1, the shared ``_io`` modules, ``_io.group``, ``_io.storage.base`` and ``_io.storage.local``.
"""

"""Tiered storage: a checkpoint committed in a local folder first, then uploaded to object storage and committed
there in the background (upload).

May import: layers 0-1, the shared ``_io`` modules, ``_io.async_save`` and the other storage backends.
"""

"""The object-storage backend (``s3://``): a checkpoint under a prefix, committed by creating its manifest object
last; reads go to memory, never to local disk.

store (URLs, the Rust store, retries), commit (uploads and the conditional manifest create), fetch (a committed
save read into memory, crc32c checked as it comes), project (``checkpoint_{n}`` numbering and rotation under a
prefix), sharded (one rank's part of a sharded save), parts (the objects several processes upload and read one
by one: fastckpt.dcp's writer and reader), api (the public calls' glue).

May import: layers 0-1, the shared ``_io`` modules, ``_io.group``, ``_io.storage.base`` and ``_io.storage.local``
(the manifest layout and the integrity checks are the same as a folder's).
"""

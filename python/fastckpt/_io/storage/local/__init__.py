"""The local-folder backend: how a checkpoint sits in a folder and gets there crash-safely.

layout (file names, the manifest), numbering (``checkpoint_{n}`` naming and rotation), staging (owned staging
folders and locks), commit (write, then rename into place), in_place (mount points, unwritable parents), folder
(pinned reads: every file of one load from one save), shards (``max_shard_size`` files and their index), sharing
(files shared with an earlier save), integrity (crc32c checks and verify reports), parts (one folder several
processes write and read file by file: fastckpt.dcp's writer and reader).

May import: layers 0-1, the shared ``_io`` modules, ``_io.group`` and ``_io.storage.base``.
"""

"""Layer 2, files and folders: how a checkpoint sits on disk and gets there crash-safely.

layout (file names, the manifest, automatic naming and rotation), files (``FilePart`` / ``SavePlan``, what the
writer takes), shards and their index, staging folders and locks, the commit, in-place commits (mount points, unwritable
parents), pinned folder reads (folder, one save per load), log lines (log), integrity (crc32c), the host buffer
pool, snapshots and the async writer, device I/O (pinned bounce buffers, side streams), distributed agreement;
location (the one check of a path's URL scheme) and object storage (``object_*``: ``s3://`` checkpoints committed by a
manifest object, naming and rotation, the calls' glue).

May import: layers 0-1 (``_core``, ``errors``, ``_version``, ``_format``) and other ``_io`` modules.
"""

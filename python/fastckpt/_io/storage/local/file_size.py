"""What is at a path a manifest records as a file of N bytes, in words: the one check every reader shares.

A size mismatch reads "N bytes on disk, M recorded"; a path that is no longer a regular file (a folder put in its
place, a socket, ...) says what it is instead of quoting the folder's inode size as if it were the file's.
"""

from __future__ import annotations

import os
import stat

__all__ = ["recorded_size_problem"]

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def recorded_size_problem(path: str | os.PathLike[str], recorded: object, where: str) -> str | None:
    """The problem with ``path`` against the size a manifest records for it, or None when it matches.

    Args:
        path: the file (followed if a symlink).
        recorded: the recorded size in bytes (as read from the manifest: any JSON value).
        where: what recorded it, for the message (``"fastckpt.json"``, ``"the manifest"``).

    Returns:
        ``"{path}: is a directory, not the file of {recorded} bytes {where} records ..."``, ``"{path}: {actual}
        bytes on disk, {recorded} recorded in {where}"``, or None.

    Raises:
        FileNotFoundError: nothing is at ``path`` (callers word their own missing-file error).
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        return (f"{path}: is {kind}, not the file of {recorded} bytes {where} records; something replaced it "
                "after the save: put the file back or save again")
    if st.st_size != recorded:
        return f"{path}: {st.st_size} bytes on disk, {recorded} recorded in {where}"
    return None

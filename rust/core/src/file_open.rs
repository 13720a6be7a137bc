//! Opening a file to read it as safetensors: a non-blocking open that refuses anything but a regular file (a FIFO
//! or a device would hang or lie about its size), with errors that name the path. Shared by the reader, the
//! checksums and the content hashes, so none of them needs another to open a file.

use std::fs::File;
use std::path::Path;

use crate::error::{Error, Result};
use crate::sys;

/// Open `path` for reading: never blocks (FIFOs), and anything but a regular file is refused, a folder as
/// `EISDIR` ([`Error::Io`]), a FIFO, socket or device as [`Error::Header`].
pub(crate) fn open_file(path: &Path) -> Result<File> {
    open_file_as(path, path)
}

/// [`open_file`] of `source`, with errors naming `path`.
pub(crate) fn open_file_as(source: &Path, path: &Path) -> Result<File> {
    sys::open_regular(source).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidInput => Error::Header(format!(
            "{}: cannot be read as a safetensors file: {e}",
            path.display()
        )),
        _ => Error::io(path, "opening", e),
    })
}

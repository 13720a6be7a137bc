//! The one error type of the core. The bindings map each variant onto a class in `fastckpt.errors`
//! (or, for [`Error::Io`], onto the builtin `OSError` subclass for the errno).

use std::io;
use std::path::{Path, PathBuf};

/// Everything the core can fail with. Every message names the file, the tensor and the numbers involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A malformed safetensors header: bad length, JSON, entry, shape or offsets (`HeaderError`).
    #[error("{0}")]
    Header(String),

    /// A file (or in-memory file) is shorter than its header says (`TruncatedFileError`).
    #[error("{path}: truncated safetensors file: {what} needs {expected} bytes, found {actual}")]
    Truncated {
        /// The file (or `<bytes>` for in-memory data).
        path: String,
        /// What was being read: "the 8-byte header length", "the header", "the data section".
        what: String,
        /// Bytes needed.
        expected: u64,
        /// Bytes present.
        actual: u64,
    },

    /// A dtype that is unknown or cannot be stored as asked (`DtypeError`).
    #[error("{0}")]
    Dtype(String),

    /// An unknown tensor name (`KeyMismatchError`).
    #[error("{0}")]
    KeyMismatch(String),

    /// Stored bytes disagree with what was recorded when they were written (`IntegrityError`).
    #[error("{0}")]
    Integrity(String),

    /// A caller passed something that cannot be written or read as asked (`ValueError`).
    #[error("{0}")]
    InvalidArgument(String),

    /// A plain I/O failure on `path` (the builtin `OSError` subclass for the errno).
    #[error("{}: {context}: {source}", path.display())]
    Io {
        /// The file or folder the failing call was about.
        path: PathBuf,
        /// What the core was doing, e.g. "creating the temp file".
        context: String,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
}

/// The core's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::Io`] for `path` while doing `context`.
    pub fn io(path: &Path, context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            context: context.into(),
            source,
        }
    }

    /// A short name of the variant (`"Header"`, `"Truncated"`, ...), for tests and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Header(_) => "Header",
            Error::Truncated { .. } => "Truncated",
            Error::Dtype(_) => "Dtype",
            Error::KeyMismatch(_) => "KeyMismatch",
            Error::Integrity(_) => "Integrity",
            Error::InvalidArgument(_) => "InvalidArgument",
            Error::Io { .. } => "Io",
        }
    }
}

/// Attach a path and a context to an `io::Result`.
pub(crate) trait IoContext<T> {
    /// Turn an `io::Error` into [`Error::Io`] naming `path` and what was being done.
    fn at(self, path: &Path, context: &str) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn at(self, path: &Path, context: &str) -> Result<T> {
        self.map_err(|e| Error::io(path, context, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_message_names_path_and_context() {
        let e = Error::io(
            Path::new("/x/y.safetensors"),
            "opening",
            io::Error::from_raw_os_error(libc::ENOENT),
        );
        let msg = e.to_string();
        assert!(msg.starts_with("/x/y.safetensors: opening: "), "{msg}");
        assert_eq!(e.kind(), "Io");
    }

    #[test]
    fn truncated_message_has_numbers() {
        let e = Error::Truncated {
            path: "a.safetensors".into(),
            what: "the data section".into(),
            expected: 100,
            actual: 7,
        };
        assert_eq!(
            e.to_string(),
            "a.safetensors: truncated safetensors file: the data section needs 100 bytes, found 7"
        );
    }
}

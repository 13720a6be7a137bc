//! The store's error type: every variant names the object (`s3://bucket/key`) it is about.

/// What went wrong talking to the object store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The URL, a `storage_options` key or its value is not usable.
    #[error("{0}")]
    Config(String),
    /// No object at that key.
    #[error("{url}: no such object")]
    NotFound {
        /// The object's URL.
        url: String,
    },
    /// A conditional put found the object already there (another save committed first).
    #[error("{url}: the object already exists (written by another save)")]
    AlreadyExists {
        /// The object's URL.
        url: String,
    },
    /// The bytes read or written do not have the size or crc32c expected.
    #[error("{url}: {what}")]
    Integrity {
        /// The object's URL.
        url: String,
        /// What differs, with both values.
        what: String,
    },
    /// A local file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The local path.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The store refused or failed a request after the bounded retries.
    #[error("{url}: {source}")]
    Store {
        /// The object's URL.
        url: String,
        /// object_store's error (status, retries made).
        source: object_store::Error,
    },
}

/// A result with [`StoreError`].
pub type Result<T> = std::result::Result<T, StoreError>;

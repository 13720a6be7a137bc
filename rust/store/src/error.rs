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
    #[error("{}: {}{}", .url, .source, credentials_hint(.source))]
    Store {
        /// The object's URL.
        url: String,
        /// object_store's error (status, retries made).
        source: object_store::Error,
    },
}

/// The instance-metadata endpoint object_store asks for credentials when the environment names none.
const INSTANCE_METADATA: &str = "169.254.169.254";

/// A line for errors of the credential lookup: without `AWS_ACCESS_KEY_ID` (or `storage_options`), object_store
/// falls back to the cloud instance's metadata endpoint, whose failure means nothing to most users.
fn credentials_hint(source: &object_store::Error) -> &'static str {
    if source.to_string().contains(INSTANCE_METADATA) {
        " (no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or pass them in \
         storage_options; the instance metadata endpoint 169.254.169.254 was tried last)"
    } else {
        ""
    }
}

/// A result with [`StoreError`].
pub type Result<T> = std::result::Result<T, StoreError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_credential_lookup_says_how_to_pass_credentials() {
        let lookup = object_store::Error::Generic {
            store: "S3",
            source: "Error performing PUT http://169.254.169.254/latest/api/token".into(),
        };
        let e = StoreError::Store {
            url: "s3://b/k".into(),
            source: lookup,
        };
        let text = e.to_string();
        assert!(text.starts_with("s3://b/k: "), "{text}");
        assert!(
            text.contains("no credentials found: set AWS_ACCESS_KEY_ID"),
            "{text}"
        );
        let other = StoreError::Store {
            url: "s3://b/k".into(),
            source: object_store::Error::Generic {
                store: "S3",
                source: "503 Slow Down".into(),
            },
        };
        assert!(!other.to_string().contains("credentials"));
    }
}

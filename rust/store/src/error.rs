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
    /// The store refused the credentials (HTTP 403: an unknown key, a wrong secret, an expired token, or a key
    /// without access to the bucket).
    #[error(
        "{url}: the store refused the credentials ({code}: {message}); check AWS_ACCESS_KEY_ID and \
         AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or storage_options' aws_access_key_id / \
         aws_secret_access_key, and that this key may read and write bucket {bucket:?}"
    )]
    Denied {
        /// The object's URL.
        url: String,
        /// The bucket.
        bucket: String,
        /// S3's error code (`InvalidAccessKeyId`, `SignatureDoesNotMatch`, `AccessDenied`, ...).
        code: String,
        /// S3's message.
        message: String,
    },
    /// No credentials: neither the environment nor `storage_options` name any, and the cloud instance's metadata
    /// endpoint (object_store's last resort) gave none.
    #[error(
        "{url}: no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or pass them in \
         storage_options (the instance metadata endpoint 169.254.169.254 was tried last: {detail})"
    )]
    NoCredentials {
        /// The object's URL.
        url: String,
        /// object_store's error, shortened.
        detail: String,
    },
    /// The bucket does not exist at the endpoint.
    #[error(
        "{url}: bucket {bucket:?} does not exist at {endpoint}; create it first, or fix the bucket name in the URL \
         or the endpoint (AWS_ENDPOINT_URL or storage_options' endpoint_url)"
    )]
    NoBucket {
        /// The object's URL.
        url: String,
        /// The bucket.
        bucket: String,
        /// The endpoint asked (scheme, host and port).
        endpoint: String,
    },
    /// No connection to the endpoint could be made (refused, unresolvable, timed out), after the bounded retries.
    #[error(
        "{url}: cannot connect to the object store at {endpoint} ({detail}); check AWS_ENDPOINT_URL or \
         storage_options' endpoint_url and that the server is running and reachable from here"
    )]
    Unreachable {
        /// The object's URL.
        url: String,
        /// The endpoint tried (scheme, host and port).
        endpoint: String,
        /// What failed, with the retries made.
        detail: String,
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

/// `<Tag>value</Tag>` of an S3 XML error body quoted in `text`.
fn xml_value<'a>(text: &'a str, tag: &str) -> Option<&'a str> {
    let open = format!("<{tag}>");
    let start = text.find(&open)? + open.len();
    let len = text[start..].find(&format!("</{tag}>"))?;
    Some(&text[start..start + len])
}

/// `scheme://host:port` of the first URL in `text` (object_store names the request it made), or `"the endpoint"`.
fn endpoint_in(text: &str) -> String {
    let Some(start) = text.find("http://").or_else(|| text.find("https://")) else {
        return "the endpoint".into();
    };
    let url = &text[start..];
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let end = url[after_scheme..]
        .find(|c: char| c == '/' || c == '?' || c.is_whitespace())
        .map_or(url.len(), |i| after_scheme + i);
    url[..end].to_string()
}

/// What a failed request means for the user: a refused key, a missing bucket, an unreachable endpoint, each with
/// its fix, instead of the raw S3 XML; `None` for anything else (kept as [`StoreError::Store`]).
pub fn classify(url: &str, bucket: &str, source: &object_store::Error) -> Option<StoreError> {
    let text = source.to_string();
    if text.contains(INSTANCE_METADATA) {
        return Some(StoreError::NoCredentials {
            url: url.into(),
            detail: text.chars().take(200).collect(),
        });
    }
    let code = xml_value(&text, "Code");
    match code {
        Some("NoSuchBucket") => {
            return Some(StoreError::NoBucket {
                url: url.into(),
                bucket: bucket.into(),
                endpoint: endpoint_in(&text),
            })
        }
        Some(
            c @ ("InvalidAccessKeyId"
            | "SignatureDoesNotMatch"
            | "AccessDenied"
            | "ExpiredToken"
            | "InvalidToken"
            | "TokenRefreshRequired"
            | "AllAccessDisabled"
            | "AccountProblem"),
        ) => {
            return Some(StoreError::Denied {
                url: url.into(),
                bucket: bucket.into(),
                code: c.into(),
                message: xml_value(&text, "Message").unwrap_or("").trim().into(),
            })
        }
        _ => {}
    }
    if code.is_none()
        && (text.contains("error sending request")
            || text.contains("Connection refused")
            || text.contains("dns error"))
    {
        let detail = text
            .rfind(" in ")
            .and_then(|i| {
                text[i + 4..]
                    .find(" - ")
                    .map(|j| text[i + 4 + j + 3..].trim())
            })
            .unwrap_or("no connection")
            .to_string();
        let retries = text
            .find("after ")
            .and_then(|i| text[i..].find(" retries").map(|j| &text[i..i + j + 8]))
            .map(|r| format!(", {r}"))
            .unwrap_or_default();
        return Some(StoreError::Unreachable {
            url: url.into(),
            endpoint: endpoint_in(&text),
            detail: format!("{detail}{retries}"),
        });
    }
    None
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

    #[test]
    fn a_failed_credential_lookup_is_classified_as_no_credentials() {
        let lookup = object_store::Error::Generic {
            store: "S3",
            source: "Error performing PUT http://169.254.169.254/latest/api/token in 1ms - 403"
                .into(),
        };
        let e = classify("s3://b/k", "b", &lookup).expect("classified");
        assert!(matches!(e, StoreError::NoCredentials { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.starts_with("s3://b/k: no credentials found: set AWS_ACCESS_KEY_ID"),
            "{text}"
        );
    }

    fn generic(text: &str) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: text.to_string().into(),
        }
    }

    #[test]
    fn s3_error_bodies_become_errors_that_say_what_to_fix() {
        let denied = generic(
            "Error performing list request: Error performing GET http://127.0.0.1:9/b?list-type=2 in 5ms - \
             Server returned non-2xx status code: 403 Forbidden: <?xml version=\"1.0\"?><Error>\
             <Code>InvalidAccessKeyId</Code><Message>The AWS Access Key Id you provided does not exist in our \
             records.</Message><BucketName>b</BucketName></Error>",
        );
        let e = classify("s3://b/k", "b", &denied).unwrap();
        assert!(matches!(e, StoreError::Denied { ref code, .. } if code == "InvalidAccessKeyId"));
        let text = e.to_string();
        assert!(text.starts_with(
            "s3://b/k: the store refused the credentials (InvalidAccessKeyId: The AWS"
        ));
        assert!(
            text.contains("AWS_ACCESS_KEY_ID") && !text.contains("<?xml"),
            "{text}"
        );

        let missing = generic(
            "Error performing GET http://127.0.0.1:45979/nob?list-type=2 in 6ms - Server returned non-2xx status \
             code: 404 Not Found: <Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist\
             </Message></Error>",
        );
        let e = classify("s3://nob/k", "nob", &missing).unwrap();
        assert_eq!(
            e.to_string(),
            "s3://nob/k: bucket \"nob\" does not exist at http://127.0.0.1:45979; create it first, or fix the \
             bucket name in the URL or the endpoint (AWS_ENDPOINT_URL or storage_options' endpoint_url)"
        );

        let refused = generic(
            "Error performing list request: Error performing GET http://127.0.0.1:37503/b?list-type=2 in 13ms, \
             after 1 retries, max_retries: 1, retry_timeout: 180s  - HTTP error: error sending request",
        );
        let e = classify("s3://b/k", "b", &refused).unwrap();
        assert_eq!(
            e.to_string(),
            "s3://b/k: cannot connect to the object store at http://127.0.0.1:37503 (HTTP error: error sending \
             request, after 1 retries); check AWS_ENDPOINT_URL or storage_options' endpoint_url and that the \
             server is running and reachable from here"
        );
        assert!(classify("s3://b/k", "b", &generic("503 Slow Down")).is_none());
    }
}

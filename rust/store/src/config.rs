//! Building an S3 client: the standard `AWS_*` environment first, then the caller's `storage_options`, then
//! fastckpt's own transfer and retry settings.

use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::{BackoffConfig, RetryConfig};

use crate::error::{Result, StoreError};

/// How bytes move: part size and how many requests are in flight at once (memory is bounded by about
/// `concurrency * part_size` of request bodies: taken from mapped files without a copy, or serialized from tensor
/// memory into one buffer per request in flight).
#[derive(Debug, Clone, Copy)]
pub struct Transfer {
    /// Bytes per multipart part and per ranged read (S3 requires >= 5 MiB for all parts but the last).
    pub part_size: u64,
    /// Requests in flight at once, over every object of a call.
    pub concurrency: usize,
}

impl Default for Transfer {
    fn default() -> Self {
        Transfer {
            part_size: 16 << 20,
            concurrency: 16,
        }
    }
}

/// fastckpt's own `storage_options` keys (the rest go to object_store's S3 builder).
const OWN_KEYS: [&str; 5] = [
    "part_size",
    "concurrency",
    "max_retries",
    "retry_timeout",
    "retry_backoff",
];

fn parse<T: std::str::FromStr>(key: &str, value: &str) -> Result<T> {
    value.trim().parse().map_err(|_| {
        StoreError::Config(format!(
            "storage_options[{key:?}] = {value:?} is not a valid number"
        ))
    })
}

/// The S3 client for `bucket`, and the transfer settings, from the environment and `options`.
///
/// `options` keys: object_store's S3 keys (`aws_access_key_id`, `aws_secret_access_key`, `aws_session_token`,
/// `aws_region`, `aws_endpoint_url`, `aws_allow_http`, ... with or without the `aws_` prefix, any case), and
/// `part_size` (bytes, >= 5 MiB), `concurrency` (>= 1), `max_retries` (default 10), `retry_timeout` (seconds,
/// default 180), `retry_backoff` (first backoff in seconds, default 0.1; it doubles up to 15 s).
pub fn build(bucket: &str, options: &[(String, String)]) -> Result<(AmazonS3, Transfer)> {
    let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
    let mut transfer = Transfer::default();
    let mut retry = RetryConfig::default();
    let mut backoff = BackoffConfig::default();
    for (key, value) in options {
        let key = key.to_ascii_lowercase();
        match key.as_str() {
            "part_size" => transfer.part_size = parse(&key, value)?,
            "concurrency" => transfer.concurrency = parse(&key, value)?,
            "max_retries" => retry.max_retries = parse(&key, value)?,
            "retry_timeout" => retry.retry_timeout = Duration::from_secs_f64(parse(&key, value)?),
            "retry_backoff" => backoff.init_backoff = Duration::from_secs_f64(parse(&key, value)?),
            _ => {
                let parsed: AmazonS3ConfigKey = key.parse().map_err(|_| {
                    StoreError::Config(format!(
                        "storage_options key {key:?} is not an S3 setting (see object_store's AmazonS3ConfigKey, \
                         or one of {OWN_KEYS:?})"
                    ))
                })?;
                builder = builder.with_config(parsed, value);
            }
        }
    }
    if transfer.part_size < 5 << 20 || transfer.part_size > 5 << 30 {
        return Err(StoreError::Config(format!(
            "part_size {} is outside S3's limits for multipart parts (5 MiB to 5 GiB)",
            transfer.part_size
        )));
    }
    if transfer.concurrency == 0 {
        return Err(StoreError::Config("concurrency must be >= 1".into()));
    }
    retry.backoff = backoff;
    let store = builder
        .with_retry(retry)
        .build()
        .map_err(|e| StoreError::Config(format!("s3://{bucket}: {e}")))?;
    Ok((store, transfer))
}

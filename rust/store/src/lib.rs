//! fastckpt-store: checkpoints in object storage (`s3://` and S3-compatible stores: MinIO, Ceph, R2), on the
//! `object_store` crate (Apache Arrow) and a private tokio runtime. No pyo3; the bindings are one file in
//! `fastckpt-python`. Every call blocks the calling thread until done (the bindings release the GIL around it).
//!
//! - [`config`]: the S3 client from the standard `AWS_*` environment plus `storage_options`, bounded retries.
//! - [`transfer`]: parallel multipart uploads from mapped files or straight from tensor memory (a planned
//!   safetensors layout, each part serialized into its request body as it goes out), and ranged parallel reads
//!   into preallocated files, summing crc32c as the bytes go out and come in (the core's checksum fold).
//! - [`Store`]: small objects (manifests) with a conditional create, listing, deletes, aborting uploads.
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod config;
pub mod error;
pub mod transfer;

use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use object_store::aws::AmazonS3;
use object_store::multipart::MultipartStore;
use object_store::path::Path;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};

pub use config::Transfer;
pub use error::{Result, StoreError};
pub use transfer::{Download, Upload};

/// One bucket of an S3 API store, with the runtime its requests run on.
pub struct Store {
    bucket: String,
    s3: Arc<AmazonS3>,
    transfer: Transfer,
    runtime: tokio::runtime::Runtime,
}

impl Store {
    /// A client for `bucket`, configured by the `AWS_*` environment and `options` (see [`config::build`]).
    pub fn open(bucket: &str, options: &[(String, String)]) -> Result<Store> {
        let (s3, transfer) = config::build(bucket, options)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .thread_name("fastckpt-s3")
            .enable_all()
            .build()
            .map_err(|source| StoreError::Io {
                path: "tokio runtime".into(),
                source,
            })?;
        Ok(Store {
            bucket: bucket.to_string(),
            s3: Arc::new(s3),
            transfer,
            runtime,
        })
    }

    /// The transfer settings in force.
    pub fn transfer(&self) -> Transfer {
        self.transfer
    }

    /// `s3://bucket/key`, for messages.
    pub fn url(&self, key: &str) -> String {
        format!("s3://{}/{}", self.bucket, key)
    }

    fn fail(&self, key: &str, source: object_store::Error) -> StoreError {
        if let Some(known) = error::classify(&self.url(key), &self.bucket, &source) {
            return known; // a missing bucket answers 404 too: not "no such object"
        }
        match source {
            object_store::Error::NotFound { .. } => StoreError::NotFound { url: self.url(key) },
            object_store::Error::AlreadyExists { .. }
            | object_store::Error::Precondition { .. } => {
                StoreError::AlreadyExists { url: self.url(key) }
            }
            source => StoreError::Store {
                url: self.url(key),
                source,
            },
        }
    }

    /// The whole object at `key`, or `None` when there is none.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let path = Path::from(key);
        self.runtime.block_on(async {
            match self.s3.get(&path).await {
                Ok(got) => got
                    .bytes()
                    .await
                    .map(|b| Some(b.to_vec()))
                    .map_err(|e| self.fail(key, e)),
                Err(e @ object_store::Error::NotFound { .. }) => {
                    match error::classify(&self.url(key), &self.bucket, &e) {
                        Some(no_bucket) => Err(no_bucket), // a 404 for the bucket, not for the object
                        None => Ok(None),
                    }
                }
                Err(e) => Err(self.fail(key, e)),
            }
        })
    }

    /// Write `data` at `key`; with `create_only`, a conditional put (`If-None-Match: *`) that fails with
    /// [`StoreError::AlreadyExists`] when the object is there already (two savers cannot both win).
    pub fn put(&self, key: &str, data: Vec<u8>, create_only: bool) -> Result<()> {
        let path = Path::from(key);
        let mode = if create_only {
            PutMode::Create
        } else {
            PutMode::Overwrite
        };
        let opts = PutOptions {
            mode,
            ..Default::default()
        };
        self.runtime
            .block_on(self.s3.put_opts(&path, PutPayload::from(data), opts))
            .map(|_| ())
            .map_err(|e| self.fail(key, e))
    }

    /// Every object under `prefix` (a folder: `prefix/...`), as `(key, size in bytes)`, in key order.
    pub fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>> {
        let path = Path::from(prefix);
        let mut found: Vec<(String, u64)> = self.runtime.block_on(async {
            self.s3
                .list(Some(&path))
                .map_ok(|meta| (meta.location.to_string(), meta.size))
                .try_collect()
                .await
                .map_err(|e| self.fail(prefix, e))
        })?;
        found.sort();
        Ok(found)
    }

    /// The "sub-folders" directly under `prefix` (common prefixes of a delimited listing), as keys.
    pub fn list_dirs(&self, prefix: &str) -> Result<Vec<String>> {
        let path = Path::from(prefix);
        let listed = self
            .runtime
            .block_on(self.s3.list_with_delimiter(Some(&path)))
            .map_err(|e| self.fail(prefix, e))?;
        let mut dirs: Vec<String> = listed
            .common_prefixes
            .iter()
            .map(|p| p.to_string())
            .collect();
        dirs.sort();
        Ok(dirs)
    }

    /// Delete the objects at `keys` (absent ones are fine), in order, `concurrency` at a time.
    pub fn delete(&self, keys: &[String]) -> Result<()> {
        self.runtime.block_on(async {
            futures::stream::iter(keys.iter())
                .map(|key| async move {
                    match self.s3.delete(&Path::from(key.as_str())).await {
                        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                        Err(e) => Err(self.fail(key, e)),
                    }
                })
                .buffered(self.transfer.concurrency)
                .try_collect::<Vec<()>>()
                .await
                .map(|_| ())
        })
    }

    /// Abort the multipart upload `upload_id` of `key` (its parts are discarded; an unknown id is fine).
    pub fn abort_upload(&self, key: &str, upload_id: &str) -> Result<()> {
        let path = Path::from(key);
        match self
            .runtime
            .block_on(self.s3.abort_multipart(&path, &upload_id.to_string()))
        {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.fail(key, e)),
        }
    }
}

//! The temp file a written safetensors file goes to first: beside its target, removed on drop unless committed
//! (renamed over the target).

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, IoContext, Result};

/// The folder holding `path` (`.` for a bare file name).
pub(crate) fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// A temp file beside its target, removed on drop unless committed.
pub(crate) struct TempFile {
    pub(crate) path: PathBuf,
    pub(crate) file: File,
    pub(crate) committed: bool,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl TempFile {
    /// Create `.<target name>.<pid>.<n>.tmp` beside `target` with mode 0o666 & ~umask, or the target's mode
    /// when it already exists.
    pub(crate) fn create(target: &Path) -> Result<TempFile> {
        let name = target.file_name().ok_or_else(|| {
            Error::InvalidArgument(format!("{}: not a file path", target.display()))
        })?;
        let dir = parent_dir(target);
        let existing_mode = match fs::metadata(target) {
            Ok(m) => Some(m.permissions().mode() & 0o7777),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::io(target, "reading the existing file's mode", e)),
        };
        loop {
            let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
            let mut temp_name = OsString::from(".");
            temp_name.push(name);
            temp_name.push(format!(".{}.{n}.tmp", std::process::id()));
            let path = dir.join(temp_name);
            let opened = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o666)
                .open(&path);
            let file = match opened {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io(&path, "creating the temp file", e)),
            };
            let temp = TempFile {
                path,
                file,
                committed: false,
            };
            if let Some(mode) = existing_mode {
                temp.file
                    .set_permissions(fs::Permissions::from_mode(mode))
                    .at(&temp.path, "copying the existing file's mode to")?;
            }
            return Ok(temp);
        }
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

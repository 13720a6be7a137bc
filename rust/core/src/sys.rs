//! The few system calls std does not offer: vectored positional writes, preallocation, directory fsync,
//! `renameat2(RENAME_EXCHANGE)`, the process umask-free mode of an existing file, a non-blocking open that
//! refuses anything but a regular file.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// Most iovecs one `pwritev` call takes (Linux `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// Write all of `parts`, back to back, at `offset` in `file` with `pwritev`, retrying short writes and EINTR.
pub fn write_all_vectored_at(file: &File, parts: &[&[u8]], mut offset: u64) -> io::Result<()> {
    let mut iov: Vec<libc::iovec> = parts
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| libc::iovec {
            iov_base: p.as_ptr() as *mut libc::c_void,
            iov_len: p.len(),
        })
        .collect();
    let mut first = 0;
    while first < iov.len() {
        let batch = &iov[first..(first + IOV_MAX).min(iov.len())];
        // SAFETY: every iovec points into a live `&[u8]` from `parts` (borrowed for this call) with its exact
        // length; pwritev only reads them. The fd is owned by `file`, open for writing.
        let n = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                batch.as_ptr(),
                batch.len() as libc::c_int,
                offset as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev wrote 0 bytes",
            ));
        }
        let mut n = n as usize;
        offset += n as u64;
        while n > 0 {
            let v = &mut iov[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: n < iov_len, so the advanced pointer stays inside the same slice.
                v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) } as *mut libc::c_void;
                v.iov_len -= n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// Reserve `len` bytes for `file` (posix_fallocate); where the file system cannot, just set the length.
pub fn preallocate(file: &File, len: u64) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: plain syscall on an fd owned by `file`; no memory is passed.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
    match rc {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL => file.set_len(len),
        errno => Err(io::Error::from_raw_os_error(errno)),
    }
}

/// Open `path` for reading without ever blocking (a FIFO would wait for a writer: `O_NONBLOCK`), and refuse
/// anything but a regular file: a folder is `EISDIR`, a FIFO, socket or device is `EINVAL` ("not a regular
/// file"), so a reader never hangs on, or maps, something that is not a file.
pub fn open_regular(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    if kind.is_dir() {
        return Err(io::Error::from_raw_os_error(libc::EISDIR));
    }
    let what = if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a device"
    };
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("not a regular file ({what})"),
    ))
}

/// Ask the kernel to start writing `len` bytes at `offset` of `file` to the disk now (`sync_file_range` with
/// `SYNC_FILE_RANGE_WRITE`), without waiting for it. A durable write calls this after each chunk so that the
/// disk works while later chunks are still being copied into the page cache, and the final fsync finds most
/// of the file already written. Only a hint: file systems that do not support it are ignored.
pub fn start_writeback(file: &File, offset: u64, len: u64) {
    // SAFETY: plain syscall on an fd owned by `file`; no memory is passed. Errors are ignored on purpose.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// fsync a folder, so that a rename or a new entry in it is durable.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    let d = File::open(dir)?;
    d.sync_all()
}

fn cstring(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// Atomically swap `a` and `b` (both must exist) with `renameat2(RENAME_EXCHANGE)`.
pub fn rename_exchange(a: &Path, b: &Path) -> io::Result<()> {
    let (ca, cb) = (cstring(a)?, cstring(b)?);
    // SAFETY: both pointers are NUL-terminated strings alive for the call; AT_FDCWD makes them
    // relative to the working folder as with rename(2).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn vectored_write_lands_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("v"))
            .unwrap();
        let parts: Vec<Vec<u8>> = (0..3000u32)
            .map(|i| vec![(i % 251) as u8; (i % 5) as usize])
            .collect();
        let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
        write_all_vectored_at(&f, &refs, 3).unwrap();
        let want: Vec<u8> = parts.concat();
        let mut got = vec![0u8; want.len()];
        f.read_exact_at(&mut got, 3).unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn preallocate_sets_length() {
        let dir = tempfile::tempdir().unwrap();
        let f = File::create(dir.path().join("p")).unwrap();
        preallocate(&f, 12345).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 12345);
    }

    #[test]
    fn exchange_swaps() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, "A").unwrap();
        std::fs::write(&b, "B").unwrap();
        rename_exchange(&a, &b).unwrap();
        assert_eq!(std::fs::read_to_string(&a).unwrap(), "B");
        assert_eq!(std::fs::read_to_string(&b).unwrap(), "A");
        fsync_dir(dir.path()).unwrap();
    }
}

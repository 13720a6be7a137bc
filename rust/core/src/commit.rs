//! Putting a finished staging folder in place in one step: a plain rename when the target does not exist,
//! otherwise an atomic `renameat2(RENAME_EXCHANGE)` and removal of the old tree (now at the staging path).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};
use crate::sys;

/// Move `staging` to `target` atomically; see the module docs. When `durable`, fsync the parent folder(s)
/// after the rename so the new name survives a crash.
pub fn commit_dir(staging: &Path, target: &Path, durable: bool) -> Result<()> {
    let meta = fs::symlink_metadata(staging).at(staging, "reading the staging folder")?;
    if !meta.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "{}: the staging path is not a folder",
            staging.display()
        )));
    }
    let target_existed = put_in_place(staging, target)?;
    if durable {
        let (sp, tp) = (parent_dir(staging), parent_dir(target));
        sys::fsync_dir(&tp).at(&tp, "fsyncing the folder")?;
        if sp != tp {
            sys::fsync_dir(&sp).at(&sp, "fsyncing the folder")?;
        }
    }
    if target_existed {
        // The old tree now sits at `staging`.
        let old = fs::symlink_metadata(staging).at(staging, "reading the replaced tree")?;
        if old.is_dir() {
            remove_tree(staging).at(staging, "removing the replaced tree")?;
        } else {
            fs::remove_file(staging).at(staging, "removing the replaced file")?;
        }
    }
    Ok(())
}

/// `fs::remove_dir_all`, and when a read-only folder in the tree refuses it (a 0555 checkpoint folder of its
/// owner's), again after giving every folder in it owner write and search permission.
fn remove_tree(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            make_writable(path);
            fs::remove_dir_all(path)
        }
        other => other,
    }
}

fn make_writable(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = fs::symlink_metadata(dir) else {
        return;
    };
    if !meta.is_dir() {
        return;
    }
    let mode = meta.permissions().mode();
    if mode & 0o700 != 0o700 {
        let _ = fs::set_permissions(dir, fs::Permissions::from_mode(mode | 0o700));
    }
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            make_writable(&entry.path());
        }
    }
}

/// How often [`put_in_place`] retries when another process creates or removes `target` between our look and
/// our rename.
const ATTEMPTS: usize = 16;

/// Rename `staging` to `target` (when there is no target) or exchange them (when there is); returns whether a
/// target existed (its tree is then at `staging`). Another process may commit the same target at the same
/// moment: a plain rename that finds a non-empty folder there now (`ENOTEMPTY`/`EEXIST`) is retried as an
/// exchange, and an exchange that finds the target gone (`ENOENT`) as a rename, so two concurrent commits both
/// succeed and the later one wins whole.
fn put_in_place(staging: &Path, target: &Path) -> Result<bool> {
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let exists = match fs::symlink_metadata(target) {
            Ok(_) => true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(Error::io(target, "reading the target", e)),
        };
        let outcome = if exists {
            sys::rename_exchange(staging, target)
        } else {
            fs::rename(staging, target)
        };
        match outcome.map_err(|e| (e.raw_os_error(), e)) {
            Ok(()) => return Ok(exists),
            Err((Some(libc::ENOTEMPTY | libc::EEXIST), e)) if !exists => last = Some(e),
            Err((Some(libc::ENOENT), e)) if exists => last = Some(e),
            // File systems without RENAME_EXCHANGE: two renames, with the old tree parked at `staging`.
            Err((Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP), _)) if exists => {
                let parked = parked_name(staging);
                fs::rename(target, &parked).at(target, "moving the old tree aside from")?;
                fs::rename(staging, target).at(target, "renaming the staging folder to")?;
                fs::rename(&parked, staging).at(staging, "parking the old tree at")?;
                return Ok(true);
            }
            Err((_, e)) if exists => {
                return Err(Error::io(target, "exchanging the staging folder with", e))
            }
            Err((_, e)) => return Err(Error::io(target, "renaming the staging folder to", e)),
        }
    }
    let e = last.unwrap_or_else(|| io::Error::from_raw_os_error(libc::EBUSY));
    Err(Error::io(
        target,
        format!("putting the staging folder in place ({ATTEMPTS} attempts raced other writers)"),
        e,
    ))
}

/// `<staging>.old.<pid>`, beside the staging folder.
fn parked_name(staging: &Path) -> PathBuf {
    let mut name = staging.as_os_str().to_os_string();
    name.push(format!(".old.{}", std::process::id()));
    PathBuf::from(name)
}

fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(root: &Path, files: &[(&str, &str)]) {
        fs::create_dir_all(root).unwrap();
        for (name, text) in files {
            let p = root.join(name);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        }
    }

    #[test]
    fn renames_when_target_missing() {
        let d = tempfile::tempdir().unwrap();
        let (s, t) = (d.path().join("staging"), d.path().join("ckpt"));
        tree(&s, &[("a.safetensors", "new")]);
        commit_dir(&s, &t, true).unwrap();
        assert!(!s.exists());
        assert_eq!(fs::read_to_string(t.join("a.safetensors")).unwrap(), "new");
    }

    #[test]
    fn exchanges_and_removes_old_tree() {
        let d = tempfile::tempdir().unwrap();
        let (s, t) = (d.path().join("staging"), d.path().join("ckpt"));
        tree(&t, &[("old.bin", "old"), ("sub/x", "x")]);
        tree(&s, &[("new.bin", "new")]);
        commit_dir(&s, &t, false).unwrap();
        assert!(!s.exists(), "the old tree is removed");
        assert_eq!(fs::read_to_string(t.join("new.bin")).unwrap(), "new");
        assert!(!t.join("old.bin").exists());
    }

    #[test]
    fn concurrent_commits_of_one_new_target_both_succeed_and_one_wins_whole() {
        use std::sync::{Arc, Barrier};
        let d = tempfile::tempdir().unwrap();
        for round in 0..50 {
            let t = d.path().join(format!("ckpt{round}"));
            let barrier = Arc::new(Barrier::new(2));
            let handles: Vec<_> = ["a", "b"]
                .into_iter()
                .map(|who| {
                    let s = d.path().join(format!("staging-{who}-{round}"));
                    tree(&s, &[("who", who), ("sub/part", who)]);
                    let (t, barrier) = (t.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        let r = commit_dir(&s, &t, false);
                        (r.map_err(|e| e.to_string()), s.exists())
                    })
                })
                .collect();
            for h in handles {
                let (r, staging_left) = h.join().unwrap();
                assert_eq!(r, Ok(()), "round {round}");
                assert!(!staging_left, "round {round}: the replaced tree is removed");
            }
            let who = fs::read_to_string(t.join("who")).unwrap();
            assert_eq!(
                fs::read_to_string(t.join("sub/part")).unwrap(),
                who,
                "never a mix"
            );
            let mut names: Vec<_> = fs::read_dir(&t)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            names.sort();
            assert_eq!(names, ["sub", "who"]);
        }
    }

    #[test]
    fn missing_staging_is_io_error() {
        let d = tempfile::tempdir().unwrap();
        let e = commit_dir(&d.path().join("nope"), &d.path().join("t"), true).unwrap_err();
        match e {
            Error::Io { source, .. } => assert_eq!(source.raw_os_error(), Some(libc::ENOENT)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn staging_must_be_a_folder() {
        let d = tempfile::tempdir().unwrap();
        let s = d.path().join("file");
        fs::write(&s, "x").unwrap();
        let e = commit_dir(&s, &d.path().join("t"), true).unwrap_err();
        assert_eq!(e.kind(), "InvalidArgument");
    }
}

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
    let target_exists = match fs::symlink_metadata(target) {
        Ok(_) => true,
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => return Err(Error::io(target, "reading the target", e)),
    };
    if !target_exists {
        fs::rename(staging, target).at(target, "renaming the staging folder to")?;
    } else {
        match sys::rename_exchange(staging, target) {
            Ok(()) => {}
            // File systems without RENAME_EXCHANGE: two renames, with the old tree parked at `staging`.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)
                ) =>
            {
                let parked = parked_name(staging);
                fs::rename(target, &parked).at(target, "moving the old tree aside from")?;
                fs::rename(staging, target).at(target, "renaming the staging folder to")?;
                fs::rename(&parked, staging).at(staging, "parking the old tree at")?;
            }
            Err(e) => return Err(Error::io(target, "exchanging the staging folder with", e)),
        }
    }
    if durable {
        let (sp, tp) = (parent_dir(staging), parent_dir(target));
        sys::fsync_dir(&tp).at(&tp, "fsyncing the folder")?;
        if sp != tp {
            sys::fsync_dir(&sp).at(&sp, "fsyncing the folder")?;
        }
    }
    if target_exists {
        // The old tree now sits at `staging`.
        let old = fs::symlink_metadata(staging).at(staging, "reading the replaced tree")?;
        if old.is_dir() {
            fs::remove_dir_all(staging).at(staging, "removing the replaced tree")?;
        } else {
            fs::remove_file(staging).at(staging, "removing the replaced file")?;
        }
    }
    Ok(())
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
            assert_eq!(fs::read_to_string(t.join("sub/part")).unwrap(), who, "never a mix");
            let mut names: Vec<_> = fs::read_dir(&t).unwrap().map(|e| e.unwrap().file_name()).collect();
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

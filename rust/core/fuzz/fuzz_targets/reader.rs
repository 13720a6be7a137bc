//! libFuzzer target: arbitrary bytes written to a file on /dev/shm, opened, mapped, read with `read_into` and
//! summed with `checksum_files`; everything must agree with the parser. See `tests/support/hostile.rs`.
#![no_main]

use std::sync::OnceLock;

#[path = "../../tests/support/hostile.rs"]
mod hostile;

static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let dir = DIR.get_or_init(|| {
        tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
    });
    hostile::check_reader(dir.path(), data, 1);
});

//! libFuzzer target: the header parser on arbitrary bytes (an in-memory file). See `tests/support/hostile.rs`
//! for what must hold.
#![no_main]

#[path = "../../tests/support/hostile.rs"]
mod hostile;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    hostile::check_header(data);
});

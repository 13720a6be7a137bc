//! Hostile inputs: every file in `tests/fuzz_regressions/` (crashing inputs kept from fuzzing, and hand-made
//! malformed files) is replayed through the parser and the reader; the in-tree mutator's mutants of valid files
//! must be refused cleanly or accepted consistently (see `support/hostile.rs`). The long run is
//! `cargo test --release -p fastckpt-core --test hostile_inputs -- --ignored --nocapture` (docs/FUZZING.md).

#[path = "support/hostile.rs"]
mod hostile;
#[path = "support/mutate.rs"]
mod mutate;

use std::collections::BTreeMap;
use std::path::PathBuf;

fn regression_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fuzz_regressions");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_regression_file_is_refused_cleanly_or_read_consistently() {
    let files = regression_files();
    assert!(files.len() >= 20, "{} regression files", files.len());
    let dir = tempfile::tempdir().unwrap();
    for path in files {
        let data = std::fs::read(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let outcome = std::panic::catch_unwind(|| {
            hostile::check_header(&data);
            hostile::check_reader(dir.path(), &data, 2);
        });
        assert!(outcome.is_ok(), "{name} broke an invariant");
    }
}

#[test]
fn seeds_are_valid_files() {
    let dir = tempfile::tempdir().unwrap();
    for seed in mutate::seeds() {
        assert!(hostile::check_header(&seed).is_some());
        hostile::check_reader(dir.path(), &seed, 2);
    }
}

/// Run `runs` mutants (every `reader_every`-th also through the reader); returns how many ended how.
fn mutants(runs: u64, reader_every: u64, seed: u64) -> BTreeMap<&'static str, u64> {
    let seeds = mutate::seeds();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = mutate::Rng::new(seed);
    let mut outcomes = BTreeMap::new();
    for i in 0..runs {
        let mut input = seeds[rng.below(seeds.len())].clone();
        for _ in 0..1 + rng.below(2) {
            input = mutate::mutate(&mut rng, &input);
        }
        let kind = match fastckpt_core::parse_file(&input, hostile::LABEL) {
            Ok(_) => "accepted",
            Err(e) => e.kind(),
        };
        hostile::check_header(&input);
        if i % reader_every == 0 {
            hostile::check_reader(dir.path(), &input, 2);
        }
        *outcomes.entry(kind).or_insert(0) += 1;
    }
    outcomes
}

#[test]
fn mutants_are_refused_cleanly_or_accepted_consistently() {
    let outcomes = mutants(20_000, 20, 1);
    // The mutator reaches every verdict, so the invariants above were exercised on each path.
    for kind in ["accepted", "Header", "Truncated", "Dtype"] {
        assert!(outcomes.get(kind).copied().unwrap_or(0) > 0, "{outcomes:?}");
    }
}

#[test]
#[ignore = "long: run by hand, see docs/FUZZING.md"]
fn mutation_marathon() {
    let runs = std::env::var("FASTCKPT_FUZZ_RUNS").map_or(1_000_000, |v| v.parse().unwrap());
    let seed = std::env::var("FASTCKPT_FUZZ_SEED").map_or(7, |v| v.parse().unwrap());
    let outcomes = mutants(runs, 50, seed);
    println!("mutation marathon: {runs} inputs (seed {seed}), 0 crashes: {outcomes:?}");
}

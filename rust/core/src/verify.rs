//! Checking what a load reads against the checksums recorded when it was written: [`SafetensorsFile::verify`]
//! sums the bytes of the tensors a load will read (and the header, for the whole-file crc32c) by parallel
//! positional reads of at most [`PIECE`] bytes into a reused buffer, each summed while it is still in the CPU
//! cache, and refuses any difference with [`Error::Integrity`] naming the file and every damaged tensor. A load
//! calls it before it writes a byte into live memory, so a damaged checkpoint changes nothing; the bytes it read
//! stay in the page cache for the load's own reads. Bytes bound for fresh memory are summed as they are read
//! instead ([`SafetensorsFile::read_into_checked`]: one pass), and `verify` then skips those tensors
//! ([`Expected::summed`]).
//!
//! Why positional reads and not a mapping of the file, even when it is in the page cache (measured on the
//! 2-core development VM, 1 GiB file, warm, 2 threads, 8 MiB jobs, alternated, medians; RESULTS.md, "Loads"):
//! pread of 1 MiB (or 256 / 512 KiB) pieces + crc32c 0.041-0.054 s; a fresh read-only mapping of each job
//! (`MADV_SEQUENTIAL`) 0.045-0.094 s, with a `mincore` residency check first 0.053-0.105 s, `MADV_WILLNEED`
//! or `MADV_POPULATE_READ` slower still, one fresh mapping of the whole file 0.051-0.101 s; crc32c of the same
//! bytes in plain memory 0.026-0.030 s. A fresh mapping pays a page fault per 64 KiB (fault-around), which
//! costs about what the copy of a pread does, so it is never faster and often slower; cold it is slower too.
//! And a file another process truncates under a mapping raises SIGBUS on access, where a pread returns a short
//! count ([`Error::Truncated`]). The existing private mapping of [`SafetensorsFile`] cannot be summed
//! instead: its pages may have been written through views (copy-on-write), so they need not be the file's.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use crate::checksum::{crc32c_append, crc32c_combine, PIECE};
use crate::coalesce::{read_exact_at, runs};
use crate::error::{Error, Result};
use crate::pool;
use crate::readahead::with_readahead;
use crate::reader::SafetensorsFile;

/// The checksums a load expects of one file, as its manifest records them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    /// crc32c of every byte of the file; checked when `Some` (every tensor and the header are then read).
    pub file_crc32c: Option<u32>,
    /// `(tensor name, crc32c of its data bytes)` of the tensors to check, in any order.
    pub tensors: Vec<(String, u32)>,
    /// Where the values were recorded, for messages (`"fastckpt.json"`).
    pub recorded_in: String,
    /// `(tensor name, crc32c)` of tensors already summed as a load read them (and found equal to the record):
    /// not read again, their values enter the whole-file crc32c.
    pub summed: Vec<(String, u32)>,
}

/// What [`SafetensorsFile::verify`] read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Verified {
    /// Bytes read and summed.
    pub bytes: u64,
    /// Tensors whose crc32c was compared.
    pub tensors: usize,
}

/// One run of bytes to sum: the tensor it belongs to (`None`: the header) and its absolute range.
type Region = (Option<usize>, Range<u64>);

impl SafetensorsFile {
    /// Sum the bytes `expected` names (see [`Expected`]) in `chunk_bytes` positional reads by `threads`
    /// workers (0 = min(8, cores)) and compare them with the recorded values.
    ///
    /// Errors: [`Error::Integrity`] naming the file, each damaged tensor and both crc32c values (or the header,
    /// when only the whole-file crc32c differs); a recorded tensor the file lacks is [`Error::Integrity`] too.
    /// [`Error::Truncated`] / [`Error::Io`] when the file cannot be read.
    pub fn verify(
        &self,
        expected: &Expected,
        threads: usize,
        chunk_bytes: u64,
    ) -> Result<Verified> {
        if chunk_bytes == 0 {
            return Err(Error::InvalidArgument(
                "chunk_bytes must be at least 1".into(),
            ));
        }
        let path = self.path().display().to_string();
        let mut want: Vec<Option<u32>> = vec![None; self.tensors().len()];
        let mut absent = Vec::new();
        for (name, crc) in &expected.tensors {
            match self.tensor_index(name) {
                Some(i) => want[i] = Some(*crc),
                None => absent.push(format!(
                    "{path}: tensor {name:?} is recorded in {} but absent from the file",
                    expected.recorded_in
                )),
            }
        }
        if !absent.is_empty() {
            return Err(Error::Integrity(absent.join("\n")));
        }
        let mut known: Vec<Option<u32>> = vec![None; want.len()];
        for (name, crc) in &expected.summed {
            if let Some(i) = self.tensor_index(name) {
                known[i] = Some(*crc);
            }
        }
        let whole = expected.file_crc32c.is_some();
        let regions = self.regions(|i| whole || want[i].is_some());
        let unknown: Vec<Region> = regions
            .iter()
            .filter(|(t, _)| t.is_none_or(|i| known[i].is_none()))
            .cloned()
            .collect();
        let mut summed = self
            .sum_regions(&unknown, threads, chunk_bytes)?
            .into_iter();
        let crcs: Vec<u32> = regions
            .iter()
            .map(|(t, _)| match t.and_then(|i| known[i]) {
                Some(crc) => crc,
                None => summed.next().expect("one sum per unknown region"),
            })
            .collect();
        let mut got = vec![0u32; want.len()];
        let mut file_crc = 0u32;
        for ((tensor, range), crc) in regions.iter().zip(&crcs) {
            file_crc = crc32c_combine(file_crc, *crc, range.end - range.start);
            if let Some(i) = tensor {
                got[*i] = *crc;
            }
        }
        let mut problems = Vec::new();
        for (i, w) in want.iter().enumerate() {
            if let Some(w) = w.filter(|w| *w != got[i]) {
                problems.push(format!(
                    "{path}: tensor {:?}: crc32c {:08x} read, {w:08x} recorded in {} (the file is damaged)",
                    self.tensors()[i].name,
                    got[i],
                    expected.recorded_in
                ));
            }
        }
        if let Some(w) = expected
            .file_crc32c
            .filter(|w| *w != file_crc && problems.is_empty())
        {
            problems.push(format!(
                "{path}: crc32c {file_crc:08x} read, {w:08x} recorded in {} (outside every tensor: the header or \
                 its padding is damaged)",
                expected.recorded_in
            ));
        }
        if !problems.is_empty() {
            return Err(Error::Integrity(problems.join("\n")));
        }
        Ok(Verified {
            bytes: unknown.iter().map(|(_, r)| r.end - r.start).sum(),
            tensors: want.iter().filter(|w| w.is_some()).count(),
        })
    }

    /// [`read_into`](Self::read_into) that sums each target's bytes as they are read and compares them with
    /// `expect` (one recorded crc32c per target, `None`: not compared): the load's one pass over bytes bound
    /// for fresh memory. The targets hold the bytes read even when this fails, so they must be memory nobody
    /// uses yet.
    ///
    /// Errors: as [`read_into`](Self::read_into); [`Error::Integrity`] naming the file, every damaged tensor
    /// and both crc32c values; `expect` of another length than `targets` is [`Error::InvalidArgument`].
    pub fn read_into_checked(
        &self,
        targets: Vec<(String, &mut [u8])>,
        expect: &[Option<u32>],
        recorded_in: &str,
        threads: usize,
        chunk_bytes: u64,
    ) -> Result<()> {
        if expect.len() != targets.len() {
            return Err(Error::InvalidArgument(format!(
                "{}: {} recorded crc32c values for {} targets",
                self.path().display(),
                expect.len(),
                targets.len()
            )));
        }
        let names: Vec<String> = targets.iter().map(|(n, _)| n.clone()).collect();
        let got = self.read_into_summed(targets, threads, chunk_bytes)?;
        let problems: Vec<String> = names
            .iter()
            .zip(got.iter().zip(expect))
            .filter_map(|(name, (got, want))| {
                want.filter(|w| w != got).map(|w| {
                    format!(
                        "{}: tensor {name:?}: crc32c {got:08x} read, {w:08x} recorded in {recorded_in} (the file \
                         is damaged)",
                        self.path().display()
                    )
                })
            })
            .collect();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Error::Integrity(problems.join("\n")))
        }
    }

    /// The regions to sum in file order: the header and every tensor when `all` holds for each, else the
    /// tensors `pick` selects. With every tensor and the header they cover the whole file (a safetensors data
    /// section is its tensors, back to back).
    fn regions(&self, pick: impl Fn(usize) -> bool) -> Vec<Region> {
        let mut out: Vec<Region> = Vec::new();
        let start = self.data_start();
        if (0..self.tensors().len()).all(&pick) {
            out.push((None, 0..start));
        }
        for (i, t) in self.tensors().iter().enumerate() {
            if pick(i) {
                out.push((Some(i), start + t.begin..start + t.end));
            }
        }
        if let Some((_, last)) = out.last() {
            if out[0].0.is_none() && last.end < self.file_size() {
                out.push((None, last.end..self.file_size())); // bytes after the last tensor, if any
            }
        }
        out.sort_by_key(|(_, r)| r.start);
        out
    }

    /// The crc32c of each region, summed in parallel chunks and combined in order.
    fn sum_regions(
        &self,
        regions: &[Region],
        threads: usize,
        chunk_bytes: u64,
    ) -> Result<Vec<u32>> {
        let file = self.handle("verify")?;
        let mut jobs: Vec<(usize, Range<u64>)> = Vec::new();
        for (k, (_, r)) in regions.iter().enumerate() {
            let mut at = r.start;
            while at < r.end {
                let end = (at + chunk_bytes).min(r.end);
                jobs.push((k, at..end));
                at = end;
            }
        }
        let sums: Vec<OnceLock<u32>> = (0..jobs.len()).map(|_| OnceLock::new()).collect();
        let spans: Vec<(u64, u64)> = jobs.iter().map(|(_, r)| (r.start, r.end)).collect();
        // Touching jobs (small tensors back to back) form runs of up to `chunk_bytes`, each read in windows of
        // at most PIECE bytes that cross tensor boundaries (coalesce.rs): one read per MiB, not one per tensor.
        let runs = runs(&spans, chunk_bytes);
        let name = |k: usize| match regions[k].0 {
            Some(i) => format!("tensor {:?}", self.tensors()[i].name),
            None => "the header".into(),
        };
        with_readahead(&file, &spans, |done| {
            pool::run::<Vec<u8>, _>(threads, runs.len(), None, |buf, r| {
                let run = runs[r].clone();
                let run_end = spans[run.end - 1].1;
                // Positional reads of at most PIECE bytes into one reused buffer, each summed while it is still in
                // the CPU cache: from the page cache this costs a cache-hot copy (no page faults of a mapping, no
                // write to main memory), from the disk the read itself.
                let (mut win_at, mut win_len) = (0u64, 0usize);
                for j in run.clone() {
                    let range = &jobs[j].1;
                    let mut crc = 0u32;
                    let mut at = range.start;
                    while at < range.end {
                        if at >= win_at + win_len as u64 {
                            win_at = at;
                            win_len = PIECE.min((run_end - at) as usize);
                            if buf.len() < win_len {
                                buf.resize(win_len, 0);
                            }
                            // A short file names the region holding the first byte it lacks.
                            let what = || {
                                let end = file.metadata().map_or(0, |m| m.len()).max(win_at);
                                let k = run
                                    .clone()
                                    .find(|&i| spans[i].1 > end)
                                    .map_or(jobs[j].0, |i| jobs[i].0);
                                name(k)
                            };
                            read_exact_at(self.path(), &file, &mut buf[..win_len], win_at, what)?;
                        }
                        let n = (range.end.min(win_at + win_len as u64) - at) as usize;
                        let from = (at - win_at) as usize;
                        crc = crc32c_append(crc, &buf[from..from + n]);
                        at += n as u64;
                    }
                    sums[j].set(crc).expect("each job once");
                }
                done.fetch_add(run_end - spans[run.start].0, Ordering::Relaxed);
                Ok(())
            })
        })?;
        let mut out = vec![0u32; regions.len()];
        for ((k, range), sum) in jobs.iter().zip(sums) {
            let crc = sum.into_inner().expect("every job ran");
            out[*k] = crc32c_combine(out[*k], crc, range.end - range.start);
        }
        Ok(out)
    }
}

#[cfg(test)]
#[path = "verify_tests.rs"]
mod tests;

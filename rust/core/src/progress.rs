//! Per-tensor progress of a write that streams straight from live tensor memory, shared with the caller.
//!
//! An async save writes the parameters and optimizer state while training goes on; they do not change until the
//! next `optimizer.step()`. At that step the caller must know which tensors the writer has not finished, and take
//! them over: [`Progress::claim`] marks them so the writer starts no new read of their live memory, waits for the
//! reads already running, and returns them; the caller copies each into host memory and hands the copy over with
//! [`Progress::provide`]; the writer then writes the rest of that tensor from the copy. Only then may the step
//! change the live tensor.
//!
//! Tensors are numbered in the order the caller gives them: job 0's tensors in input order, then job 1's, and so
//! on (see [`crate::writer::write_files`]). A chunk of the writer may span several tensors: it takes all its
//! pieces at once or waits (so a chunk never holds a read of one tensor while waiting for another's copy, and
//! [`Progress::claim`] never waits for a writer that waits for it).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::job::FileJob;
use crate::layout::FileLayout;

/// Bytes of a tensor copied by the caller, in the tensor's logical (row-major) order.
pub type CopyBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

#[derive(Default)]
struct TensorProgress {
    nbytes: u64,
    /// Bytes not yet written to the file.
    left: u64,
    /// Chunks reading the live memory right now.
    readers: u32,
    /// The caller took the tensor over: no new live read may start.
    claimed: bool,
    /// The caller's copy, once provided: the rest is written from it.
    copy: Option<CopyBytes>,
}

struct State {
    tensors: Vec<TensorProgress>,
    aborted: Option<String>,
}

/// Progress of every tensor of one write; see the module docs.
pub struct Progress {
    state: Mutex<State>,
    changed: Condvar,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        let left = s.tensors.iter().filter(|t| t.left > 0).count();
        write!(
            f,
            "Progress({} tensors, {left} not written)",
            s.tensors.len()
        )
    }
}

/// Where a piece of a chunk is read from.
pub enum PieceSource {
    /// The live tensor memory (the writer's source).
    Live,
    /// The caller's copy of the whole tensor.
    Copy(CopyBytes),
}

/// The pieces of one chunk, taken with [`Progress::begin`]; [`ChunkGuard::finish`] marks them written, a drop
/// without it only ends the live reads (a failed write).
pub struct ChunkGuard<'p> {
    progress: &'p Progress,
    pieces: Vec<(usize, u64, bool)>,
    done: bool,
}

impl ChunkGuard<'_> {
    /// The chunk's bytes are in the file: count them as written and end the live reads.
    pub fn finish(mut self) {
        self.release(true);
        self.done = true;
    }

    fn release(&mut self, written: bool) {
        let mut s = self.progress.lock();
        for &(id, len, live) in &self.pieces {
            let t = &mut s.tensors[id];
            if live {
                t.readers -= 1;
            }
            if written {
                t.left -= len;
            }
        }
        drop(s);
        self.progress.changed.notify_all();
    }
}

impl Drop for ChunkGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.release(false);
        }
    }
}

impl Progress {
    /// Progress of tensors of `sizes` bytes (in the numbering of the module docs), none written yet.
    pub fn new(sizes: &[u64]) -> Self {
        let tensors = sizes
            .iter()
            .map(|&n| TensorProgress {
                nbytes: n,
                left: n,
                ..TensorProgress::default()
            })
            .collect();
        Progress {
            state: Mutex::new(State {
                tensors,
                aborted: None,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many tensors it tracks.
    pub fn len(&self) -> usize {
        self.lock().tensors.len()
    }

    /// Whether it tracks no tensor.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The size in bytes of tensor `id`.
    pub fn nbytes(&self, id: usize) -> Result<u64> {
        let s = self.lock();
        s.tensors
            .get(id)
            .map(|t| t.nbytes)
            .ok_or_else(|| out_of_range(id, s.tensors.len()))
    }

    /// Whether every byte of tensor `id` is in the file.
    pub fn is_written(&self, id: usize) -> Result<bool> {
        let s = self.lock();
        s.tensors
            .get(id)
            .map(|t| t.left == 0)
            .ok_or_else(|| out_of_range(id, s.tensors.len()))
    }

    /// Take the tensors `ids` over from the writer: those not yet written are marked (no new live read starts),
    /// then this waits until no chunk reads their live memory. Returns the ids taken (still not fully written
    /// after that wait), in the order given; the caller must [`provide`](Self::provide) a copy of each (or [`abort`](Self::abort)).
    pub fn claim(&self, ids: &[usize]) -> Result<Vec<usize>> {
        let mut s = self.lock();
        let n = s.tensors.len();
        if let Some(&bad) = ids.iter().find(|&&id| id >= n) {
            return Err(out_of_range(bad, n));
        }
        let mut taken = Vec::new();
        for &id in ids {
            let t = &mut s.tensors[id];
            if t.left > 0 && t.copy.is_none() && !t.claimed {
                t.claimed = true;
                taken.push(id);
            }
        }
        while taken.iter().any(|&id| s.tensors[id].readers > 0) {
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        // Finished by the reads it waited for: nothing left to copy.
        taken.retain(|&id| s.tensors[id].left > 0);
        Ok(taken)
    }

    /// Block until every tensor of `ids` is written (or the write aborted).
    pub fn wait_written(&self, ids: &[usize]) -> Result<()> {
        let mut s = self.lock();
        let n = s.tensors.len();
        if let Some(&bad) = ids.iter().find(|&&id| id >= n) {
            return Err(out_of_range(bad, n));
        }
        while s.aborted.is_none() && ids.iter().any(|&id| s.tensors[id].left > 0) {
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        Ok(())
    }

    /// Hand over the copy of a claimed tensor (exactly its size in bytes, in logical order).
    pub fn provide(&self, id: usize, copy: CopyBytes) -> Result<()> {
        let mut s = self.lock();
        let n = s.tensors.len();
        let t = s.tensors.get_mut(id).ok_or_else(|| out_of_range(id, n))?;
        if !t.claimed {
            return Err(Error::InvalidArgument(format!(
                "tensor {id} was not claimed; claim it before providing its copy"
            )));
        }
        let len = (*copy).as_ref().len() as u64;
        if len != t.nbytes {
            return Err(Error::InvalidArgument(format!(
                "the copy of tensor {id} holds {len} bytes, the tensor {}",
                t.nbytes
            )));
        }
        t.copy = Some(copy);
        drop(s);
        self.changed.notify_all();
        Ok(())
    }

    /// Stop the write: chunks waiting for a copy (and later ones) fail with `message`.
    pub fn abort(&self, message: &str) {
        self.lock()
            .aborted
            .get_or_insert_with(|| message.to_string());
        self.changed.notify_all();
    }

    /// Writer: take the pieces `(tensor id, length)` of one chunk, waiting while a piece's tensor is claimed and
    /// its copy not yet provided. Returns where each piece is read from, and the guard that ends the reads.
    pub fn begin(&self, pieces: &[(usize, u64)]) -> Result<(ChunkGuard<'_>, Vec<PieceSource>)> {
        let mut s = self.lock();
        let n = s.tensors.len();
        if let Some(&(bad, _)) = pieces.iter().find(|&&(id, _)| id >= n) {
            return Err(out_of_range(bad, n));
        }
        loop {
            if let Some(msg) = &s.aborted {
                return Err(Error::InvalidArgument(format!(
                    "the write was stopped: {msg}"
                )));
            }
            let blocked = pieces.iter().any(|&(id, _)| {
                let t = &s.tensors[id];
                t.claimed && t.copy.is_none()
            });
            if !blocked {
                break;
            }
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        let mut sources = Vec::with_capacity(pieces.len());
        let mut taken = Vec::with_capacity(pieces.len());
        for &(id, len) in pieces {
            let t = &mut s.tensors[id];
            match &t.copy {
                Some(c) => {
                    sources.push(PieceSource::Copy(c.clone()));
                    taken.push((id, len, false));
                }
                None => {
                    t.readers += 1;
                    sources.push(PieceSource::Live);
                    taken.push((id, len, true));
                }
            }
        }
        let guard = ChunkGuard {
            progress: self,
            pieces: taken,
            done: false,
        };
        Ok((guard, sources))
    }

    /// Writer: check that tensor `id` has `nbytes` bytes (the caller numbered the tensors as the writer does).
    pub fn check_size(&self, id: usize, nbytes: u64, name: &str) -> Result<()> {
        let have = self.nbytes(id)?;
        if have != nbytes {
            return Err(Error::InvalidArgument(format!(
                "progress tensor {id} ({name:?}) was declared with {have} bytes, the tensor has {nbytes}"
            )));
        }
        Ok(())
    }
}

/// `ids[f][i]`: the progress number of `layouts[f].tensors[i]` (tensors numbered in input order across jobs),
/// sizes checked against `progress`; empty without progress.
pub(crate) fn progress_ids(
    jobs: &[FileJob<'_>],
    layouts: &[FileLayout<'_>],
    progress: Option<&Progress>,
) -> Result<Vec<Vec<usize>>> {
    let Some(progress) = progress else {
        return Ok(Vec::new());
    };
    let total: usize = jobs.iter().map(|j| j.tensors.len()).sum();
    if progress.len() != total {
        return Err(Error::InvalidArgument(format!(
            "the progress tracks {} tensors, the write has {total}",
            progress.len()
        )));
    }
    let mut first = 0;
    let mut ids = Vec::with_capacity(jobs.len());
    for (job, layout) in jobs.iter().zip(layouts) {
        let position: std::collections::HashMap<&str, usize> = job
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), first + i))
            .collect();
        let mine = layout
            .tensors
            .iter()
            .map(|t| {
                let id = position[t.name.as_str()];
                progress.check_size(id, t.nbytes, &t.name).map(|()| id)
            })
            .collect::<Result<Vec<_>>>()?;
        ids.push(mine);
        first += job.tensors.len();
    }
    Ok(ids)
}

fn out_of_range(id: usize, n: usize) -> Error {
    Error::InvalidArgument(format!(
        "tensor {id} is out of range: the write has {n} tensors"
    ))
}

#[cfg(test)]
#[path = "progress_tests.rs"]
mod tests;

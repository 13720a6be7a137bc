//! A scoped worker pool over numbered jobs: workers pull the next job index from one shared counter, the
//! first error stops everyone, and the pool reports how many distinct threads did work.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::thread;

use crate::error::{Error, Result};

/// The default number of workers: min(8, cores).
pub fn default_threads() -> usize {
    thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8)
}

/// `threads`, or the default when 0.
pub fn resolve_threads(threads: usize) -> usize {
    if threads == 0 {
        default_threads()
    } else {
        threads
    }
}

/// What a pool run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolReport {
    /// Distinct OS threads that ran at least one job.
    pub threads_used: usize,
}

/// Run jobs `0..jobs` on up to `threads` workers (the calling thread alone when one is enough). Each worker
/// owns a `S::default()` state for its whole life. Returns the first error (in time) and skips the jobs not
/// yet started once one failed. `start_barrier`, for tests, is waited on by every worker after it took its
/// first job, proving the workers overlap; it must be sized to the worker count.
pub fn run<S, F>(
    threads: usize,
    jobs: usize,
    start_barrier: Option<&Barrier>,
    work: F,
) -> Result<PoolReport>
where
    S: Default,
    F: Fn(&mut S, usize) -> Result<()> + Sync,
{
    let workers = resolve_threads(threads).min(jobs);
    if workers == 0 {
        return Ok(PoolReport::default());
    }
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let used: Mutex<HashSet<thread::ThreadId>> = Mutex::new(HashSet::new());
    let worker = || {
        let mut state = S::default();
        let mut did_work = false;
        while !failed.load(Ordering::Relaxed) {
            let job = next.fetch_add(1, Ordering::Relaxed);
            if job >= jobs {
                break;
            }
            if !did_work {
                did_work = true;
                used.lock()
                    .expect("pool lock")
                    .insert(thread::current().id());
                if let Some(b) = start_barrier {
                    b.wait();
                }
            }
            if let Err(e) = work(&mut state, job) {
                failed.store(true, Ordering::Relaxed);
                first_error.lock().expect("pool lock").get_or_insert(e);
                break;
            }
        }
    };
    if workers == 1 {
        worker();
    } else {
        thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(worker);
            }
        });
    }
    if let Some(e) = first_error.into_inner().expect("pool lock") {
        return Err(e);
    }
    let threads_used = used.into_inner().expect("pool lock").len();
    Ok(PoolReport { threads_used })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn runs_every_job_once() {
        let sum = AtomicU64::new(0);
        let r = run::<(), _>(3, 100, None, |_, j| {
            sum.fetch_add(j as u64, Ordering::Relaxed);
            Ok(())
        })
        .unwrap();
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
        assert!(r.threads_used >= 1 && r.threads_used <= 3);
    }

    #[test]
    fn barrier_proves_all_workers_ran() {
        let barrier = Barrier::new(4);
        let r = run::<(), _>(4, 40, Some(&barrier), |_, _| Ok(())).unwrap();
        assert_eq!(r.threads_used, 4);
    }

    #[test]
    fn first_error_stops_the_pool() {
        let ran = AtomicUsize::new(0);
        let e = run::<(), _>(1, 10, None, |_, j| {
            ran.fetch_add(1, Ordering::Relaxed);
            if j == 3 {
                Err(Error::InvalidArgument(format!("job {j}")))
            } else {
                Ok(())
            }
        })
        .unwrap_err();
        assert_eq!(e.to_string(), "job 3");
        assert_eq!(ran.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn no_jobs_no_threads() {
        assert_eq!(
            run::<(), _>(4, 0, None, |_, _| Ok(()))
                .unwrap()
                .threads_used,
            0
        );
        assert_eq!(resolve_threads(3), 3);
        assert!(resolve_threads(0) >= 1 && resolve_threads(0) <= 8);
    }
}

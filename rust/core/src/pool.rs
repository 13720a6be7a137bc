//! A scoped worker pool over numbered jobs: workers pull the next job index from one shared counter, the
//! first error stops everyone, the error of the lowest-numbered failed job is returned, and the pool reports how
//! many distinct threads did work.

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
/// owns a `S::default()` state for its whole life. Once a job fails, the jobs not yet started are skipped and
/// the error of the lowest-numbered failed job is returned: every job numbered below a failed one was already
/// taken (the counter only grows), so when jobs follow file order the error names the first damage in the file
/// whatever the threads' timing. `start_barrier`, for tests, is waited on by every worker after it took its
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
    let first_error: Mutex<Option<(usize, Error)>> = Mutex::new(None);
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
                let mut first = first_error.lock().expect("pool lock");
                if first.as_ref().is_none_or(|(k, _)| job < *k) {
                    *first = Some((job, e));
                }
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
    if let Some((_, e)) = first_error.into_inner().expect("pool lock") {
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
    fn the_lowest_failed_job_is_reported_whichever_fails_first() {
        // Job 1 fails first; job 0 waits for it, then fails too: job 0's error is the one returned.
        for _ in 0..50 {
            let (tx, rx) = std::sync::mpsc::sync_channel::<()>(1);
            let rx = Mutex::new(rx);
            let e = run::<(), _>(2, 2, None, |_, j| {
                if j == 1 {
                    tx.send(()).unwrap();
                } else {
                    rx.lock().unwrap().recv().unwrap();
                }
                Err(Error::InvalidArgument(format!("job {j}")))
            })
            .unwrap_err();
            assert_eq!(e.to_string(), "job 0");
        }
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

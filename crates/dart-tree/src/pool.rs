//! The crate's one named thread pool (never rayon's global pool), for batched searches.
//!
//! Sized by `DART_NUM_THREADS` (else the number of CPUs) on first use, or by
//! [`set_num_threads`] before it. Fork safety: rayon's worker threads do not survive
//! `fork()`, so a child process that inherited a started pool would wait forever on it. The
//! pool remembers the pid that built it; in any other process the batch runs sequentially
//! on the calling thread (what huggingface/tokenizers does after a fork, minus the warning).
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use rayon::ThreadPool;

static POOL: OnceLock<(ThreadPool, u32)> = OnceLock::new();
static REQUESTED: AtomicUsize = AtomicUsize::new(0);

/// Threads the pool will use (or uses, once started).
pub fn num_threads() -> usize {
    if let Some((pool, _)) = POOL.get() {
        return pool.current_num_threads();
    }
    let req = REQUESTED.load(Ordering::Relaxed);
    if req > 0 {
        return req;
    }
    std::env::var("DART_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Set the pool size. Returns false (and changes nothing) once the pool has started.
pub fn set_num_threads(n: usize) -> bool {
    if POOL.get().is_some() {
        return false;
    }
    REQUESTED.store(n.max(1), Ordering::Relaxed);
    true
}

/// The pool, if it is usable from this process (None after a fork, or if threads could not
/// be spawned: callers then run sequentially).
pub(crate) fn pool() -> Option<&'static ThreadPool> {
    let (pool, pid) = POOL.get_or_init(|| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(num_threads())
            .thread_name(|i| format!("dart-tree-{i}"))
            .build()
            .or_else(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build())
            .expect("a one-thread pool");
        (pool, std::process::id())
    });
    (*pid == std::process::id()).then_some(pool)
}

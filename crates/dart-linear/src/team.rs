//! A team of spinning helper threads for [`crate::linear`]: the calling thread takes part 0
//! of a call and hands parts 1.. to helpers that spin on a generation counter between calls.
//!
//! Why not the rayon pool: a decoder forward makes ~120 calls of 20–200 µs each, with small
//! torch ops between them; waking a parked pool thread costs ~40 µs per call (two threads
//! over SmolLM2's 30 layers: 1 / 5 rows in 20 / 23 ms through a rayon scope, 14.8 / 17.3 ms
//! with no per-call hand-off at all). A helper spins for [`SPIN`] after its last part, then
//! parks until the next call unparks it.
//!
//! Fork safety: a forked child has none of the helper threads; [`Team::get`] notices the new
//! pid and starts a fresh team (the old one is leaked, as the pool in dart-ngram does).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a helper spins for the next call before it parks.
const SPIN: Duration = Duration::from_millis(2);

/// After this long spinning (a helper waiting for a call, the caller waiting for the helpers),
/// a thread yields its CPU between checks: when the scheduler has put two of the team's threads
/// on one CPU (a woken helper tends to start on its waker's CPU), a thread that only spins
/// keeps the other off it until the next scheduler tick (~4 ms).
const YIELD_AFTER: Duration = Duration::from_micros(50);

/// One call's work, `f(part)`: a `&(dyn Fn(usize) + Sync)` that lives on the caller's stack
/// until every part is done (its lifetime erased; see [`Team::run`]).
#[derive(Clone, Copy)]
struct Job(Option<&'static (dyn Fn(usize) + Sync)>);

/// What the caller hands every helper: the call's generation (one call at a time, see
/// [`Team::run`]) and its work.
struct Call {
    gen: AtomicU64,
    job: Mutex<Job>,
}

struct Helper {
    /// The last generation the helper finished.
    done: AtomicU64,
    sleeping: AtomicBool,
    thread: OnceLock<Thread>,
}

/// The helpers of a team of `helpers + 1` threads.
pub struct Team {
    call: Arc<Call>,
    helpers: Vec<Arc<Helper>>,
    pid: u32,
    busy: AtomicBool,
}

static TEAMS: Mutex<Vec<&'static Team>> = Mutex::new(Vec::new());

impl Team {
    /// The process's team of `threads` (>= 2) threads, started on first use.
    pub fn get(threads: usize) -> &'static Team {
        let pid = std::process::id();
        let mut teams = TEAMS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = teams.iter().find(|t| t.helpers.len() + 1 == threads && t.pid == pid) {
            return t;
        }
        teams.retain(|t| t.pid == pid); // a forked child's inherited teams have no threads
        let team: &'static Team = Box::leak(Box::new(Team::start(threads - 1, pid)));
        teams.push(team);
        team
    }

    fn start(helpers: usize, pid: u32) -> Team {
        let call = Arc::new(Call { gen: AtomicU64::new(0), job: Mutex::new(Job(None)) });
        let helpers: Vec<Arc<Helper>> = (0..helpers)
            .map(|i| {
                let h = Arc::new(Helper { done: AtomicU64::new(0), sleeping: AtomicBool::new(false), thread: OnceLock::new() });
                let (hc, cc) = (Arc::clone(&h), Arc::clone(&call));
                let handle = std::thread::Builder::new()
                    .name(format!("dart-linear-{}", i + 1))
                    .spawn(move || helper_loop(&cc, &hc, i + 1))
                    .expect("spawn a dart-linear helper thread");
                let _ = h.thread.set(handle.thread().clone());
                h
            })
            .collect();
        Team { call, helpers, pid, busy: AtomicBool::new(false) }
    }

    /// Threads of the team, the caller included.
    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Run `f(0)` on the calling thread and `f(1..threads)` on the helpers; return when all
    /// are done. A call made while another is running (another Python thread) runs every
    /// part on the calling thread instead.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.busy.swap(true, SeqCst) {
            for part in 0..self.threads() {
                f(part);
            }
            return;
        }
        // SAFETY: the helpers use `f` only for this generation, and this function returns
        // only after every helper has stored `done` for it (so `f` outlives every use).
        let job = Job(Some(unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(f) }));
        *self.call.job.lock().unwrap_or_else(|p| p.into_inner()) = job;
        let g = self.call.gen.fetch_add(1, SeqCst) + 1;
        for h in &self.helpers {
            if h.sleeping.load(SeqCst) {
                if let Some(t) = h.thread.get() {
                    t.unpark();
                }
            }
        }
        f(0);
        let since = Instant::now();
        let mut spins = 0u32;
        for h in &self.helpers {
            while h.done.load(SeqCst) < g {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(256) && since.elapsed() > YIELD_AFTER {
                    std::thread::yield_now();
                }
                std::hint::spin_loop();
            }
        }
        self.busy.store(false, SeqCst);
    }
}

fn helper_loop(call: &Call, h: &Helper, part: usize) {
    let mut seen = 0u64;
    loop {
        let mut since = Instant::now();
        let mut spins = 0u32;
        let g = loop {
            let g = call.gen.load(SeqCst);
            if g != seen {
                break g;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) {
                let waited = since.elapsed();
                if waited > SPIN {
                    h.sleeping.store(true, SeqCst);
                    if call.gen.load(SeqCst) == seen {
                        std::thread::park();
                    }
                    h.sleeping.store(false, SeqCst);
                    since = Instant::now();
                } else if waited > YIELD_AFTER {
                    std::thread::yield_now();
                }
            }
            std::hint::spin_loop();
        };
        let job = *call.job.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = job.0 {
            // A panicking part must still report done, or the caller would wait forever.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(part)));
        }
        seen = g;
        h.done.store(g, SeqCst);
    }
}

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

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a helper spins for the next call before it parks.
const SPIN: Duration = Duration::from_millis(2);

/// One call's work, `f(part)`: a `&(dyn Fn(usize) + Sync)` that lives on the caller's stack
/// until every part is done (its lifetime erased; see [`Team::run`]).
#[derive(Clone, Copy)]
struct Job(Option<&'static (dyn Fn(usize) + Sync)>);

struct Helper {
    /// Bumped by the caller for each call the helper takes part in.
    gen: AtomicU64,
    /// The last generation the helper finished.
    done: AtomicU64,
    job: Mutex<Job>,
    sleeping: AtomicBool,
    thread: OnceLock<Thread>,
}

/// The helpers of a team of `helpers + 1` threads.
pub struct Team {
    helpers: Vec<Arc<Helper>>,
    pid: u32,
    busy: AtomicUsize,
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
        let helpers: Vec<Arc<Helper>> = (0..helpers)
            .map(|i| {
                let h = Arc::new(Helper {
                    gen: AtomicU64::new(0),
                    done: AtomicU64::new(0),
                    job: Mutex::new(Job(None)),
                    sleeping: AtomicBool::new(false),
                    thread: OnceLock::new(),
                });
                let hc = Arc::clone(&h);
                let handle = std::thread::Builder::new()
                    .name(format!("dart-linear-{}", i + 1))
                    .spawn(move || helper_loop(&hc, i + 1))
                    .expect("spawn a dart-linear helper thread");
                let _ = h.thread.set(handle.thread().clone());
                h
            })
            .collect();
        Team { helpers, pid, busy: AtomicUsize::new(0) }
    }

    /// Threads of the team, the caller included.
    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Run `f(0)` on the calling thread and `f(1..threads)` on the helpers; return when all
    /// are done. A call made while another is running (another Python thread) runs every
    /// part on the calling thread instead.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.busy.compare_exchange(0, 1, SeqCst, SeqCst).is_err() {
            for part in 0..self.threads() {
                f(part);
            }
            return;
        }
        // SAFETY: the helpers use `f` only for this generation, and this function returns
        // only after every helper has stored `done` for it (so `f` outlives every use).
        let job = Job(Some(unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(f) }));
        let mut gens = Vec::with_capacity(self.helpers.len());
        for h in &self.helpers {
            *h.job.lock().unwrap_or_else(|p| p.into_inner()) = job;
            let g = h.gen.fetch_add(1, SeqCst) + 1;
            gens.push(g);
            if h.sleeping.load(SeqCst) {
                if let Some(t) = h.thread.get() {
                    t.unpark();
                }
            }
        }
        f(0);
        for (h, g) in self.helpers.iter().zip(gens) {
            while h.done.load(SeqCst) < g {
                std::hint::spin_loop();
            }
        }
        self.busy.store(0, SeqCst);
    }
}

fn helper_loop(h: &Helper, part: usize) {
    let mut seen = 0u64;
    loop {
        let mut since = Instant::now();
        let mut spins = 0u32;
        let g = loop {
            let g = h.gen.load(SeqCst);
            if g != seen {
                break g;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && since.elapsed() > SPIN {
                h.sleeping.store(true, SeqCst);
                if h.gen.load(SeqCst) == seen {
                    std::thread::park();
                }
                h.sleeping.store(false, SeqCst);
                since = Instant::now();
            }
            std::hint::spin_loop();
        };
        let job = *h.job.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = job.0 {
            // A panicking part must still report done, or the caller would wait forever.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(part)));
        }
        seen = g;
        h.done.store(g, SeqCst);
    }
}

//! A team of spinning helper threads for [`crate::linear`]: the calling thread takes part 0
//! of a call and hands parts 1.. to helpers that spin on a generation counter between calls.
//!
//! Why not the rayon pool: a decoder forward makes ~120 calls of 20–200 µs each, with small
//! torch ops between them; waking a parked pool thread costs ~40 µs per call (two threads
//! over SmolLM2's 30 layers: 1 / 5 rows in 20 / 23 ms through a rayon scope, 14.8 / 17.3 ms
//! with no per-call hand-off at all). A helper spins for [`SPIN`] after its last part, then
//! parks until the next call unparks it.
//!
//! Parts are claimed, not assigned: the caller and the helpers take the next unclaimed part of
//! the call from one counter, so when a helper is not running (a loaded machine, more threads
//! than CPUs) the caller does its part too instead of waiting a scheduler slice for it. A part
//! computes the same values whoever runs it, so the results are the same bits either way.
//!
//! Fork safety: a forked child has none of the helper threads; [`Team::get`] notices the new
//! pid and starts a fresh team (the old one is leaked, as the pool in dart-ngram does).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
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
    /// `generation << PART_BITS | next unclaimed part` of the current call: a thread owns a
    /// part once its compare-exchange moved this past it for the generation it saw.
    claim: AtomicU64,
    /// Parts of the current call that are done (by anyone).
    finished: AtomicUsize,
    /// A part panicked (the caller re-raises once every part is done).
    panicked: AtomicBool,
}

/// Low bits of [`Call::claim`] that hold the part index (teams have far fewer threads).
const PART_BITS: u32 = 16;

impl Call {
    /// Claim the next unclaimed part of generation `g` among `parts`; None when the call has
    /// moved on or every part is taken.
    fn claim(&self, g: u64, parts: usize) -> Option<usize> {
        let mut v = self.claim.load(SeqCst);
        loop {
            let part = (v & ((1 << PART_BITS) - 1)) as usize;
            if v >> PART_BITS != g || part >= parts {
                return None;
            }
            match self.claim.compare_exchange_weak(v, v + 1, SeqCst, SeqCst) {
                Ok(_) => return Some(part),
                Err(now) => v = now,
            }
        }
    }

    /// Run claimed `part` of generation `g` and count it done. A part claimed for `g` keeps
    /// the call from finishing, so the job read here is `g`'s.
    fn run_part(&self, part: usize) {
        let job = *self.job.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = job.0 {
            // A panicking part must still count as done, or the caller would wait forever.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(part))).is_err() {
                self.panicked.store(true, SeqCst);
            }
        }
        self.finished.fetch_add(1, SeqCst);
    }
}

struct Helper {
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
        let call = Arc::new(Call {
            gen: AtomicU64::new(0),
            job: Mutex::new(Job(None)),
            claim: AtomicU64::new(0),
            finished: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        });
        let parts = helpers + 1;
        let helpers: Vec<Arc<Helper>> = (0..helpers)
            .map(|i| {
                let h = Arc::new(Helper { sleeping: AtomicBool::new(false), thread: OnceLock::new() });
                let (hc, cc) = (Arc::clone(&h), Arc::clone(&call));
                let handle = std::thread::Builder::new()
                    .name(format!("dart-linear-{}", i + 1))
                    .spawn(move || helper_loop(&cc, &hc, parts))
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

    /// Run `f(0..threads)`, each part once, on the calling thread and the helpers (whichever
    /// claims a part first); return when all are done. A call made while another is running
    /// (another Python thread) runs every part on the calling thread instead. A panic in any
    /// part is raised here once every part is done.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.busy.swap(true, SeqCst) {
            for part in 0..self.threads() {
                f(part);
            }
            return;
        }
        let parts = self.threads();
        let call = &*self.call;
        // SAFETY: a helper calls `f` only for a part it claimed for this generation, and this
        // function returns only after every part is done (so `f` outlives every use).
        let job =
            Job(Some(unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(f) }));
        *call.job.lock().unwrap_or_else(|p| p.into_inner()) = job;
        call.finished.store(0, SeqCst);
        call.panicked.store(false, SeqCst);
        let g = call.gen.load(SeqCst) + 1;
        call.claim.store(g << PART_BITS, SeqCst);
        call.gen.store(g, SeqCst);
        for h in &self.helpers {
            if h.sleeping.load(SeqCst) {
                if let Some(t) = h.thread.get() {
                    t.unpark();
                }
            }
        }
        while let Some(part) = call.claim(g, parts) {
            call.run_part(part);
        }
        let since = Instant::now();
        let mut spins = 0u32;
        while call.finished.load(SeqCst) < parts {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && since.elapsed() > YIELD_AFTER {
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
        *call.job.lock().unwrap_or_else(|p| p.into_inner()) = Job(None);
        let panicked = call.panicked.load(SeqCst);
        self.busy.store(false, SeqCst);
        if panicked {
            panic!("a dart-linear part panicked");
        }
    }
}

fn helper_loop(call: &Call, h: &Helper, parts: usize) {
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
        while let Some(part) = call.claim(g, parts) {
            call.run_part(part);
        }
        seen = g;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_exactly_once_per_call() {
        for threads in [2usize, 3, 4] {
            let team = Team::get(threads);
            for call in 0..5000u64 {
                let counts: Vec<AtomicU64> = (0..threads).map(|_| AtomicU64::new(0)).collect();
                team.run(&|part| {
                    // uneven parts, so that claims interleave differently from call to call
                    if (call + part as u64).is_multiple_of(7) {
                        std::hint::black_box((0..2000).sum::<u64>());
                    }
                    counts[part].fetch_add(1, SeqCst);
                });
                assert!(counts.iter().all(|c| c.load(SeqCst) == 1), "threads {threads}, call {call}");
            }
        }
    }

    #[test]
    fn a_panicking_part_is_raised_after_every_part_is_done_and_the_team_goes_on() {
        let team = Team::get(5); // a team no other test uses (a busy team runs parts inline)
        let done = AtomicU64::new(0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            team.run(&|part| {
                if part == 1 {
                    panic!("part 1 fails");
                }
                std::thread::sleep(Duration::from_millis(5));
                done.fetch_add(1, SeqCst);
            })
        }));
        assert!(r.is_err());
        assert_eq!(done.load(SeqCst), 4, "the other parts ran to the end before the panic was raised");
        let after = AtomicU64::new(0);
        team.run(&|_| {
            after.fetch_add(1, SeqCst);
        });
        assert_eq!(after.load(SeqCst), 5);
    }
}

//! The one owned, named rayon pool of dartcore (`dart-ngram-N` threads), never the global
//! pool.
//!
//! * Size: [`set_num_threads`], else `DART_NUM_THREADS`, else the available parallelism.
//!   This module is the one reader of `DART_NUM_THREADS`; Python asks [`num_threads`] through
//!   the bindings. A value that is not an integer in 1..=[`MAX_THREADS`] is ignored (the
//!   available parallelism is used), with one warning on stderr naming the value; above
//!   [`MAX_THREADS`] it is capped at [`MAX_THREADS`].
//! * Fork safety: a forked child inherits the pool object but none of its threads, so a job
//!   sent to it would wait forever. The pool records the pid that built it; [`get`] in a
//!   different process leaks the stale pool (dropping it would signal threads that do not
//!   exist, possibly through a lock held at fork time) and builds a fresh one. This is the
//!   same idea as the fork hook of huggingface/tokenizers, without needing `pthread_atfork`.
//! * NUMA: [`numa_topology`] reads `<root>/devices/system/node/node*/cpulist` (root is `/sys`
//!   in production, injectable for tests); [`set_pin_node`] pins the workers of the next pool
//!   to the CPUs of one node.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rayon::ThreadPool;

use crate::error::{Error, Result};

struct State {
    pool: Option<Arc<ThreadPool>>,
    pid: u32,
    threads: Option<usize>,
    pin: Option<Vec<usize>>,
}

/// Upper bound of every thread count (API calls, `DART_NUM_THREADS`, a builder's own pool).
/// 4096 is above the hardware threads of the largest machines (2 sockets x 192 cores x 2
/// SMT = 768); beyond the cores, more threads only cost start-up and a 2 MiB stack each,
/// and an unbounded request (`threads=10**6`) would keep spawning until the OS refuses.
pub const MAX_THREADS: usize = 4096;

static STATE: Mutex<State> = Mutex::new(State { pool: None, pid: 0, threads: None, pin: None });

fn lock() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The configured thread count (API call, else `DART_NUM_THREADS`, else all CPUs).
pub fn num_threads() -> usize {
    let st = lock();
    configured(&st)
}

fn configured(st: &State) -> usize {
    if let Some(n) = st.threads {
        return n;
    }
    let available = available_cpus();
    match std::env::var("DART_NUM_THREADS") {
        Ok(v) => match parse_env_threads(&v) {
            Ok(Some(n)) => n,
            Ok(None) => available,
            Err(why) => {
                let n = if why.starts_with("is above") { MAX_THREADS } else { available };
                warn_once(&format!("dartcore: DART_NUM_THREADS={v:?} {why}; using {n} threads"));
                n
            }
        },
        Err(_) => available,
    }
}

/// CPUs this process may run on (affinity mask and cgroup quota), at least 1.
pub fn available_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The rule for `DART_NUM_THREADS`: empty means unset (`Ok(None)`); an integer in
/// 1..=[`MAX_THREADS`] is taken; anything else is an `Err` with the reason (the caller
/// warns and falls back; above the cap it caps).
pub fn parse_env_threads(v: &str) -> std::result::Result<Option<usize>, String> {
    let t = v.trim();
    if t.is_empty() {
        return Ok(None);
    }
    match t.parse::<u64>() {
        Ok(0) => Err(format!("is not a thread count (need an integer in 1..={MAX_THREADS})")),
        Ok(n) if n > MAX_THREADS as u64 => Err(format!("is above the cap of {MAX_THREADS} threads")),
        Ok(n) => Ok(Some(n as usize)),
        Err(_) => Err(format!("is not a thread count (need an integer in 1..={MAX_THREADS})")),
    }
}

fn warn_once(msg: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| eprintln!("{msg}"));
}

/// `n` if it is a valid thread count (1..=[`MAX_THREADS`]), else an error naming `what`.
pub fn check_threads(n: usize, what: &str) -> Result<usize> {
    if n == 0 || n > MAX_THREADS {
        return Err(Error::InvalidOption(format!(
            "{what} must be in 1..={MAX_THREADS} (more threads than cores only add start-up time), got {n}"
        )));
    }
    Ok(n)
}

/// Set the pool size; the pool is rebuilt on next use (jobs already running keep the old one).
pub fn set_num_threads(n: usize) -> Result<()> {
    check_threads(n, "thread count")?;
    let mut st = lock();
    st.threads = Some(n);
    st.pool = None;
    Ok(())
}

/// Pin the workers of the pool to `cpus` (`None`: no pinning). Rebuilds the pool on next use.
pub fn set_pin_cpus(cpus: Option<Vec<usize>>) {
    let mut st = lock();
    st.pin = cpus;
    st.pool = None;
}

/// Pin the workers to the CPUs of NUMA node `node` as read from `/sys`.
pub fn set_pin_node(node: usize) -> Result<()> {
    let topo = numa_topology(Path::new("/sys"));
    let n = topo
        .into_iter()
        .find(|n| n.id == node)
        .ok_or_else(|| Error::InvalidOption(format!("NUMA node {node} not found under /sys/devices/system/node")))?;
    set_pin_cpus(Some(n.cpus));
    Ok(())
}

/// The shared pool (built on first use, rebuilt after a fork or a size change).
pub fn get() -> Arc<ThreadPool> {
    let mut st = lock();
    let pid = std::process::id();
    if st.pid != pid {
        if let Some(stale) = st.pool.take() {
            // Inherited from the parent across fork(): its threads do not exist here.
            std::mem::forget(stale);
        }
        st.pid = pid;
    }
    if let Some(p) = &st.pool {
        return p.clone();
    }
    let n = configured(&st);
    let pin = st.pin.clone();
    let mut b = rayon::ThreadPoolBuilder::new().num_threads(n).thread_name(|i| format!("dart-ngram-{i}"));
    if let Some(cpus) = pin.filter(|c| !c.is_empty()) {
        b = b.start_handler(move |i| pin_current_thread(cpus[i % cpus.len()]));
    }
    // Building a pool only fails if the OS refuses to spawn threads; fall back to one thread.
    let pool = b
        .build()
        .or_else(|_| rayon::ThreadPoolBuilder::new().num_threads(1).thread_name(|i| format!("dart-ngram-{i}")).build())
        .expect("cannot spawn a single thread");
    let pool = Arc::new(pool);
    st.pool = Some(pool.clone());
    pool
}

/// `rayon::join` re-exported, for callers that run fork/join work inside [`get`]`().install`.
pub fn join<A, B, RA, RB>(a: A, b: B) -> (RA, RB)
where
    A: FnOnce() -> RA + Send,
    B: FnOnce() -> RB + Send,
    RA: Send,
    RB: Send,
{
    rayon::join(a, b)
}

fn pin_current_thread(cpu: usize) {
    if cpu >= libc::CPU_SETSIZE as usize {
        return;
    }
    // SAFETY: `cpu_set_t` is plain old data (all-zero is a valid empty set), CPU_SET writes
    // inside it (cpu < CPU_SETSIZE is checked above), and sched_setaffinity(0, ..) only
    // reads the set for the calling thread. Failure (e.g. CPU offline) is ignored: pinning
    // is an optimisation.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// One NUMA node: its id and CPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaNode {
    pub id: usize,
    pub cpus: Vec<usize>,
}

/// Read the NUMA topology below `sys_root` (`/sys` in production). Missing → empty.
pub fn numa_topology(sys_root: &Path) -> Vec<NumaNode> {
    let dir = sys_root.join("devices/system/node");
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut nodes: Vec<NumaNode> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let id: usize = name.strip_prefix("node")?.parse().ok()?;
            let list = std::fs::read_to_string(e.path().join("cpulist")).ok()?;
            Some(NumaNode { id, cpus: parse_cpulist(&list)? })
        })
        .collect();
    nodes.sort_by_key(|n| n.id);
    nodes
}

/// Parse a kernel cpulist ("0-3,8,10-11"). `None` if malformed.
pub fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if b < a || b - a > 1 << 16 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.trim().parse().ok()?),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_thread_rule() {
        assert_eq!(parse_env_threads(""), Ok(None));
        assert_eq!(parse_env_threads(" 3 "), Ok(Some(3)));
        assert_eq!(parse_env_threads("4096"), Ok(Some(4096)));
        for bad in ["0", "-2", "two", "1.5"] {
            assert!(parse_env_threads(bad).unwrap_err().starts_with("is not a thread count"), "{bad}");
        }
        assert!(parse_env_threads("1000000").unwrap_err().starts_with("is above"));
        assert!(check_threads(0, "threads").is_err() && check_threads(4097, "threads").is_err());
        assert_eq!(check_threads(7, "threads").unwrap(), 7);
    }

    #[test]
    fn cpulist() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("x"), None);
    }

    #[test]
    fn topology_from_injected_root() {
        let d = tempfile::tempdir().unwrap();
        for (n, l) in [(0, "0-1\n"), (1, "2,3\n")] {
            let p = d.path().join(format!("devices/system/node/node{n}"));
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("cpulist"), l).unwrap();
        }
        std::fs::create_dir_all(d.path().join("devices/system/node/power")).unwrap();
        let t = numa_topology(d.path());
        assert_eq!(t, vec![NumaNode { id: 0, cpus: vec![0, 1] }, NumaNode { id: 1, cpus: vec![2, 3] }]);
        assert!(numa_topology(&d.path().join("missing")).is_empty());
    }
}

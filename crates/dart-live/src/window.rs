//! The live window: the most recent tokens served, with their bigram and trigram counts and a
//! table from every two-token key to the positions that followed it.
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use crate::Error;

/// Separates documents in the window: no n-gram and no match crosses it. Never a token id
/// (ids are checked below the vocabulary, which is at most `u32::MAX`).
const SEP: u32 = u32::MAX;

/// The tables' hash: keys are token ids (one or two packed in a u64) that no client chooses
/// freely beyond what it sends, so a multiply-xorshift (as in Fx / rustc) instead of SipHash:
/// a third of an insert's time. A client that floods one bucket only slows its own worker's
/// layer, which is bounded.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        let h = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^ (h >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x100_0000_01B3);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = (self.0.rotate_left(5) ^ v as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub(crate) type Map<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Continuations kept as a sorted vector up to this many, as a hash table beyond (a frequent
/// context's vector would move kilobytes on every insert).
const SMALL: usize = 48;

/// Continuation counts of one context: (token, count) pairs and their sum.
///
/// Most contexts have one continuation, kept inline in `one` (no heap access beyond the
/// table's own entry: an insert is mostly cache misses, one per table entry and buffer it
/// touches); a second one moves both to `small`, a sorted vector up to [`SMALL`] entries, then
/// to `big`, a boxed hash table (boxed: an entry of every context stays small).
#[derive(Debug, Clone, Default)]
pub(crate) struct Counts {
    pub(crate) total: u64,
    one: (u32, u32),        // the only continuation while `small` is empty and `big` is None
    small: Vec<(u32, u32)>, // sorted by token while `big` is None
    big: Option<Box<Map<u32, u32>>>,
}

impl Counts {
    fn add(&mut self, v: u32) {
        self.total += 1;
        if let Some(m) = &mut self.big {
            *m.entry(v).or_insert(0) += 1;
            return;
        }
        if self.small.is_empty() {
            if self.one.1 == 0 || self.one.0 == v {
                self.one = (v, self.one.1 + 1);
                return;
            }
            let first = std::mem::take(&mut self.one);
            self.small = if first.0 < v { vec![first, (v, 1)] } else { vec![(v, 1), first] };
            return;
        }
        match self.small.binary_search_by_key(&v, |e| e.0) {
            Ok(i) => self.small[i].1 += 1,
            Err(i) if self.small.len() < SMALL => self.small.insert(i, (v, 1)),
            Err(_) => {
                let mut m: Map<u32, u32> = self.small.drain(..).collect();
                m.insert(v, 1);
                self.small = Vec::new();
                self.big = Some(Box::new(m));
            }
        }
    }

    /// Remove one occurrence of `v`; true when the context is left with no continuation.
    fn remove(&mut self, v: u32) -> bool {
        if let Some(m) = &mut self.big {
            if let Some(c) = m.get_mut(&v) {
                self.total -= 1;
                *c -= 1;
                if *c == 0 {
                    m.remove(&v);
                }
            }
            return m.is_empty();
        }
        if self.small.is_empty() {
            if self.one.1 > 0 && self.one.0 == v {
                self.total -= 1;
                self.one.1 -= 1;
            }
            return self.one.1 == 0;
        }
        if let Ok(i) = self.small.binary_search_by_key(&v, |e| e.0) {
            self.total -= 1;
            self.small[i].1 -= 1;
            if self.small[i].1 == 0 {
                self.small.remove(i);
            }
        }
        self.small.is_empty()
    }

    pub(crate) fn get(&self, v: u32) -> Option<u32> {
        match &self.big {
            Some(m) => m.get(&v).copied(),
            None if self.small.is_empty() => (self.one.1 > 0 && self.one.0 == v).then_some(self.one.1),
            None => self.small.binary_search_by_key(&v, |e| e.0).ok().map(|i| self.small[i].1),
        }
    }

    /// Every (token, count), in no particular order.
    pub(crate) fn entries(&self) -> Box<dyn Iterator<Item = (u32, u32)> + '_> {
        match &self.big {
            Some(m) => Box::new(m.iter().map(|(&t, &c)| (t, c))),
            None if self.small.is_empty() => Box::new((self.one.1 > 0).then_some(self.one).into_iter()),
            None => Box::new(self.small.iter().copied()),
        }
    }

    /// The largest count(v)/total (0 when empty).
    pub(crate) fn max_prob(&self) -> f64 {
        let m = self.entries().map(|e| e.1).max().unwrap_or(0);
        if self.total == 0 {
            0.0
        } else {
            m as f64 / self.total as f64
        }
    }

    fn nbytes(&self) -> usize {
        use std::mem::size_of;
        self.small.capacity() * size_of::<(u32, u32)>()
            + self.big.as_ref().map_or(0, |m| size_of::<Map<u32, u32>>() + m.capacity() * (size_of::<(u32, u32)>() + 1))
    }
}

pub(crate) fn key2(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

/// A two-token context (a, b): its continuation counts and where it occurred. One table for
/// both: an insert or eviction looks the key up once, not twice (insert of a 128-token output
/// with two tables ~20 % slower, tools/bench_live.py).
#[derive(Debug, Clone, Default)]
pub(crate) struct Tri {
    pub(crate) counts: Counts,
    /// Absolute positions p such that tokens[p-2..p] = (a, b), oldest first: the oldest inline
    /// (most keys occur once), the others in `rest`; as many as `counts.total`.
    first: u64,
    rest: VecDeque<u64>,
}

impl Tri {
    fn push(&mut self, t: u32, q: u64) {
        if self.counts.total == 0 {
            self.first = q;
        } else {
            self.rest.push_back(q);
        }
        self.counts.add(t);
    }

    /// Drop the oldest occurrence (at `p`, followed by `t`); true when none is left.
    fn pop(&mut self, t: u32, p: u64) -> bool {
        debug_assert_eq!(self.first, p);
        let _ = p;
        self.counts.remove(t);
        match self.rest.pop_front() {
            Some(q) => {
                self.first = q;
                false
            }
            None => true,
        }
    }

    /// Positions, latest first.
    fn latest_first(&self) -> impl Iterator<Item = u64> + '_ {
        self.rest.iter().rev().copied().chain((self.counts.total > 0).then_some(self.first))
    }
}

/// One operation on the window, replayed on both copies of a [`crate::LiveLayer`].
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Insert(Vec<u32>),
    Clear,
}

/// The window itself (one copy). Positions are absolute (`base` is the position of
/// `tokens[0]`), so entries of the key table stay valid while the front is evicted.
#[derive(Debug, Clone)]
pub struct Window {
    capacity: usize,
    vocab: u32,
    tokens: VecDeque<u32>,
    base: u64,
    pub(crate) bi: Map<u32, Counts>,
    pub(crate) tri: Map<u64, Tri>,
    inserted: u64,
}

/// Most earlier occurrences of the two-token key examined per suffix query (latest first).
const MAX_PROBES: usize = 64;

impl Window {
    /// An empty window keeping at most `capacity` tokens (separators included) of ids below
    /// `vocab`.
    pub fn new(capacity: usize, vocab: u32) -> Result<Self, Error> {
        if capacity < 4 {
            return Err(Error::Param { name: "capacity", value: capacity as f64, why: "must be at least 4 tokens" });
        }
        if vocab == 0 {
            return Err(Error::Param { name: "vocab_size", value: 0.0, why: "must be positive" });
        }
        Ok(Window {
            capacity,
            vocab,
            tokens: VecDeque::new(),
            base: 0,
            bi: Map::default(),
            tri: Map::default(),
            inserted: 0,
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn vocab_size(&self) -> u32 {
        self.vocab
    }

    /// Tokens (and separators) in the window now.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Tokens inserted since creation or the last clear (evicted ones included).
    pub fn inserted(&self) -> u64 {
        self.inserted
    }

    /// Check a sequence before it changes anything.
    pub fn check(&self, ids: &[u32]) -> Result<(), Error> {
        if let Some((i, &t)) = ids.iter().enumerate().find(|(_, &t)| t >= self.vocab) {
            return Err(Error::TokenOutOfVocab { position: i, token: t, vocab: self.vocab });
        }
        Ok(())
    }

    pub(crate) fn apply(&mut self, op: &Op) {
        match op {
            Op::Insert(ids) => self.insert(ids),
            Op::Clear => self.clear(),
        }
    }

    fn at(&self, p: u64) -> u32 {
        self.tokens[(p - self.base) as usize]
    }

    fn end(&self) -> u64 {
        self.base + self.tokens.len() as u64
    }

    /// Append one document (checked with [`Window::check`]); the oldest tokens leave first.
    pub(crate) fn insert(&mut self, ids: &[u32]) {
        if ids.is_empty() {
            return;
        }
        // A document longer than the window keeps its last capacity - 1 tokens.
        let ids = &ids[ids.len().saturating_sub(self.capacity - 1)..];
        if !self.tokens.is_empty() {
            self.push(SEP);
        }
        for &t in ids {
            self.push(t);
        }
        self.inserted += ids.len() as u64;
    }

    fn push(&mut self, t: u32) {
        while self.tokens.len() >= self.capacity {
            self.evict();
        }
        let q = self.end();
        self.tokens.push_back(t);
        if t == SEP || q < self.base + 1 {
            return;
        }
        let b = self.at(q - 1);
        if b == SEP {
            return;
        }
        self.bi.entry(b).or_default().add(t);
        if q < self.base + 2 {
            return;
        }
        let a = self.at(q - 2);
        if a == SEP {
            return;
        }
        self.tri.entry(key2(a, b)).or_default().push(t, q);
    }

    /// Drop the oldest token and every n-gram that starts with it.
    fn evict(&mut self) {
        let p = self.base;
        let end = self.end();
        let a = self.at(p);
        if a != SEP && p + 1 < end {
            let b = self.at(p + 1);
            if b != SEP {
                if self.bi.get_mut(&a).is_some_and(|c| c.remove(b)) {
                    self.bi.remove(&a);
                }
                if p + 2 < end {
                    let c = self.at(p + 2);
                    if c != SEP {
                        let k = key2(a, b);
                        if self.tri.get_mut(&k).is_some_and(|e| e.pop(c, p + 2)) {
                            self.tri.remove(&k);
                        }
                    }
                }
            }
        }
        self.tokens.pop_front();
        self.base += 1;
    }

    pub(crate) fn clear(&mut self) {
        self.base = self.end();
        self.tokens.clear();
        self.bi.clear();
        self.tri.clear();
        self.inserted = 0;
    }

    /// The continuation (at most `max_len` tokens) of the longest earlier match, of at least
    /// `min_match` and at most `max_match` tokens, of the end of `context` in the window: the
    /// tokens that followed it, up to the end of that document. Ties go to the latest match.
    /// Empty when nothing matches. Examines at most 64 occurrences of the last two tokens.
    pub fn suffix_match(&self, context: &[u32], max_len: usize, min_match: usize, max_match: usize) -> Vec<u32> {
        let n = context.len();
        if n < 2 || max_len == 0 || max_match < 2 || min_match > max_match {
            return Vec::new();
        }
        let Some(hits) = self.tri.get(&key2(context[n - 2], context[n - 1])) else {
            return Vec::new();
        };
        let end = self.end();
        let mut best: Option<(usize, u64)> = None;
        for q in hits.latest_first().take(MAX_PROBES) {
            if q >= end || self.at(q) == SEP {
                continue; // the key ends the window or its document: nothing follows
            }
            // q - 2, q - 1 hold the key; extend backwards.
            let mut m = 2usize;
            while m < max_match.min(n) && q > self.base + m as u64 {
                let w = self.at(q - 1 - m as u64);
                if w == SEP || w != context[n - 1 - m] {
                    break;
                }
                m += 1;
            }
            if best.is_none_or(|(bm, _)| m > bm) {
                best = Some((m, q));
                if m >= max_match.min(n) {
                    break;
                }
            }
        }
        match best {
            Some((m, q)) if m >= min_match.max(2) => {
                let mut out = Vec::with_capacity(max_len);
                let mut p = q;
                while p < end && out.len() < max_len {
                    let t = self.at(p);
                    if t == SEP {
                        break;
                    }
                    out.push(t);
                    p += 1;
                }
                out
            }
            _ => Vec::new(),
        }
    }

    /// Bytes held by the window's tables (capacity of their allocations, approximate for the
    /// hash maps: entries plus one control byte each).
    pub fn nbytes(&self) -> usize {
        use std::mem::size_of;
        let map = |cap: usize, entry: usize| cap * (entry + 1);
        let counts = |c: &Counts| c.nbytes();
        self.tokens.capacity() * 4
            + map(self.bi.capacity(), size_of::<(u32, Counts)>())
            + self.bi.values().map(counts).sum::<usize>()
            + map(self.tri.capacity(), size_of::<(u64, Tri)>())
            + self.tri.values().map(|e| counts(&e.counts) + e.rest.capacity() * 8).sum::<usize>()
    }

    /// The documents held now, oldest first (the first may have lost its front to eviction):
    /// exactly the token runs whose n-grams the window counts.
    pub fn documents(&self) -> impl Iterator<Item = Vec<u32>> + '_ {
        let (x, y) = self.tokens.as_slices();
        let mut all = x.iter().chain(y).copied().peekable();
        std::iter::from_fn(move || {
            all.peek()?;
            let doc: Vec<u32> = all.by_ref().take_while(|&t| t != SEP).collect();
            Some(doc)
        })
        .filter(|d| !d.is_empty())
    }

    /// The last tokens of the window (at most `n`), separators as `u32::MAX`; for tests.
    pub fn tail(&self, n: usize) -> Vec<u32> {
        self.tokens.iter().skip(self.tokens.len().saturating_sub(n)).copied().collect()
    }
}

//! The live window: the most recent tokens served, with their bigram and trigram counts and a
//! table from every two-token key to the positions that followed it.
use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use crate::table::KeyTable;
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

/// Continuations kept as a sorted vector up to this many (two cache lines), as a hash table
/// beyond (a frequent context's vector would move kilobytes on every insert, and a binary
/// search over a longer one misses the cache more often than a hash lookup).
const SMALL: usize = 16;

/// The continuations of a context with more than [`SMALL`] of them: their counts, and how
/// many have each count (`hist[c]`, c in 1..=`max`, `max` the largest count), so that the
/// largest count (for [`Counts::max_prob`]) is kept exactly in O(1) per change instead of a
/// scan of thousands of entries per search.
#[derive(Debug, Clone, Default)]
struct Big {
    map: Map<u32, u32>,
    hist: Vec<u32>,
    max: u32,
}

impl Big {
    fn new(entries: impl Iterator<Item = (u32, u32)>) -> Self {
        let mut b = Big::default();
        for (t, c) in entries {
            b.map.insert(t, c);
            b.count(c, 1);
        }
        b
    }

    /// One more (`up`) or one fewer continuation with count `c` (>= 1). A change of one
    /// continuation's count adds the new count first, so `max` moves by at most one.
    fn count(&mut self, c: u32, up: u32) {
        let c = c as usize;
        if up == 1 {
            if self.hist.len() <= c {
                self.hist.resize(c + 1, 0);
            }
            self.hist[c] += 1;
            self.max = self.max.max(c as u32);
        } else {
            self.hist[c] -= 1;
            while self.max > 0 && self.hist[self.max as usize] == 0 {
                self.max -= 1;
            }
            self.hist.truncate(self.max as usize + 1);
        }
    }

    fn add(&mut self, v: u32) {
        let c = self.map.entry(v).or_insert(0);
        *c += 1;
        let c = *c;
        self.count(c, 1); // first: the largest count never drops below c meanwhile
        if c > 1 {
            self.count(c - 1, 0);
        }
    }

    /// Remove one occurrence of `v` (if any).
    fn remove(&mut self, v: u32) -> bool {
        let Entry::Occupied(mut e) = self.map.entry(v) else {
            return false;
        };
        let c = *e.get();
        if c > 1 {
            *e.get_mut() = c - 1;
            self.count(c - 1, 1);
        } else {
            e.remove();
        }
        self.count(c, 0);
        true
    }
}

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
    big: Option<Box<Big>>,
}

impl Counts {
    fn add(&mut self, v: u32) {
        self.total += 1;
        if let Some(m) = &mut self.big {
            m.add(v);
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
                let mut m = Big::new(std::mem::take(&mut self.small).into_iter());
                m.add(v);
                self.big = Some(Box::new(m));
            }
        }
    }

    /// Remove one occurrence of `v`; true when the context is left with no continuation.
    fn remove(&mut self, v: u32) -> bool {
        if let Some(m) = &mut self.big {
            if m.remove(v) {
                self.total -= 1;
            }
            return m.map.is_empty();
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

    /// Bring what [`Counts::add`] or [`Counts::remove`] of `v` will touch into the cache: the
    /// hash table's entry (looked up), or the vector (prefetched).
    fn warm(&self, v: u32) -> u64 {
        if let Some(m) = &self.big {
            let c = m.map.get(&v).copied().unwrap_or(0);
            prefetch(m.hist.as_ptr().wrapping_add(c as usize));
            prefetch(&m.max); // the box may span two lines
            return c.into();
        }
        if !self.small.is_empty() {
            let p = self.small.as_ptr();
            prefetch(p);
            prefetch(p.wrapping_add(8));
        }
        self.total
    }

    pub(crate) fn get(&self, v: u32) -> Option<u32> {
        match &self.big {
            Some(m) => m.map.get(&v).copied(),
            None if self.small.is_empty() => (self.one.1 > 0 && self.one.0 == v).then_some(self.one.1),
            None => self.small.binary_search_by_key(&v, |e| e.0).ok().map(|i| self.small[i].1),
        }
    }

    /// Every (token, count), in no particular order.
    pub(crate) fn entries(&self) -> Box<dyn Iterator<Item = (u32, u32)> + '_> {
        match &self.big {
            Some(m) => Box::new(m.map.iter().map(|(&t, &c)| (t, c))),
            None if self.small.is_empty() => Box::new((self.one.1 > 0).then_some(self.one).into_iter()),
            None => Box::new(self.small.iter().copied()),
        }
    }

    /// The largest count(v)/total (0 when empty).
    pub(crate) fn max_prob(&self) -> f64 {
        let m = match &self.big {
            Some(m) => m.max,
            None if self.small.is_empty() => self.one.1,
            None => self.small.iter().map(|e| e.1).max().unwrap_or(0),
        };
        if self.total == 0 {
            0.0
        } else {
            m as f64 / self.total as f64
        }
    }

    fn nbytes(&self) -> usize {
        use std::mem::size_of;
        self.small.capacity() * size_of::<(u32, u32)>()
            + self.big.as_ref().map_or(0, |m| {
                size_of::<Big>() + m.map.capacity() * (size_of::<(u32, u32)>() + 1) + m.hist.capacity() * 4
            })
    }
}

/// Ids below this have their bigram counts in a vector indexed by the id (no hash lookup: one
/// cache line read instead of a probe and an entry); larger ones in a table.
const DIRECT: u32 = 1 << 18;

/// The bigram counts of every context token b seen followed by something: `direct[b]` for b
/// below [`DIRECT`] (the vector grows to the largest such id seen; an empty entry is an unseen
/// context), `far` beyond.
#[derive(Debug, Clone, Default)]
pub(crate) struct Bigrams {
    direct: Vec<Counts>,
    far: Map<u32, Counts>,
}

impl Bigrams {
    /// b's counts, None where nothing follows b in the window.
    pub(crate) fn get(&self, b: u32) -> Option<&Counts> {
        let c = if b < DIRECT { self.direct.get(b as usize) } else { self.far.get(&b) };
        c.filter(|c| c.total > 0)
    }

    fn add(&mut self, b: u32, t: u32) {
        if b < DIRECT {
            let i = b as usize;
            if self.direct.len() <= i {
                self.direct.resize_with(i + 1, Counts::default);
            }
            self.direct[i].add(t);
        } else {
            self.far.entry(b).or_default().add(t);
        }
    }

    /// Remove one occurrence of (b, t); an emptied context frees what it held.
    fn remove(&mut self, b: u32, t: u32) {
        if b < DIRECT {
            if let Some(c) = self.direct.get_mut(b as usize) {
                if c.total > 0 && c.remove(t) {
                    *c = Counts::default();
                }
            }
        } else if let Entry::Occupied(mut e) = self.far.entry(b) {
            if e.get_mut().remove(t) {
                e.remove();
            }
        }
    }

    /// Read the line of b's entry and what adding or removing (b, t) will touch (see
    /// [`Window::warm`]).
    fn warm(&self, b: u32, t: u32) -> u64 {
        self.get(b).map_or(0, |c| c.warm(t))
    }

    /// Ask for b's entry to be brought into the cache (below [`DIRECT`]; nothing is read).
    fn prefetch(&self, b: u32) {
        if (b as usize) < self.direct.len() {
            prefetch(self.direct.as_ptr().wrapping_add(b as usize));
        }
    }

    fn clear(&mut self) {
        self.direct.clear();
        self.far.clear();
    }

    fn nbytes(&self) -> usize {
        use std::mem::size_of;
        self.direct.capacity() * size_of::<Counts>()
            + self.far.capacity() * (size_of::<(u32, Counts)>() + 1)
            + self.direct.iter().chain(self.far.values()).map(Counts::nbytes).sum::<usize>()
    }
}

/// Ask for the cache line at `p` (any address: nothing is read, nothing can fault).
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it neither reads into the program nor faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

pub(crate) fn key2(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

/// A two-token context (a, b): its continuation counts and its latest occurrence. One table
/// for both: an insert or eviction looks the key up once, not twice (insert of a 128-token
/// output with two tables ~20 % slower, tools/bench_live.py). The earlier occurrences are
/// chained through the window's `links`, so eviction touches the entry alone (a per-key
/// queue of positions would cost a cache miss at each of its ends).
#[derive(Debug, Clone, Default)]
pub(crate) struct Tri {
    pub(crate) counts: Counts,
    /// The latest position q with tokens[q-2..q] = (a, b) (valid while `counts.total > 0`).
    latest: u64,
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
    /// Beside each token at position q that ends a two-token key (tokens[q-2..q]): the key's
    /// previous occurrence, the one before q in the chain from [`Tri::latest`]; the chain of a
    /// key holds exactly its `counts.total` positions, latest first (anything else: unused).
    links: VecDeque<u64>,
    base: u64,
    pub(crate) bi: Bigrams,
    pub(crate) tri: KeyTable<Tri>,
    inserted: u64,
    /// Buffers of [`Window::warm`], kept between inserts.
    scratch: Scratch,
}

/// [`Window::warm`]'s buffers: the trigrams an insert touches, and their slots (with the
/// continuation) in the trigram table.
type Scratch = (Vec<(u32, u32, u32)>, Vec<(usize, u32)>);

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
            links: VecDeque::new(),
            base: 0,
            bi: Bigrams::default(),
            tri: KeyTable::default(),
            inserted: 0,
            scratch: Default::default(),
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
        let incoming = ids.len() + usize::from(!self.tokens.is_empty());
        self.warm((self.tokens.len() + incoming).saturating_sub(self.capacity), ids);
        if !self.tokens.is_empty() {
            self.push(SEP);
        }
        for &t in ids {
            self.push(t);
        }
        self.inserted += ids.len() as u64;
    }

    /// Read every table entry that evicting the oldest `evictions` tokens and pushing `ids` will
    /// write, before writing any. Each access is a cache miss; these reads do not depend on one
    /// another, so the processor overlaps them, where the writes, one after another, wait for
    /// each miss in turn.
    fn warm(&mut self, evictions: usize, ids: &[u32]) {
        let (mut grams, mut slots) = std::mem::take(&mut self.scratch);
        grams.clear();
        slots.clear();
        let n = self.tokens.len();
        for p in 0..evictions.min(n.saturating_sub(2)) {
            grams.push((self.tokens[p], self.tokens[p + 1], self.tokens[p + 2]));
        }
        grams.extend(ids.windows(3).map(|w| (w[0], w[1], w[2])));
        grams.retain(|&(a, b, _)| a != SEP && b != SEP);
        // Addresses that need no read first (the trigram slots, the bigram entries), then
        // what they point to, each step's misses overlapping.
        for &(a, b, _) in &grams {
            self.tri.prefetch(key2(a, b));
            self.bi.prefetch(a);
        }
        for &(a, b, c) in &grams {
            if c != SEP {
                if let Some(i) = self.tri.find(key2(a, b)) {
                    self.tri.prefetch_value(i);
                    slots.push((i, c));
                }
            }
        }
        let mut seen = 0u64;
        for &(a, b, _) in &grams {
            seen ^= self.bi.warm(a, b);
        }
        for &(i, c) in &slots {
            seen ^= self.tri.value_at(i).counts.warm(c);
        }
        std::hint::black_box(seen);
        self.scratch = (grams, slots);
    }

    fn push(&mut self, t: u32) {
        while self.tokens.len() >= self.capacity {
            self.evict();
        }
        let q = self.end();
        let link = self.record(t, q);
        self.tokens.push_back(t);
        self.links.push_back(link);
    }

    /// Count the n-grams that token `t`, about to enter at position `q`, ends; the previous
    /// occurrence of the two-token key it follows (0 when none).
    fn record(&mut self, t: u32, q: u64) -> u64 {
        if t == SEP || q < self.base + 1 {
            return 0;
        }
        let b = self.at(q - 1);
        if b == SEP {
            return 0;
        }
        self.bi.add(b, t);
        if q < self.base + 2 {
            return 0;
        }
        let a = self.at(q - 2);
        if a == SEP {
            return 0;
        }
        let e = self.tri.get_or_default(key2(a, b));
        let link = if e.counts.total > 0 { e.latest } else { 0 };
        e.latest = q;
        e.counts.add(t);
        link
    }

    /// Drop the oldest token and every n-gram that starts with it (each the oldest occurrence
    /// of its context: the end of the key's chain, which nothing reads once the count drops).
    fn evict(&mut self) {
        let p = self.base;
        let end = self.end();
        let a = self.at(p);
        if a != SEP && p + 1 < end {
            let b = self.at(p + 1);
            if b != SEP {
                self.bi.remove(a, b);
                if p + 2 < end {
                    let c = self.at(p + 2);
                    if c != SEP {
                        if let Some(i) = self.tri.find(key2(a, b)) {
                            if self.tri.value_mut(i).counts.remove(c) {
                                self.tri.remove_at(i);
                            }
                        }
                    }
                }
            }
        }
        self.tokens.pop_front();
        self.links.pop_front();
        self.base += 1;
    }

    /// Positions of a key's occurrences, latest first.
    fn latest_first<'a>(&'a self, e: &'a Tri) -> impl Iterator<Item = u64> + 'a {
        let mut q = e.latest;
        (0..e.counts.total).map(move |i| {
            if i > 0 {
                q = self.links[(q - self.base) as usize];
            }
            q
        })
    }

    pub(crate) fn clear(&mut self) {
        self.base = self.end();
        self.tokens.clear();
        self.links.clear();
        self.bi.clear();
        self.tri.clear();
        self.inserted = 0;
    }

    /// The continuation (at most `max_len` tokens) of the longest earlier match, of at least
    /// `min_match` and at most `max_match` tokens, of the end of `context` in the window: the
    /// tokens that followed it, up to the end of that document. Ties go to the latest match.
    /// Empty when nothing matches. Examines at most 64 occurrences of the last two tokens.
    pub fn suffix_match(&self, context: &[u32], max_len: usize, min_match: usize, max_match: usize) -> Vec<u32> {
        self.suffix_lookup(context, max_len, min_match, max_match).1
    }

    /// [`Window::suffix_match`] with the length of the match it continues (0 with an empty
    /// continuation): how much of the context's end the window repeats, the evidence a
    /// suffix-decoding proposer sizes its draft by.
    pub fn suffix_lookup(
        &self,
        context: &[u32],
        max_len: usize,
        min_match: usize,
        max_match: usize,
    ) -> (usize, Vec<u32>) {
        let n = context.len();
        if n < 2 || max_len == 0 || max_match < 2 || min_match > max_match {
            return (0, Vec::new());
        }
        let Some(hits) = self.tri.get(&key2(context[n - 2], context[n - 1])) else {
            return (0, Vec::new());
        };
        let end = self.end();
        let mut best: Option<(usize, u64)> = None;
        for q in self.latest_first(hits).take(MAX_PROBES) {
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
                (if out.is_empty() { 0 } else { m }, out)
            }
            _ => (0, Vec::new()),
        }
    }

    /// Bytes held by the window's tables (capacity of their allocations, approximate for the
    /// hash maps: entries plus one control byte each).
    pub fn nbytes(&self) -> usize {
        use std::mem::size_of;
        let counts = |c: &Counts| c.nbytes();
        self.tokens.capacity() * 4
            + self.links.capacity() * 8
            + self.bi.nbytes()
            + self.tri.slots() * (8 + size_of::<Tri>())
            + self.tri.values().map(|e| counts(&e.counts)).sum::<usize>()
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

//! A small map keyed by three tokens, for what a search remembers across its levels: open
//! addressing, linear probing, cleared in O(1) by a generation stamp (a search clears it at
//! its start, so nothing outlives a search).

/// One slot: the key (three tokens), the generation that wrote it, the value.
#[derive(Clone, Copy, Default)]
struct Slot<T: Copy + Default> {
    key: [u32; 3],
    gen: u32,
    val: T,
}

/// Map from `[u32; 3]` to `T`, valid for the current generation only.
pub(crate) struct Memo<T: Copy + Default> {
    slots: Vec<Slot<T>>,
    /// log2 of `slots.len()`.
    bits: u32,
    gen: u32,
    len: usize,
}

impl<T: Copy + Default> Default for Memo<T> {
    fn default() -> Self {
        Memo { slots: vec![Slot::default(); 1 << 10], bits: 10, gen: 1, len: 0 }
    }
}

impl<T: Copy + Default> Memo<T> {
    /// Forget every entry (O(1) but once every 2^32 calls).
    pub(crate) fn clear(&mut self) {
        self.len = 0;
        self.gen = self.gen.wrapping_add(1);
        if self.gen == 0 {
            self.slots.fill(Slot::default());
            self.gen = 1;
        }
    }

    #[inline]
    fn home(&self, key: [u32; 3]) -> usize {
        let x = ((key[0] as u64) << 32 | key[1] as u64) ^ (key[2] as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (x.wrapping_mul(0xBF58_476D_1CE4_E5B9) >> (64 - self.bits)) as usize
    }

    /// The value stored under `key`, if any.
    #[inline]
    pub(crate) fn get(&self, key: [u32; 3]) -> Option<T> {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let s = &self.slots[i];
            if s.gen != self.gen {
                return None;
            }
            if s.key == key {
                return Some(s.val);
            }
            i = (i + 1) & mask;
        }
    }

    /// Store `val` under `key` (not present: call after a [`Memo::get`] miss).
    pub(crate) fn insert(&mut self, key: [u32; 3], val: T) {
        // At most half full: probes stay short, and a free slot always ends a probe.
        if 2 * (self.len + 1) > self.slots.len() {
            self.grow();
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        while self.slots[i].gen == self.gen {
            i = (i + 1) & mask;
        }
        self.slots[i] = Slot { key, gen: self.gen, val };
        self.len += 1;
    }

    fn grow(&mut self) {
        let live: Vec<Slot<T>> = self.slots.iter().copied().filter(|s| s.gen == self.gen).collect();
        self.bits += 1;
        self.slots = vec![Slot::default(); 1 << self.bits];
        self.len = 0;
        for s in live {
            self.insert(s.key, s.val);
        }
    }
}

/// A direct-mapped cache from (context, token) to `f64`, the context two tokens packed in a
/// `u64` ([`Cache::context`]): a key has one slot, a later key of the same slot replaces it (a
/// miss then only costs the caller a recomputation). Cleared in O(1) by a generation stamp
/// like [`Memo`]. (A [`Memo`] for the search's probabilities, with probing and growth, cost
/// more than the index lookups it saved.)
pub(crate) struct Cache {
    slots: Vec<CacheSlot>,
    gen: u32,
}

#[derive(Clone, Copy, Default)]
struct CacheSlot {
    ctx: u64,
    token: u32,
    gen: u32,
    val: f64,
}

impl Default for Cache {
    fn default() -> Self {
        Cache { slots: vec![CacheSlot::default(); Self::SLOTS], gen: 1 }
    }
}

/// A context of [`Cache`]: its two tokens and its hash.
#[derive(Clone, Copy)]
pub(crate) struct CacheCtx {
    ctx: u64,
    hash: u64,
}

impl Cache {
    const BITS: u32 = 12;
    const SLOTS: usize = 1 << Self::BITS;

    /// Forget every entry (O(1) but once every 2^32 calls).
    pub(crate) fn clear(&mut self) {
        self.gen = self.gen.wrapping_add(1);
        if self.gen == 0 {
            self.slots.fill(CacheSlot::default());
            self.gen = 1;
        }
    }

    /// The key part of context (a, b), computed once for many tokens.
    #[inline]
    pub(crate) fn context(a: u32, b: u32) -> CacheCtx {
        let ctx = (a as u64) << 32 | b as u64;
        CacheCtx { ctx, hash: ctx.wrapping_mul(0x9E37_79B9_7F4A_7C15) }
    }

    #[inline]
    fn slot(c: CacheCtx, token: u32) -> usize {
        ((c.hash ^ token as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9) >> (64 - Self::BITS)) as usize
    }

    /// The value stored under (`c`, `token`), if it is still there.
    #[cfg(test)]
    pub(crate) fn get(&self, c: CacheCtx, token: u32) -> Option<f64> {
        let (hit, val) = self.probe(c, token);
        hit.then_some(val)
    }

    /// Whether (`c`, `token`) is there, and the value of its slot (its value on a hit), without
    /// a branch on the outcome.
    #[inline]
    pub(crate) fn probe(&self, c: CacheCtx, token: u32) -> (bool, f64) {
        let s = &self.slots[Self::slot(c, token)];
        ((s.gen == self.gen) & (s.ctx == c.ctx) & (s.token == token), s.val)
    }

    /// Store `val` under (`c`, `token`), replacing what the slot held.
    #[inline]
    pub(crate) fn insert(&mut self, c: CacheCtx, token: u32, val: f64) {
        let gen = self.gen;
        self.slots[Self::slot(c, token)] = CacheSlot { ctx: c.ctx, token, gen, val };
    }
}

#[cfg(test)]
mod tests {
    use super::{Cache, Memo};

    #[test]
    fn cache_get_insert_clear() {
        let k = |a, b| Cache::context(a, b);
        let mut c = Cache::default();
        assert_eq!(c.get(k(1, 2), 3), None);
        c.insert(k(1, 2), 3, 0.25);
        assert_eq!(c.get(k(1, 2), 3), Some(0.25));
        assert_eq!(c.get(k(1, 2), 4), None);
        assert_eq!(c.get(k(2, 1), 3), None);
        // keys of one slot replace each other; a hit is always the key's own value
        for i in 0..20_000u32 {
            c.insert(k(i, 7), i, i as f64);
            assert_eq!(c.get(k(i, 7), i), Some(i as f64));
        }
        let hits = (0..20_000u32).filter(|&i| c.get(k(i, 7), i).is_some()).count();
        assert!(hits <= Cache::SLOTS);
        for i in 0..20_000u32 {
            assert!(c.get(k(i, 7), i).is_none_or(|v| v == i as f64));
        }
        c.clear();
        assert_eq!(c.get(k(19_999, 7), 19_999), None);
        c.gen = u32::MAX;
        c.insert(k(4, 5), 6, 1.0);
        c.clear();
        assert_eq!(c.get(k(4, 5), 6), None);
    }

    #[test]
    fn get_insert_clear_grow() {
        let mut m = Memo::<f64>::default();
        for i in 0..5000u32 {
            assert_eq!(m.get([i, i ^ 7, u32::MAX - i]), None);
            m.insert([i, i ^ 7, u32::MAX - i], i as f64);
        }
        for i in 0..5000u32 {
            assert_eq!(m.get([i, i ^ 7, u32::MAX - i]), Some(i as f64));
        }
        assert_eq!(m.get([1, 2, 3]), None);
        m.clear();
        for i in 0..5000u32 {
            assert_eq!(m.get([i, i ^ 7, u32::MAX - i]), None);
        }
        assert_eq!(m.get([1, 2, 3]), None);
        m.insert([1, 2, 3], 0.5);
        assert_eq!(m.get([1, 2, 3]), Some(0.5));
        // generation wrap-around forgets everything
        m.gen = u32::MAX;
        m.insert([4, 5, 6], 1.0);
        m.clear();
        assert_eq!(m.get([4, 5, 6]), None);
        assert_eq!(m.get([1, 2, 3]), None);
    }
}

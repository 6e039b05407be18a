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

#[cfg(test)]
mod tests {
    use super::Memo;

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

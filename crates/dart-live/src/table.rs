//! The trigram table: open addressing by linear probing over u64 keys, whose home slot is a
//! function of the key alone, so a batch of lookups can ask for every key's slot before
//! reading any ([`KeyTable::prefetch`]): the misses of an insert's lookups overlap instead of
//! following one another (as they must through a `HashMap`, whose slots are hidden).

/// A key no two-token context has: (u32::MAX, u32::MAX) is two separators.
const EMPTY: u64 = u64::MAX;

/// A map from u64 keys (never [`EMPTY`]) to values, at most three quarters full.
#[derive(Debug, Clone)]
pub(crate) struct KeyTable<V> {
    keys: Vec<u64>,
    vals: Vec<V>,
    len: usize,
    /// 64 - log2(slots): the home slot is the top bits of the key times an odd constant.
    shift: u32,
}

impl<V: Default> Default for KeyTable<V> {
    fn default() -> Self {
        KeyTable { keys: Vec::new(), vals: Vec::new(), len: 0, shift: 64 }
    }
}

impl<V: Default> KeyTable<V> {
    fn home(&self, k: u64) -> usize {
        if self.keys.is_empty() {
            return 0;
        }
        (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    fn next(&self, i: usize) -> usize {
        (i + 1) & (self.keys.len() - 1)
    }

    /// The slot holding `k`.
    pub(crate) fn find(&self, k: u64) -> Option<usize> {
        if self.keys.is_empty() {
            return None;
        }
        let mut i = self.home(k);
        loop {
            match self.keys[i] {
                x if x == k => return Some(i),
                EMPTY => return None,
                _ => i = self.next(i),
            }
        }
    }

    pub(crate) fn get(&self, k: &u64) -> Option<&V> {
        self.find(*k).map(|i| &self.vals[i])
    }

    /// Ask for the line of `k`'s home slot to be brought into the cache (nothing is read).
    pub(crate) fn prefetch(&self, k: u64) {
        if !self.keys.is_empty() {
            crate::window::prefetch(self.keys.as_ptr().wrapping_add(self.home(k)));
        }
    }

    /// Ask for the value in slot `i` (from [`KeyTable::find`]) to be brought into the cache.
    pub(crate) fn prefetch_value(&self, i: usize) {
        crate::window::prefetch(self.vals.as_ptr().wrapping_add(i));
    }

    /// `k`'s value, a default one inserted if `k` is absent.
    pub(crate) fn get_or_default(&mut self, k: u64) -> &mut V {
        debug_assert_ne!(k, EMPTY);
        if (self.len + 1) * 4 > self.keys.len() * 3 {
            self.grow();
        }
        let mut i = self.home(k);
        loop {
            match self.keys[i] {
                x if x == k => break,
                EMPTY => {
                    self.keys[i] = k;
                    self.len += 1;
                    break;
                }
                _ => i = self.next(i),
            }
        }
        &mut self.vals[i]
    }

    fn grow(&mut self) {
        let slots = (self.keys.len() * 2).max(16);
        let keys = std::mem::replace(&mut self.keys, vec![EMPTY; slots]);
        let vals = std::mem::take(&mut self.vals);
        self.vals = std::iter::repeat_with(V::default).take(slots).collect();
        self.shift = 64 - slots.trailing_zeros();
        self.len = 0;
        for (k, v) in keys.into_iter().zip(vals) {
            if k != EMPTY {
                *self.get_or_default(k) = v;
            }
        }
    }

    /// Remove the value in slot `i`; the run after it shifts back (no tombstones).
    pub(crate) fn remove_at(&mut self, mut i: usize) {
        let mut j = i;
        loop {
            j = self.next(j);
            let k = self.keys[j];
            if k == EMPTY {
                break;
            }
            // k may move to i when its home is not cyclically within (i, j].
            let h = self.home(k);
            let stays = if i <= j { i < h && h <= j } else { i < h || h <= j };
            if !stays {
                self.keys[i] = k;
                self.vals.swap(i, j);
                i = j;
            }
        }
        self.keys[i] = EMPTY;
        self.vals[i] = V::default();
        self.len -= 1;
    }

    pub(crate) fn value_at(&self, i: usize) -> &V {
        &self.vals[i]
    }

    pub(crate) fn value_mut(&mut self, i: usize) -> &mut V {
        &mut self.vals[i]
    }

    pub(crate) fn clear(&mut self) {
        *self = KeyTable::default();
    }

    pub(crate) fn slots(&self) -> usize {
        self.keys.len()
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.keys.iter().zip(&self.vals).filter(|(&k, _)| k != EMPTY).map(|(_, v)| v)
    }
}

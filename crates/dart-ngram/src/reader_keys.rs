//! An index read back as the padded trigram keys it was built from ([`Index::keys`]), so that
//! indexes can be merged by the builder's own writer (`crate::merge_indexes`).
//!
//! The keys follow from the stored figures: (a, b, c) = count(a, b, c); (a, b, END) =
//! count(a, b) − total(a, b); (a, END, END) = count(a) − total(a). That holds only for an
//! index that kept every n-gram: one built with `min_count` > 1 or a per-context cap lost
//! counts (Σ children < total), and the stream stops with [`Error::Merge`] there.
use super::{Ctx, Index};
use crate::builder::{pack_key, KEY_END};
use crate::error::{Error, Result};

/// The sorted (key, count) pairs of an index (see the module docs). Memory: the keys of one
/// two-token context at a time.
pub struct Keys<'a, D: AsRef<[u8]>> {
    ix: &'a Index<D>,
    /// The next first token to open.
    next_a: u32,
    /// The open first token: its bigram nodes left (j..e), total(a), count(a), Σ count(a, b).
    open: Option<(u32, usize, usize, u64, u64, u64)>,
    buf: Vec<(u64, u64)>,
    pos: usize,
    tokens: u64,
    failed: bool,
}

impl<D: AsRef<[u8]>> Index<D> {
    /// Every (key, count) the index was built from, ascending (see [`Keys`]). An error item
    /// ends the stream: a corrupt body, or an index that did not keep every n-gram.
    pub fn keys(&self) -> Keys<'_, D> {
        Keys { ix: self, next_a: 0, open: None, buf: Vec::new(), pos: 0, tokens: 0, failed: false }
    }
}

impl<D: AsRef<[u8]>> Keys<'_, D> {
    fn corrupt(&self, what: String) -> Error {
        Error::format(format!("{what}; the index body is corrupt (run dart-index verify)"))
    }

    fn pruned(&self, what: String) -> Error {
        Error::Merge(format!(
            "{what}: the index was built without some n-grams (min_count > 1 or a per-context cap), \
             so its counts cannot be merged exactly; rebuild it with ngram-build's defaults"
        ))
    }

    /// Refill `buf` with the next group of keys; false at the end.
    fn fill(&mut self) -> Result<bool> {
        let ix = self.ix;
        self.buf.clear();
        self.pos = 0;
        while self.buf.is_empty() {
            let Some((a, j, e, total_a, count_a, sum_b)) = self.open else {
                if self.next_a >= ix.h.vocab_size {
                    if self.tokens != ix.h.tokens {
                        return Err(self.corrupt(format!(
                            "the n-gram counts sum to {} tokens, the header says {}",
                            self.tokens, ix.h.tokens
                        )));
                    }
                    return Ok(false);
                }
                let a = self.next_a;
                self.next_a += 1;
                let count_a = ix.uni_count(a);
                let c = ix.ctx1(a).ok_or_else(|| self.corrupt(format!("token {a} has no unigram record")))?;
                if count_a == 0 {
                    if c.e > c.s || c.total > 0 {
                        return Err(self.corrupt(format!("token {a} has count 0 but children")));
                    }
                    continue;
                }
                self.open = Some((a, c.s, c.e, c.total, count_a, 0));
                continue;
            };
            if j < e {
                let l2 = ix.l2();
                let w = l2.word(j).ok_or_else(|| self.corrupt(format!("bigram node {j} is missing")))?;
                let b = l2.token_of(w);
                let count_ab = l2.count_of(j, w);
                let c: Ctx =
                    ix.ctx2(j, w).ok_or_else(|| self.corrupt(format!("the context ({a}, {b}) is out of range")))?;
                let mut sum_c = 0u64;
                let buf = &mut self.buf;
                ix.l3().decode(c.s, c.e, |t, n| {
                    sum_c = sum_c.saturating_add(n);
                    buf.push((pack_key(a, b as u64, t as u64), n));
                });
                if sum_c != c.total {
                    self.buf.clear();
                    return Err(self.pruned(format!(
                        "the continuations of ({a}, {b}) sum to {sum_c}, their total is {}",
                        c.total
                    )));
                }
                if count_ab > c.total {
                    self.buf.push((pack_key(a, b as u64, KEY_END), count_ab - c.total));
                }
                self.open = Some((a, j + 1, e, total_a, count_a, sum_b.saturating_add(count_ab)));
            } else {
                self.open = None;
                if sum_b != total_a {
                    return Err(
                        self.pruned(format!("the continuations of {a} sum to {sum_b}, their total is {total_a}"))
                    );
                }
                let ends = count_a
                    .checked_sub(total_a)
                    .ok_or_else(|| self.corrupt(format!("token {a}: count {count_a} is below its total {total_a}")))?;
                if ends > 0 {
                    self.buf.push((pack_key(a, KEY_END, KEY_END), ends));
                }
            }
        }
        // saturating: a hostile body's counts must give an error below, never an overflow
        self.tokens = self.buf.iter().fold(self.tokens, |t, x| t.saturating_add(x.1));
        Ok(true)
    }
}

impl<D: AsRef<[u8]>> Iterator for Keys<'_, D> {
    type Item = Result<(u64, u64)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        if self.pos >= self.buf.len() {
            match self.fill() {
                Ok(true) => {}
                Ok(false) => return None,
                Err(e) => {
                    self.failed = true;
                    return Some(Err(e));
                }
            }
        }
        let x = self.buf[self.pos];
        self.pos += 1;
        Some(Ok(x))
    }
}

//! `NgramScorer` for the real index: a thin forward to `dart_ngram::Index`.
use std::cell::RefCell;

use dart_ngram::{Children, Index};

use crate::{NgramScorer, Result};

thread_local! {
    static CHILDREN: RefCell<Children> = RefCell::new(Children::with_capacity(32));
}

impl<D: AsRef<[u8]> + Sync> NgramScorer for Index<D> {
    fn vocab_size(&self) -> u32 {
        Index::vocab_size(self)
    }

    fn cond_probs(&self, context: &[u32], candidates_sorted: &[u32], unigram_backoff: bool, out: &mut [f64]) {
        Index::cond_probs(self, context, candidates_sorted, unigram_backoff, out)
    }

    fn trigram_probs(&self, context: [u32; 2], candidates_sorted: &[u32], out: &mut [f64]) {
        Index::trigram_probs(self, context[0], context[1], candidates_sorted, out)
    }

    fn trigram_context(&self, context: [u32; 2]) -> ([u64; 3], f64) {
        Index::trigram_context_range(self, context[0], context[1])
    }

    fn trigram_probs_at(&self, _context: [u32; 2], handle: [u64; 3], candidates_sorted: &[u32], out: &mut [f64]) {
        Index::trigram_probs_in(self, handle, candidates_sorted, out)
    }

    fn backoff_bound(&self, b: u32, unigram_backoff: bool) -> f64 {
        Index::max_backoff_prob(self, b, unigram_backoff)
    }

    fn top_children(
        &self,
        context: &[u32],
        k: usize,
        unigram_backoff: bool,
        tokens: &mut Vec<u32>,
        probs: &mut Vec<f64>,
    ) -> Result<()> {
        tokens.clear();
        probs.clear();
        CHILDREN.with(|cell| {
            let mut fresh = Children::new();
            let mut guard = cell.try_borrow_mut();
            let ch = match guard.as_mut() {
                Ok(c) => &mut **c,
                Err(_) => &mut fresh,
            };
            let m = self.children(context, k, ch)?;
            // order 1 = the unigram distribution, only a fallback when allowed (or when the
            // context is empty, where it is the only distribution there is).
            if m.total == 0 || (m.order == 1 && !unigram_backoff && !context.is_empty()) {
                return Ok(());
            }
            let total = m.total as f64;
            tokens.extend_from_slice(ch.tokens());
            probs.extend(ch.counts().iter().map(|&c| c as f64 / total));
            Ok(())
        })
    }
}

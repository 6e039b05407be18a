//! What the tree builders need from an n-gram model. `dart_ngram::Index` implements it
//! (see `index_impl.rs`); tests implement it with brute-force hash maps.
use crate::Result;

/// Per-token backed-off trigram probabilities, as Eq. (10) uses them.
///
/// `context` holds at most the last two tokens of committed text + path (oldest first); it is
/// shorter only when there is less text. g(v|c) = count(c,v)/count(c) for the longest suffix c
/// of `context` after which v has been seen (two tokens, then one, then — if `unigram_backoff`
/// — none, i.e. the unigram distribution), and 0 if v was never seen after any of them.
pub trait NgramScorer: Sync {
    /// Number of token ids the model knows; every id the builders receive must be below it.
    fn vocab_size(&self) -> u32;

    /// g(v|context) for every v of `candidates_sorted` (strictly increasing ids), into `out`
    /// (same length). The hot path: called once per beam entry per level.
    fn cond_probs(&self, context: &[u32], candidates_sorted: &[u32], unigram_backoff: bool, out: &mut [f64]);

    /// The two-token level of [`NgramScorer::cond_probs`] alone: `out[i]` = count(c,v)/count(c)
    /// for the context c = `context` (both tokens) when v has been seen after it, NaN
    /// otherwise. Where it is NaN, `cond_probs(context, ..)` must equal `cond_probs(&context[1..],
    /// ..)` (the backoff); the search relies on that to share the one-token column between
    /// contexts that end in the same token.
    fn trigram_probs(&self, context: [u32; 2], candidates_sorted: &[u32], out: &mut [f64]);

    /// Resolve the two-token context once, for [`NgramScorer::trigram_probs_at`]: a handle
    /// and an upper bound of every non-NaN [`NgramScorer::trigram_probs`] value of the
    /// context (the search skips lookups that cannot change the tree with it). The default
    /// (no handle, bound 1.0) is always valid; a bound must never be below a real value.
    /// The handle is the implementation's own (the index: the context's node range and total).
    fn trigram_context(&self, context: [u32; 2]) -> ([u64; 3], f64) {
        let _ = context;
        ([u64::MAX; 3], 1.0)
    }

    /// [`NgramScorer::trigram_probs`] of `context`, whose [`NgramScorer::trigram_context`]
    /// returned `handle`: the same values (the default ignores the handle).
    fn trigram_probs_at(&self, context: [u32; 2], handle: [u64; 3], candidates_sorted: &[u32], out: &mut [f64]) {
        let _ = handle;
        self.trigram_probs(context, candidates_sorted, out)
    }

    /// An upper bound of g(v | b) = `cond_probs(&[b], [v], unigram_backoff)` over every token
    /// v: the search skips backoff lookups that cannot change the tree. 1.0 (the default) is
    /// always valid; a tighter bound only saves work. It must never be below a real value.
    fn backoff_bound(&self, b: u32, unigram_backoff: bool) -> f64 {
        let _ = (b, unigram_backoff);
        1.0
    }

    /// The (at most) `k` most frequent continuations of the longest suffix of `context` that
    /// has any, in descending count order, with their probabilities count(c,v)/count(c).
    /// Without `unigram_backoff` the empty context is not tried (no children is a valid answer).
    fn top_children(
        &self,
        context: &[u32],
        k: usize,
        unigram_backoff: bool,
        tokens: &mut Vec<u32>,
        probs: &mut Vec<f64>,
    ) -> Result<()>;
}

/// The absent model: every g is 0. Use it with `ngram_weight = 0` (the drafter-only tree),
/// where the builders never ask it anything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoNgram;

impl NgramScorer for NoNgram {
    fn vocab_size(&self) -> u32 {
        u32::MAX
    }
    fn cond_probs(&self, _: &[u32], _: &[u32], _: bool, out: &mut [f64]) {
        out.fill(0.0);
    }
    fn trigram_probs(&self, _: [u32; 2], _: &[u32], out: &mut [f64]) {
        out.fill(f64::NAN);
    }
    fn top_children(&self, _: &[u32], _: usize, _: bool, t: &mut Vec<u32>, p: &mut Vec<f64>) -> Result<()> {
        t.clear();
        p.clear();
        Ok(())
    }
}

impl<S: NgramScorer + ?Sized> NgramScorer for &S {
    fn vocab_size(&self) -> u32 {
        (**self).vocab_size()
    }
    fn cond_probs(&self, c: &[u32], v: &[u32], u: bool, out: &mut [f64]) {
        (**self).cond_probs(c, v, u, out)
    }
    fn trigram_probs(&self, c: [u32; 2], v: &[u32], out: &mut [f64]) {
        (**self).trigram_probs(c, v, out)
    }
    fn trigram_context(&self, c: [u32; 2]) -> ([u64; 3], f64) {
        (**self).trigram_context(c)
    }
    fn trigram_probs_at(&self, c: [u32; 2], h: [u64; 3], v: &[u32], out: &mut [f64]) {
        (**self).trigram_probs_at(c, h, v, out)
    }
    fn backoff_bound(&self, b: u32, u: bool) -> f64 {
        (**self).backoff_bound(b, u)
    }
    fn top_children(&self, c: &[u32], k: usize, u: bool, t: &mut Vec<u32>, p: &mut Vec<f64>) -> Result<()> {
        (**self).top_children(c, k, u, t, p)
    }
}

//! Eq. (10)'s g(v | c) over the static index and the live window together.
//!
//! The live side is the window plus the shared deltas (other processes' windows), their counts
//! added: count(c, v) and total(c) are sums over the sources. It answers like the index does
//! (the longest context seen: count(a, b, v) / total(a, b), else count(b, v) / total(b)) but
//! has no unigram level: below the one-token context its g is 0. The static and live sides
//! are interpolated per last token b:
//!
//! g(v | a, b) = (1 - λ_b) · g_static(v | a, b) + λ_b · g_live(v | a, b),
//! λ_b = `weight` when a live source has seen b followed by anything, else 0.
//!
//! λ depends only on b, so where neither source has seen (a, b, v) the mix backs off to exactly
//! the mix at context (b): the property the search's column sharing relies on
//! ([`NgramScorer::trigram_probs`]).
use std::sync::Arc;

use dart_tree::{NgramScorer, Result};

use crate::delta::Delta;
use crate::window::{key2, Counts, Window};

/// The static scorer `base` and the live side (the window `live` and the shared deltas
/// `shared`) mixed with weight `weight` in [0, 1]. `unigram_backoff` must be the search's own
/// flag: [`NgramScorer::trigram_probs`] does not receive it, and a mixed value's static term
/// may back off to the unigram level.
pub struct Mixed<'a, S: NgramScorer + ?Sized> {
    pub base: &'a S,
    pub live: &'a Window,
    pub shared: &'a [Arc<Delta>],
    pub weight: f64,
    pub unigram_backoff: bool,
}

impl<S: NgramScorer + ?Sized> Mixed<'_, S> {
    /// [`NgramScorer::trigram_probs`] from the static side's values in `out`: where either
    /// side has seen (a, b, v), the full mixed value, else NaN (the backoff).
    fn mix_trigram(&self, context: [u32; 2], candidates_sorted: &[u32], out: &mut [f64]) {
        let lam = self.lambda(&context);
        if lam == 0.0 {
            return; // the window has not seen b, hence no (a, b, v) either
        }
        let mut live3 = vec![f64::NAN; out.len()];
        seen_summed(
            self.live.tri.get(&key2(context[0], context[1])).map(|e| &e.counts),
            self.shared,
            &context,
            candidates_sorted,
            &mut live3,
        );
        // Where either source has seen (a, b, v) the mix is not its backoff: the full value,
        // whose static term backs off (where the index has not seen (a, b, v)) as the
        // search asked, through `unigram_backoff`. Only those candidates are looked up again
        // (each value depends on its own candidate alone).
        let seen: Vec<usize> = (0..out.len()).filter(|&i| !(out[i].is_nan() && live3[i].is_nan())).collect();
        if seen.is_empty() {
            return;
        }
        let cands: Vec<u32> = seen.iter().map(|&i| candidates_sorted[i]).collect();
        let mut full = vec![0.0; cands.len()];
        self.cond_probs(&context, &cands, self.unigram_backoff, &mut full);
        for (&i, f) in seen.iter().zip(full) {
            out[i] = f;
        }
    }

    fn lambda(&self, context: &[u32]) -> f64 {
        match context.last() {
            Some(&b) if knows(self.live, self.shared, b) => self.weight,
            _ => 0.0,
        }
    }

    /// The live side's own g (no unigram level), for each candidate.
    pub fn live_probs(&self, context: &[u32], candidates_sorted: &[u32], out: &mut [f64]) {
        live_probs(self.live, self.shared, context, candidates_sorted, out)
    }
}

/// Whether a live source has seen `b` followed by anything.
fn knows(live: &Window, shared: &[Arc<Delta>], b: u32) -> bool {
    // `counts` of no token: total(b) alone, from b's unigram record (no search).
    live.bi.get(b).is_some() || shared.iter().any(|d| d.counts(&[b], &[], &mut []) > 0)
}

/// Summed counts of `context` (one or two tokens) over the sources: count(context, v) / total
/// for each candidate whose summed count is non-zero, into `out` where it is NaN on entry.
/// Each delta resolves the context once for all candidates ([`dart_ngram::Index::counts`]).
fn seen_summed(live: Option<&Counts>, shared: &[Arc<Delta>], context: &[u32], cands: &[u32], out: &mut [f64]) {
    let mut n: Vec<u64> = cands.iter().map(|&v| live.and_then(|c| c.get(v)).map_or(0, u64::from)).collect();
    let mut total = live.map_or(0, |c| c.total);
    if !shared.is_empty() {
        let mut one = vec![0u64; cands.len()];
        for d in shared {
            total += d.counts(context, cands, &mut one);
            for (x, y) in n.iter_mut().zip(&one) {
                *x += y;
            }
        }
    }
    if total == 0 {
        return;
    }
    for (o, &x) in out.iter_mut().zip(&n) {
        if o.is_nan() && x > 0 {
            *o = x as f64 / total as f64;
        }
    }
}

/// The live g(v | context) of the window and the shared deltas: the trigram level where seen,
/// else the bigram level, else 0.
pub fn live_probs(live: &Window, shared: &[Arc<Delta>], context: &[u32], candidates_sorted: &[u32], out: &mut [f64]) {
    out.fill(f64::NAN);
    let n = context.len();
    if n >= 2 {
        let (a, b) = (context[n - 2], context[n - 1]);
        seen_summed(live.tri.get(&key2(a, b)).map(|e| &e.counts), shared, &[a, b], candidates_sorted, out);
    }
    if n >= 1 {
        let b = context[n - 1];
        seen_summed(live.bi.get(b), shared, &[b], candidates_sorted, out);
    }
    for o in out.iter_mut() {
        if o.is_nan() {
            *o = 0.0;
        }
    }
}

impl<S: NgramScorer + ?Sized> NgramScorer for Mixed<'_, S> {
    fn vocab_size(&self) -> u32 {
        self.base.vocab_size().min(self.live.vocab_size())
    }

    fn cond_probs(&self, context: &[u32], candidates_sorted: &[u32], unigram_backoff: bool, out: &mut [f64]) {
        self.base.cond_probs(context, candidates_sorted, unigram_backoff, out);
        let lam = self.lambda(context);
        if lam == 0.0 {
            return;
        }
        let mut mine = vec![0.0; out.len()];
        self.live_probs(context, candidates_sorted, &mut mine);
        for (o, m) in out.iter_mut().zip(mine) {
            *o = (1.0 - lam) * *o + lam * m;
        }
    }

    fn trigram_probs(&self, context: [u32; 2], candidates_sorted: &[u32], out: &mut [f64]) {
        self.base.trigram_probs(context, candidates_sorted, out);
        self.mix_trigram(context, candidates_sorted, out);
    }

    /// The static side's handle, so that [`Mixed::trigram_probs_at`] reads the index through
    /// it as a search without the layer does; the bound mixes the static bound with the live
    /// sources' largest probabilities after (a, b) and after b (a value seen by the layer alone
    /// backs off on the static side, so the static backoff bound counts too).
    fn trigram_context(&self, context: [u32; 2]) -> ([u64; 3], f64) {
        let (handle, bound) = self.base.trigram_context(context);
        let lam = self.lambda(&context);
        if lam == 0.0 {
            return (handle, bound); // trigram_probs is the static one's
        }
        let [a, b] = context;
        let own = self.live.tri.get(&key2(a, b)).map_or(0.0, |e| e.counts.max_prob());
        let own = own.max(self.live.bi.get(b).map_or(0.0, Counts::max_prob));
        let live =
            self.shared.iter().fold(own, |m, d| m.max(d.trigram_context(a, b).1).max(d.max_backoff_prob(b, false)));
        let stat = bound.max(self.base.backoff_bound(b, self.unigram_backoff));
        (handle, ((1.0 - lam) * stat + lam * live).min(1.0))
    }

    fn trigram_probs_at(&self, context: [u32; 2], handle: [u64; 3], candidates_sorted: &[u32], out: &mut [f64]) {
        self.base.trigram_probs_at(context, handle, candidates_sorted, out);
        self.mix_trigram(context, candidates_sorted, out);
    }

    fn backoff_bound(&self, b: u32, unigram_backoff: bool) -> f64 {
        let s = self.base.backoff_bound(b, unigram_backoff);
        if !knows(self.live, self.shared, b) {
            return s;
        }
        // A ratio of summed counts is a weighted mean of the sources' ratios, so the largest
        // source's bound holds for the sum.
        let own = self.live.bi.get(b).map_or(0.0, Counts::max_prob);
        let live = self.shared.iter().map(|d| d.max_backoff_prob(b, false)).fold(own, f64::max);
        (1.0 - self.weight) * s + self.weight * live
    }

    fn top_children(
        &self,
        context: &[u32],
        k: usize,
        unigram_backoff: bool,
        tokens: &mut Vec<u32>,
        probs: &mut Vec<f64>,
    ) -> Result<()> {
        self.base.top_children(context, k, unigram_backoff, tokens, probs)?;
        let lam = self.lambda(context);
        if lam == 0.0 {
            return Ok(());
        }
        let mut cands: Vec<u32> = tokens.clone();
        let n = context.len();
        let live_ctx =
            if n >= 2 { self.live.tri.get(&key2(context[n - 2], context[n - 1])).map(|e| &e.counts) } else { None };
        let live_ctx = live_ctx.or_else(|| context.last().and_then(|b| self.live.bi.get(*b)));
        if let Some(c) = live_ctx {
            cands.extend(c.entries().map(|e| e.0));
        }
        let mut kids = dart_ngram::Children::new();
        for d in self.shared {
            if d.children(context, k, &mut kids).is_ok() {
                cands.extend_from_slice(kids.tokens());
            }
        }
        cands.sort_unstable();
        cands.dedup();
        let mut p = vec![0.0; cands.len()];
        self.cond_probs(context, &cands, unigram_backoff, &mut p);
        let mut order: Vec<usize> = (0..cands.len()).collect();
        order.sort_by(|&i, &j| p[j].total_cmp(&p[i]).then(cands[i].cmp(&cands[j])));
        order.truncate(k);
        tokens.clear();
        probs.clear();
        for i in order {
            if p[i] > 0.0 {
                tokens.push(cands[i]);
                probs.push(p[i]);
            }
        }
        Ok(())
    }
}

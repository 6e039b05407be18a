//! Eq. (10)'s g(v | c) over the static index and the live window together.
//!
//! The live window answers like the index does (the longest context seen: count(a, b, v) /
//! total(a, b), else count(b, v) / total(b)) but has no unigram level: below the one-token
//! context its g is 0. The two are interpolated per last token b:
//!
//! g(v | a, b) = (1 - λ_b) · g_static(v | a, b) + λ_b · g_live(v | a, b),
//! λ_b = `weight` when the window has seen b followed by anything, else 0.
//!
//! λ depends only on b, so where neither source has seen (a, b, v) the mix backs off to exactly
//! the mix at context (b): the property the search's column sharing relies on
//! ([`NgramScorer::trigram_probs`]).
use dart_tree::{NgramScorer, Result};

use crate::window::{key2, Window};

/// The static scorer `base` and the live window `live` mixed with weight `weight` in [0, 1].
/// `unigram_backoff` must be the search's own flag: [`NgramScorer::trigram_probs`] does not
/// receive it, and a mixed value's static term may back off to the unigram level.
pub struct Mixed<'a, S: NgramScorer + ?Sized> {
    pub base: &'a S,
    pub live: &'a Window,
    pub weight: f64,
    pub unigram_backoff: bool,
}

impl<S: NgramScorer + ?Sized> Mixed<'_, S> {
    fn lambda(&self, context: &[u32]) -> f64 {
        match context.last() {
            Some(b) if self.live.bi.contains_key(b) => self.weight,
            _ => 0.0,
        }
    }

    /// The window's own g (no unigram level), for each candidate.
    pub fn live_probs(&self, context: &[u32], candidates_sorted: &[u32], out: &mut [f64]) {
        live_probs(self.live, context, candidates_sorted, out)
    }
}

/// The window's g(v | context): the trigram level where seen, else the bigram level, else 0.
pub fn live_probs(live: &Window, context: &[u32], candidates_sorted: &[u32], out: &mut [f64]) {
    out.fill(f64::NAN);
    let n = context.len();
    if n >= 2 {
        if let Some(c) = live.tri.get(&key2(context[n - 2], context[n - 1])) {
            c.seen_sorted(candidates_sorted, out);
        }
    }
    if n >= 1 {
        if let Some(c) = live.bi.get(&context[n - 1]) {
            for (i, o) in out.iter_mut().enumerate() {
                if o.is_nan() {
                    let mut one = [f64::NAN];
                    c.seen_sorted(&candidates_sorted[i..=i], &mut one);
                    *o = one[0];
                }
            }
        }
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
        let lam = self.lambda(&context);
        if lam == 0.0 {
            return; // the window has not seen b, hence no (a, b, v) either
        }
        let mut live3 = vec![f64::NAN; out.len()];
        if let Some(c) = self.live.tri.get(&key2(context[0], context[1])) {
            c.seen_sorted(candidates_sorted, &mut live3);
        }
        if out.iter().zip(&live3).all(|(s, l)| s.is_nan() && l.is_nan()) {
            return;
        }
        // Where either source has seen (a, b, v) the mix is not its backoff: the full value,
        // whose static term backs off (where the index has not seen (a, b, v)) as the
        // search asked, through `unigram_backoff`.
        let mut full = vec![0.0; out.len()];
        self.cond_probs(&context, candidates_sorted, self.unigram_backoff, &mut full);
        for ((o, l), f) in out.iter_mut().zip(&live3).zip(full) {
            if !(o.is_nan() && l.is_nan()) {
                *o = f;
            }
        }
    }

    fn backoff_bound(&self, b: u32, unigram_backoff: bool) -> f64 {
        let s = self.base.backoff_bound(b, unigram_backoff);
        match self.live.bi.get(&b) {
            Some(c) => (1.0 - self.weight) * s + self.weight * c.max_prob(),
            None => s,
        }
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
        let live_ctx = if n >= 2 { self.live.tri.get(&key2(context[n - 2], context[n - 1])) } else { None };
        let live_ctx = live_ctx.or_else(|| context.last().and_then(|b| self.live.bi.get(b)));
        if let Some(c) = live_ctx {
            cands.extend(c.entries().map(|e| e.0));
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

//! The drafter's top-k rows, as the searches read them.

use crate::{Error, Result};

/// `d` rows of `k` drafter candidates, row-major: row l holds the top-k tokens of drafter row l
/// and their log-probabilities (renormalised inside the top-k by the caller, e.g. with
/// [`crate::topk_logprobs`]). A −inf log-probability marks an impossible token (so short rows
/// can be padded with −inf). [`crate::beam_search_batch`] takes several sequences' rows back to
/// back: `tokens` and `logprobs` then hold `B · d · k` entries.
#[derive(Debug, Clone, Copy)]
pub struct TopkRows<'a> {
    /// Token ids, `d · k` entries.
    pub tokens: &'a [u32],
    /// Log-probabilities, `d · k` entries.
    pub logprobs: &'a [f32],
    /// Rows (levels of the tree).
    pub d: usize,
    /// Candidates per row.
    pub k: usize,
}

impl<'a> TopkRows<'a> {
    /// The rows `tokens` / `logprobs` (`d · k` entries each); checked by the searches.
    pub fn new(tokens: &'a [u32], logprobs: &'a [f32], d: usize, k: usize) -> Self {
        TopkRows { tokens, logprobs, d, k }
    }

    /// Tokens and log-probabilities of row `l`.
    #[inline]
    pub fn row(&self, l: usize) -> (&'a [u32], &'a [f32]) {
        let r = l * self.k..(l + 1) * self.k;
        (&self.tokens[r.clone()], &self.logprobs[r])
    }

    /// `d · k`, or a shape error when it overflows.
    pub(crate) fn entries(&self) -> Result<usize> {
        let (d, k) = (self.d, self.k);
        d.checked_mul(k).ok_or_else(|| Error::shape(format!("d = {d}, k = {k} overflows")))
    }

    /// Check the shape (`d · k` entries each, at most 65,534 rows), the log-probabilities (no
    /// NaN, no +inf) and the tokens (below `vocab`).
    pub(crate) fn check(&self, vocab: u32) -> Result<()> {
        let (d, k) = (self.d, self.k);
        let n = self.entries()?;
        if self.tokens.len() != n {
            return Err(Error::shape(format!(
                "topk_tokens has {} entries, expected d * k = {d} * {k}",
                self.tokens.len()
            )));
        }
        if self.logprobs.len() != n {
            return Err(Error::shape(format!(
                "topk_logprobs has {} entries, expected d * k = {d} * {k}",
                self.logprobs.len()
            )));
        }
        if d > u16::MAX as usize - 1 {
            return Err(Error::TooLarge { what: format!("d = {d} levels") });
        }
        for (i, (&t, &lp)) in self.tokens.iter().zip(self.logprobs).enumerate() {
            if lp.is_nan() || lp == f32::INFINITY {
                return Err(Error::BadLogprob { what: "topk_logprobs", row: i / k, col: i % k, value: lp });
            }
            if t >= vocab {
                return Err(Error::TokenOutOfVocab { what: "topk_tokens", token: t as u64, vocab });
            }
        }
        Ok(())
    }
}

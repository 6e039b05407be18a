//! dart-tree: draft-tree construction over the trigram index (no Python).
//!
//! * [`beam_search`]: DART's Eq. (10) — drafter top-k rows scored together with the trigram
//!   index in a beam search, the tree picked best-first (ancestor-closed by construction).
//! * [`ngram_tree`]: the same search driven by the index alone.
//! * [`top_b`]: DARTree's deferred global top-B with ancestor-first ties.
//! * [`best_first`]: DDTree's best-first heap over factorised marginals.
//! * [`beam_search_batch`]: several sequences at once on the crate's named pool.
//! * [`topk_logprobs`]: the drafter rows' top-k and their log-probabilities (Eq. (10)'s p_l).
//!
//! Trees come out as flat arrays in depth order ([`Tree`]) with ancestor bitmasks for the
//! verification mask.
mod beam;
mod error;
mod index_impl;
mod memo;
mod order;
mod params;
mod rows;
mod scorer;
#[cfg(feature = "bench")]
pub mod timing;
mod topb;
mod topk;
mod tree;

use rayon::prelude::*;

#[doc(hidden)]
pub use beam::beam_search_unpruned;
pub use beam::{beam_search, ngram_tree};
pub use error::{Error, Result};
pub use params::{Candidates, SearchParams};
pub use rows::TopkRows;
pub use scorer::{NgramScorer, NoNgram};
pub use topb::{best_first, top_b};
pub use topk::topk_logprobs;
pub use tree::{ancestor_bits, Tree};

/// [`beam_search`] for `contexts.len()` sequences at once: `rows` holds `B` blocks of `d`
/// rows back to back, `[B, d, k]` (sequence `b` uses rows `b*d .. b*d + d`). Runs on dartcore's one
/// owned pool, `dart_ngram::pool` (sized by `DART_NUM_THREADS` or
/// `dart_ngram::pool::set_num_threads`, fork-safe); the result is the same as `B` single
/// calls, in order.
/// Every input is validated before any search starts.
pub fn beam_search_batch<S: NgramScorer + ?Sized>(
    scorer: &S,
    contexts: &[&[u32]],
    rows: TopkRows<'_>,
    params: &SearchParams,
) -> Result<Vec<Tree>> {
    let bsz = contexts.len();
    let TopkRows { tokens: topk_tokens, logprobs: topk_logprobs, d, k } = rows;
    let per = rows.entries()?;
    let total = bsz.checked_mul(per).ok_or_else(|| Error::shape("batch too large"))?;
    if topk_tokens.len() != total || topk_logprobs.len() != total {
        return Err(Error::shape(format!(
            "batch of {bsz} with d = {d}, k = {k} needs {total} top-k entries, got {} tokens and {} log-probs",
            topk_tokens.len(),
            topk_logprobs.len()
        )));
    }
    let one = |b: usize| {
        let r = b * per..(b + 1) * per;
        beam_search(scorer, contexts[b], TopkRows::new(&topk_tokens[r.clone()], &topk_logprobs[r], d, k), params)
    };
    if bsz <= 1 || dart_ngram::pool::num_threads() <= 1 {
        return (0..bsz).map(one).collect();
    }
    dart_ngram::pool::get().install(|| (0..bsz).into_par_iter().with_max_len(1).map(one).collect())
}

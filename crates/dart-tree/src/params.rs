//! Every constant of the Eq. (10) search, with its defaults and the official searcher's preset.

use crate::{Error, Result};

/// Which expansions of the Eq. (10) search are candidates of the tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Candidates {
    /// Each level's best `beam_width` expansions (EOS-ended ones included); the non-EOS ones
    /// among them are the next beam.
    Beam,
    /// Every expansion of every level (Eq. (10) as the paper and its code have it); the best
    /// `beam_width` non-EOS expansions of a level are the next beam. The default (see
    /// [`SearchParams::default`]).
    #[default]
    All,
}

/// Every constant of Eq. (10). [`SearchParams::default`] is dartcore's `dart` tree (the one
/// place its defaults are written: the Python bindings read them from here);
/// [`SearchParams::official`] is the official searcher's tree, exactly.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchParams {
    /// w: nodes kept per level (the candidates); the non-EOS ones are expanded next level.
    pub beam_width: usize,
    /// θ: nodes in the tree besides the root.
    pub max_nodes: usize,
    /// Level weight base: the drafter term of level l is multiplied by `level_decay^l`.
    pub level_decay: f64,
    /// Weight of the n-gram term; 0 gives the drafter-only tree and never queries the index.
    pub ngram_weight: f64,
    /// Depth divisor exponent: Δs of level l is divided by `(l + 1)^depth_exponent`.
    pub depth_exponent: f64,
    /// ε inside both logarithms.
    pub eps: f64,
    /// Include the n-gram term at level 0 (DART's official code omits it).
    pub ngram_first_level: bool,
    /// Back off to the unigram distribution when neither the two-token nor the one-token
    /// context ever preceded a token (the official code has no unigram level).
    pub unigram_backoff: bool,
    /// Token ids that end a sequence: such nodes can be kept (and be in the tree) but are
    /// never expanded.
    pub eos: Vec<u32>,
    /// The candidate set ([`Candidates`]); the n-gram-only tree always uses `Beam`.
    pub candidates: Candidates,
}

impl Default for SearchParams {
    /// The paper's constants (w = 20, θ = 59, 0.9^l, 0.5, (l + 1)^0.7, ε = 1e-10) with the
    /// paper's candidate set, plus two choices of dartcore: the n-gram term at level 0 too, and
    /// the unigram level when neither context ever preceded a token.
    ///
    /// `candidates: All` by measurement: tools/sim_tau.py on the demo index, 10 greedy outputs
    /// x 64 tokens per eval set, tau equal at the CPU budget (4 nodes: humaneval / gsm8k /
    /// code_alpaca 1.736 / 2.006 / 2.169 for both) and higher with `All` at θ = 59 on every set
    /// (2.250 / 2.751 / 2.873 vs 2.226 / 2.739 / 2.830); it is also the tree the released
    /// drafters were trained against. Its cost is small since the search prunes against the
    /// tree's θ-th best path: search CPU p50 66-72 vs 62-63 µs for `Beam`
    /// (tools/bench_tree.py --index, real rows, d = 8, k = 25, w = 20, θ = 59, 7 alternated runs).
    fn default() -> Self {
        SearchParams {
            beam_width: 20,
            max_nodes: 59,
            level_decay: 0.9,
            ngram_weight: 0.5,
            depth_exponent: 0.7,
            eps: 1e-10,
            ngram_first_level: true,
            unigram_backoff: true,
            eos: Vec::new(),
            candidates: Candidates::All,
        }
    }
}

impl SearchParams {
    /// The official DART searcher's tree, exactly (fvliang/DART's C++ `Searcher` as its
    /// `cpp_search.py` builds it): the paper's constants, every expansion a candidate, no
    /// n-gram term at level 0 (`NO_NGRAM_ON_FIRST_TOKEN`), no unigram level (g = 0 when neither
    /// context ever preceded a token) and 60 nodes besides the root. On the official searcher's
    /// own trees (120 cases over a trie of the Dolma sample; tests/test_official_search.py) it
    /// gives the same node set wherever the official sort's order is specified. EOS ids are the
    /// caller's, as with [`SearchParams::default`].
    pub fn official() -> Self {
        SearchParams {
            max_nodes: 60,
            ngram_first_level: false,
            unigram_backoff: false,
            candidates: Candidates::All,
            ..SearchParams::default()
        }
    }

    /// Check every field; the searches call this first.
    pub fn validate(&self) -> Result<()> {
        if self.max_nodes == 0 {
            return Err(Error::ZeroBudget { name: "max_nodes" });
        }
        if self.max_nodes > i32::MAX as usize - 1 {
            return Err(Error::TooLarge { what: format!("max_nodes = {}", self.max_nodes) });
        }
        if self.beam_width == 0 {
            return Err(Error::Param { name: "beam_width", value: 0.0, why: "must be at least 1" });
        }
        let finite = |name, value: f64| {
            if value.is_finite() {
                Ok(())
            } else {
                Err(Error::Param { name, value, why: "must be finite" })
            }
        };
        finite("level_decay", self.level_decay)?;
        finite("ngram_weight", self.ngram_weight)?;
        finite("depth_exponent", self.depth_exponent)?;
        finite("eps", self.eps)?;
        if self.eps < 0.0 {
            return Err(Error::Param { name: "eps", value: self.eps, why: "must be >= 0" });
        }
        Ok(())
    }
}

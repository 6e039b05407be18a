//! The one error type of dart-tree. Every variant says what was wrong and how to fix it;
//! the bindings map all of them to `dartcore.TreeError` (a `ValueError`).
use std::fmt;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Invalid input to a tree builder. Never a panic: every check the search relies on is
/// made up front and reported here.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Two inputs disagree on their shape (e.g. `topk_tokens` is not `d * k` long).
    #[error("shape mismatch: {what}")]
    Shape { what: String },
    /// A log-probability is NaN or +inf (−inf is allowed and means "impossible token").
    #[error("{what}[{row}, {col}] is {value}: log-probabilities must be finite or -inf (NaN usually means the drafter logits overflowed)")]
    BadLogprob { what: &'static str, row: usize, col: usize, value: f32 },
    /// A score handed to `top_b` is NaN.
    #[error("score of node {node} is NaN: scores must be numbers (−inf is allowed)")]
    NanScore { node: usize },
    /// The node budget θ / B is zero.
    #[error("node budget {name} = 0: a tree needs at least one node besides the root")]
    ZeroBudget { name: &'static str },
    /// A numeric parameter is out of range.
    #[error("parameter {name} = {value} is invalid: {why}")]
    Param { name: &'static str, value: f64, why: &'static str },
    /// A token id is not below the index's vocabulary size.
    #[error("token id {token} in {what} is outside the index vocabulary (size {vocab}): the index was built with a different tokenizer, or the ids are corrupt")]
    TokenOutOfVocab { what: &'static str, token: u64, vocab: u32 },
    /// The committed context is empty; the root of the tree is its last token.
    #[error("context is empty: pass at least the last committed token (the root of the tree)")]
    EmptyContext,
    /// The same token appears twice in one top-k row; the tree would hold duplicate paths.
    #[error("token {token} appears twice in row {row} of topk_tokens: top-k rows must hold distinct ids")]
    DuplicateToken { row: usize, token: u32 },
    /// A parent index in `top_b` input is not a node created before its child.
    #[error("parents[{node}] = {parent}: every parent must be -1 (top level) or the index of an earlier node")]
    BadParent { node: usize, parent: i64 },
    /// The tree would be deeper than `u16::MAX` levels or larger than `i32::MAX` nodes.
    #[error("tree too large: {what}")]
    TooLarge { what: String },
    /// The n-gram index failed while answering a query (corrupt body).
    #[error(transparent)]
    Index(#[from] dart_ngram::Error),
}

impl Error {
    pub(crate) fn shape(what: impl fmt::Display) -> Self {
        Error::Shape { what: what.to_string() }
    }
}

//! The one error type of the crate. Messages say what is wrong and how to fix it.

use std::path::PathBuf;

/// Everything that can go wrong in dart-ngram.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The index (or run) file does not exist.
    #[error("index file not found: {path}")]
    NotFound { path: PathBuf },
    /// The path names a directory, FIFO, socket or device: refused before it is opened (a
    /// FIFO would block the open).
    #[error("{path} is {kind}, not an index file: pass the path of an index file built by ngram-build")]
    NotAFile { path: PathBuf, kind: &'static str },
    /// Any other I/O failure, with the path it concerns.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not a valid index file of a version this build reads.
    #[error("invalid index file: {0}")]
    Format(String),
    /// A run file (map output of the builder) is invalid or belongs to another build.
    #[error("invalid run file {path}: {reason}")]
    Run { path: PathBuf, reason: String },
    /// A token id is not below the vocabulary size.
    #[error("token id {token} is out of range for vocabulary size {vocab_size}")]
    TokenOutOfRange { token: u32, vocab_size: u32 },
    /// A DART `.trie` file that cannot be converted ([`crate::convert_dart_trie`]).
    #[error("{}: {problem}", path.display())]
    Trie { path: PathBuf, problem: TrieProblem },
    /// Indexes that cannot be merged: different vocabularies, or counts lost to pruning.
    #[error("cannot merge: {0}")]
    Merge(String),
    /// Bad build or query options.
    #[error("invalid option: {0}")]
    InvalidOption(String),
}

/// Why a `.trie` file cannot be converted (inside [`Error::Trie`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrieProblem {
    /// The file ends inside a node (or before its header is complete).
    #[error(
        "truncated: the file ends at byte {len} inside node {node} (of {nodes}); it is incomplete, download it again"
    )]
    Truncated { node: u64, nodes: u64, len: u64 },
    /// Not a `TrieNgram::save` file of order 3.
    #[error("not a DART TrieNgram(3) file: {reason}")]
    Foreign { reason: String },
    /// A node's int32 count is negative: it wrapped past 2^31 − 1 in the official builder.
    #[error("node {node} (token {token}, depth {depth}) has count {freq}: the official int32 count wrapped past 2^31-1, so the trie's counts are not exact and it cannot be converted")]
    NegativeCount { node: u64, token: i32, depth: u32, freq: i32 },
    /// A node's count is below the sum of its children's: a count wrapped (or the file is corrupt).
    #[error("node {node} (token {token}, depth {depth}) has count {count} but its children sum to {children}: an int32 count wrapped past 2^31-1 (or the file is corrupt); it cannot be converted exactly")]
    CountBelowChildren { node: u64, token: u32, depth: u32, count: u64, children: u64 },
    /// The nodes do not form a trigram trie over the vocabulary.
    #[error("node {node}: {reason}")]
    Structure { node: u64, reason: String },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            Error::NotFound { path }
        } else {
            Error::Io { path, source }
        }
    }
    pub(crate) fn format(msg: impl Into<String>) -> Self {
        Error::Format(msg.into())
    }
}

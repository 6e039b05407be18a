//! dart-ngram: the memory-mapped trigram index of dartcore.
//!
//! * [`format`]: the v1 on-disk layout (spec: `FORMAT.md` next to this crate's `Cargo.toml`).
//! * [`Builder`]: bounded-memory counting (sorted runs on disk, k-way merge) to an index file.
//! * [`Index`]: O(1) open over any bytes (`Vec<u8>` in tests, `Mmap` in production) and the
//!   queries of the Eq. (10) search: [`Index::children`], [`Index::count`], [`Index::prob`],
//!   [`Index::cond_probs`], [`Index::children_batch`].
//! * [`merge_indexes`]: indexes read back as keys ([`Index::keys`]) and merged into one, whose
//!   counts are those of an index built from all their documents.
//! * [`dart_trie`]: streaming conversion of the official DART `.trie` into an index.
//! * [`pool`]: the one owned, named rayon pool (`DART_NUM_THREADS`), NUMA topology, fork safety.
//! * `timing` (feature `bench`): per-query latencies measured in Rust, for the benchmarks.

mod builder;
pub mod dart_trie;
mod error;
pub mod format;
pub mod pool;
mod radix;
mod reader;
mod reader_verify;
#[cfg(feature = "bench")]
pub mod timing;

pub use builder::{merge_indexes, merge_run_range, merge_runs, BuildOptions, BuildSummary, Builder};
pub use dart_trie::{convert_dart_trie, TrieProgress, TrieSummary};
pub use error::{Error, Result, TrieProblem};
/// The byte type of a file-backed index (`Index<Mmap>`), re-exported so dependants need no memmap2.
pub use memmap2::Mmap;
pub use reader::{BatchChildren, Children, Index, Keys, Match, OpenOptions, Stats, Verify, MAX_BATCH_BYTES};

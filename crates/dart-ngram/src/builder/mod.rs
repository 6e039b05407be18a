//! The builder: token-id documents → index file, in bounded memory.
//!
//! Map: every token position i of a document emits one 63-bit key
//! `(d[i], d[i+1] or END, d[i+2] or END)` (21 bits each, END = 2^21 − 1) into a buffer of
//! `memory_limit / 16` keys. A full buffer is sorted on the owned pool and spilled as a run
//! file of (key, count) pairs (sorted, aggregated, CRC-checked, self-describing). These padded
//! trigram keys carry every figure of the index: count(a) = Σ (a,*,*); total(a) = count(a)
//! minus the document-final (a,END,END); count(a,b) = Σ (a,b,*); total(a,b) = count(a,b)
//! minus (a,b,END); trigram counts = (a,b,c≠END). No n-gram crosses a document boundary.
//!
//! Reduce: a k-way merge of the runs (or the in-memory buffer when nothing was spilled)
//! streams sorted (key, count) pairs into [`IndexWriter`], which writes each section to its
//! own temporary file and finally assembles header + table + sections into a temporary file
//! next to the output and renames it over the output (a crash never leaves a partial index).
//!
//! Memory: the key buffer and its radix scratch (memory_limit / 4 each), read buffers of the
//! merge (memory_limit / 4 shared by all runs, at least 64 KiB each), vocabulary-sized arrays
//! (~60 bytes per vocabulary entry), and the children of one context (with a per-context
//! cap: of one first token, 16 bytes per trigram child).
//!
//! Modules: [`options`] (what a build is asked and reports), [`count`] (the map side:
//! [`Builder`]), [`runs`] (run files and the key layout), [`merge`] (k-way merges of runs),
//! [`writer`] (the index sections), [`files`] (output checks, locked temporary files).

mod count;
mod files;
mod merge;
mod options;
mod runs;
mod writer;

pub use count::Builder;
pub use merge::{merge_indexes, merge_run_range, merge_runs};
pub use options::{BuildOptions, BuildSummary};
pub(crate) use runs::write_run;
/// The key layout, for reading an index back as keys (`crate::reader::Keys`).
pub(crate) use runs::{key as pack_key, END as KEY_END};

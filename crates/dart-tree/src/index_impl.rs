//! `NgramScorer` for the real index (`dart_ngram::Index`). Filled in once the index crate
//! exposes its query API.

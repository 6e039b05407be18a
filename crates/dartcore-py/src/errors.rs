//! placeholder, filled in by the index/tree issues

//! dart-ngram: the trigram index (see FORMAT.md). Filled in by issue 2.

//! dart-tree: draft-tree construction. Filled in by issue 4.

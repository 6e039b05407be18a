//! The DART `.trie` converter against the builder: a trie grown from documents the way the
//! official `TrieNgram(3)::add_conversation` grows it (every window of up to 3 tokens, nodes in
//! creation order) converts to the same index bytes as building from the documents.

use std::path::Path;

use dart_ngram::{convert_dart_trie, BuildOptions, Builder, Error, TrieProblem};
use proptest::prelude::*;

/// One node of a TrieNgram(3): token, parent, freq, children (token -> child id).
type Node = (i32, u64, i32, Vec<(i32, u64)>);

/// A TrieNgram(3) in memory.
struct Trie {
    nodes: Vec<Node>,
}

impl Trie {
    fn new() -> Self {
        Trie { nodes: vec![(0, 0, 0, Vec::new())] }
    }
    fn child(&mut self, at: usize, t: u32) -> usize {
        if let Some(&(_, c)) = self.nodes[at].3.iter().find(|(tok, _)| *tok == t as i32) {
            return c as usize;
        }
        let id = self.nodes.len();
        self.nodes.push((t as i32, at as u64, 0, Vec::new()));
        self.nodes[at].3.push((t as i32, id as u64));
        id
    }
    fn add_document(&mut self, doc: &[u32]) {
        for i in 0..doc.len() {
            self.nodes[0].2 += 1;
            let mut at = 0;
            for &t in &doc[i..(i + 3).min(doc.len())] {
                at = self.child(at, t);
                self.nodes[at].2 += 1;
            }
        }
    }
    fn save(&self, path: &Path) {
        let mut b = Vec::new();
        b.extend(3u64.to_le_bytes());
        b.extend((self.nodes.len() as u64).to_le_bytes());
        for (t, p, f, ch) in &self.nodes {
            b.extend(t.to_le_bytes());
            b.extend(p.to_le_bytes());
            b.extend(f.to_le_bytes());
            b.extend((ch.len() as u64).to_le_bytes());
            for (ct, cid) in ch {
                b.extend(ct.to_le_bytes());
                b.extend(cid.to_le_bytes());
            }
        }
        std::fs::write(path, b).unwrap();
    }
}

fn opts(vocab: u32) -> BuildOptions {
    BuildOptions { vocab_size: vocab, memory_limit_bytes: 1 << 20, threads: Some(1), ..BuildOptions::default() }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(60))]

    #[test]
    fn converted_trie_equals_the_built_index(docs in prop::collection::vec(prop::collection::vec(0u32..20, 1..40), 1..8)) {
        let dir = tempfile::tempdir().unwrap();
        let mut trie = Trie::new();
        for d in &docs {
            trie.add_document(d);
        }
        trie.save(&dir.path().join("x.trie"));
        let s = convert_dart_trie(&dir.path().join("x.trie"), &dir.path().join("from-trie.idx"), &opts(20), "{}", &mut |_| {}).unwrap();
        prop_assert_eq!(s.trie_nodes as usize, trie.nodes.len());
        let mut b = Builder::new(opts(20)).unwrap();
        for d in &docs {
            b.add_document(d).unwrap();
        }
        b.finish(&dir.path().join("built.idx"), "{}").unwrap();
        let (x, y) = (std::fs::read(dir.path().join("from-trie.idx")).unwrap(), std::fs::read(dir.path().join("built.idx")).unwrap());
        prop_assert!(x == y, "the converted index differs from the built one");
        prop_assert_eq!(s.build.documents, docs.len() as u64);
    }
}

fn problem(data: &[u8]) -> TrieProblem {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("x.trie"), data).unwrap();
    match convert_dart_trie(&dir.path().join("x.trie"), &dir.path().join("x.idx"), &opts(20), "{}", &mut |_| {}) {
        Err(Error::Trie { problem, .. }) => {
            assert!(!dir.path().join("x.idx").exists());
            problem
        }
        other => panic!("expected a trie error, got {other:?}"),
    }
}

#[test]
fn bad_files_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut trie = Trie::new();
    trie.add_document(&[1, 2, 3, 4, 1, 2, 5]);
    let path = dir.path().join("ok.trie");
    trie.save(&path);
    let data = std::fs::read(&path).unwrap();
    for cut in [0, 9, 16, 30, data.len() - 1] {
        assert!(
            matches!(problem(&data[..cut]), TrieProblem::Truncated { .. } | TrieProblem::Foreign { .. }),
            "cut {cut}"
        );
    }
    assert!(matches!(problem(&data[..data.len() - 1]), TrieProblem::Truncated { .. }));
    let mut order4 = data.clone();
    order4[0] = 4;
    assert!(matches!(problem(&order4), TrieProblem::Foreign { .. }));
    // node 1's freq (offset 16 + root record and children + 12) set negative: named
    let root_len = 24 + 12 * trie.nodes[0].3.len();
    let mut neg = data.clone();
    neg[16 + root_len + 12..16 + root_len + 16].copy_from_slice(&(-7i32).to_le_bytes());
    match problem(&neg) {
        TrieProblem::NegativeCount { node: 1, freq: -7, depth: 1, .. } => {}
        p => panic!("{p}"),
    }
    // a unigram count below its bigrams' sum (a wrapped count)
    let mut low = data.clone();
    low[16 + root_len + 12..16 + root_len + 16].copy_from_slice(&0i32.to_le_bytes());
    assert!(matches!(problem(&low), TrieProblem::CountBelowChildren { node: 1, depth: 1, .. }));
    // the input is never the output
    let e = convert_dart_trie(&path, &path, &opts(20), "{}", &mut |_| {}).unwrap_err();
    assert!(matches!(e, Error::InvalidOption(_)), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), data);
}

//! Merging indexes: the merged file equals, byte for byte, the index built from all the
//! documents (whose counts tests/roundtrip.rs checks against brute force), and bad inputs
//! are refused.

use dart_ngram::{merge_indexes, BuildOptions, Builder, Error, Index};
use proptest::prelude::*;

fn opts(vocab: u32) -> BuildOptions {
    BuildOptions { vocab_size: vocab, token_bits: Some(21), ..Default::default() }
}

fn build(dir: &std::path::Path, name: &str, docs: &[Vec<u32>], o: BuildOptions) -> std::path::PathBuf {
    let out = dir.join(name);
    let mut b = Builder::new(o).unwrap();
    for d in docs {
        b.add_document(d).unwrap();
    }
    b.finish(&out, "{}").unwrap();
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, .. ProptestConfig::default() })]

    #[test]
    fn prop_merge_equals_union_build(
        x in prop::collection::vec(prop::collection::vec(0u32..9, 0..30), 0..12),
        y in prop::collection::vec(prop::collection::vec(0u32..9, 0..30), 0..12),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let a = build(dir.path(), "a.idx", &x, opts(9));
        let b = build(dir.path(), "b.idx", &y, opts(9));
        let all: Vec<Vec<u32>> = x.iter().chain(&y).cloned().collect();
        let u = build(dir.path(), "u.idx", &all, opts(9));
        let (ia, ib) = (Index::open(&a).unwrap(), Index::open(&b).unwrap());
        let m = dir.path().join("m.idx");
        merge_indexes(&[&ia, &ib], &m, &opts(9), "{}").unwrap();
        prop_assert_eq!(std::fs::read(&m).unwrap(), std::fs::read(&u).unwrap());
        // an index read back as keys and written again is the same file
        let m1 = dir.path().join("m1.idx");
        merge_indexes(&[&ia], &m1, &opts(9), "{}").unwrap();
        prop_assert_eq!(std::fs::read(&m1).unwrap(), std::fs::read(&a).unwrap());
        // counts() of one context equals count() token by token
        let toks: Vec<u32> = (0..9).rev().collect();
        for ctx in [vec![], vec![1], vec![2, 3], vec![0, 0]] {
            let mut out = vec![7u64; toks.len()];
            let total = ia.counts(&ctx, &toks, &mut out);
            for (&t, &c) in toks.iter().zip(&out) {
                let (want, tot) = ia.count(&ctx, t);
                prop_assert_eq!(c, want);
                prop_assert_eq!(total, tot);
            }
        }
    }
}

#[test]
fn refuses_other_vocab_pruned_and_own_input() {
    let dir = tempfile::tempdir().unwrap();
    let docs = vec![vec![1, 2, 3, 1, 2, 4], vec![2, 3, 1, 2, 3]];
    let a = build(dir.path(), "a.idx", &docs, opts(9));
    let b = build(dir.path(), "b.idx", &docs, opts(10));
    let p = build(dir.path(), "p.idx", &docs, BuildOptions { min_count: 2, ..opts(9) });
    let (ia, ib, ip) = (Index::open(&a).unwrap(), Index::open(&b).unwrap(), Index::open(&p).unwrap());
    let out = dir.path().join("m.idx");
    let e = merge_indexes(&[&ia, &ib], &out, &opts(9), "{}").unwrap_err();
    assert!(matches!(e, Error::Merge(ref m) if m.contains("vocabulary size 10")), "{e}");
    let e = merge_indexes(&[&ia, &ip], &out, &opts(9), "{}").unwrap_err();
    assert!(matches!(e, Error::Merge(ref m) if m.contains("min_count")), "{e}");
    assert!(!out.exists());
    let before = std::fs::read(&a).unwrap();
    let e = merge_indexes(&[&ia], &a, &opts(9), "{}").unwrap_err();
    assert!(matches!(e, Error::InvalidOption(ref m) if m.contains("one of the inputs")), "{e}");
    assert_eq!(std::fs::read(&a).unwrap(), before);
}

#[test]
fn refuses_a_corrupt_body() {
    let dir = tempfile::tempdir().unwrap();
    let a = build(dir.path(), "a.idx", &[vec![1, 2, 3, 1, 2, 4, 5, 6]], opts(9));
    let mut bytes = std::fs::read(&a).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x5a;
    let ix = match Index::from_bytes(bytes) {
        Ok(ix) => ix,
        Err(e) => panic!("the header is intact, open must succeed: {e}"),
    };
    let e = merge_indexes(&[&ix], &dir.path().join("m.idx"), &opts(9), "{}").unwrap_err();
    assert!(matches!(e, Error::Format(_)), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, .. ProptestConfig::default() })]

    /// An index read back as keys never panics on damaged bytes: items or an error.
    #[test]
    fn keys_of_damaged_bytes_never_panic(flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
        let dir = tempfile::tempdir().unwrap();
        let docs = vec![vec![1, 2, 3, 1, 2, 4, 5, 6, 0, 0, 8], vec![2, 3, 1, 2, 3, 7, 7, 7]];
        let mut bytes = std::fs::read(build(dir.path(), "a.idx", &docs, opts(9))).unwrap();
        let n = bytes.len();
        for (pos, x) in flips {
            bytes[pos % n] ^= x | 1;
        }
        if let Ok(ix) = Index::from_bytes(bytes) {
            for k in ix.keys() {
                if k.is_err() {
                    break;
                }
            }
        }
    }
}

//! The searches on a real `dart_ngram::Index` give the same trees as on the hash-map model.
mod common;

use common::{check_tree, Model};
use dart_ngram::{BuildOptions, Builder, Index};
use dart_tree::{beam_search, beam_search_batch, ngram_tree, Error, NgramScorer, SearchParams, TopkRows};
use proptest::prelude::*;

const V: u32 = 12;

fn build(seq: &[u32]) -> (tempfile::TempDir, Index<Vec<u8>>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.idx");
    let mut b = Builder::new(BuildOptions {
        vocab_size: V,
        threads: Some(1),
        temp_dir: Some(dir.path().to_path_buf()),
        ..BuildOptions::default()
    })
    .unwrap();
    b.add_document(seq).unwrap();
    b.finish(&path, "{}").unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (dir, Index::from_bytes(bytes).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn index_and_model_give_the_same_trees(
        seq in prop::collection::vec(0..V, 1..300),
        context in prop::collection::vec(0..V, 1..4),
        rows in prop::collection::vec(Just((0..V).collect::<Vec<u32>>()).prop_shuffle(), 4),
        lps in prop::collection::vec(-6.0f32..0.0, 16),
        ub in any::<bool>(), first in any::<bool>(),
    ) {
        let (_dir, index) = build(&seq);
        let model = Model::new(seq.clone(), V);
        let (d, k) = (4, 4);
        let toks: Vec<u32> = rows.iter().flat_map(|r| r[..k].to_vec()).collect();
        let params = SearchParams { beam_width: 3, max_nodes: 12, unigram_backoff: ub, ngram_first_level: first, ..SearchParams::default() };
        let a = beam_search(&index, &context, TopkRows::new(&toks, &lps, d, k), &params).unwrap();
        let b = beam_search(&model, &context, TopkRows::new(&toks, &lps, d, k), &params).unwrap();
        check_tree(&a, 12);
        prop_assert_eq!(&a, &b);
        let a = ngram_tree(&index, &context, 4, 3, &params).unwrap();
        let b = ngram_tree(&model, &context, 4, 3, &params).unwrap();
        prop_assert_eq!(&a, &b);
        let ctxs: Vec<&[u32]> = vec![&context, &context[..1]];
        let two_t: Vec<u32> = toks.iter().chain(&toks).copied().collect();
        let two_l: Vec<f32> = lps.iter().chain(&lps).copied().collect();
        let batch = beam_search_batch(&index, &ctxs, TopkRows::new(&two_t, &two_l, d, k), &params).unwrap();
        prop_assert_eq!(&batch[1], &beam_search(&model, &context[..1], TopkRows::new(&toks, &lps, d, k), &params).unwrap());
    }
}

#[test]
fn out_of_vocabulary_ids_are_errors() {
    let (_dir, index) = build(&[1, 2, 3]);
    let p = SearchParams::default();
    assert!(matches!(
        beam_search(&index, &[1, V], TopkRows::new(&[1], &[0.0], 1, 1), &p),
        Err(Error::TokenOutOfVocab { .. })
    ));
    assert!(matches!(
        beam_search(&index, &[1], TopkRows::new(&[V + 5], &[0.0], 1, 1), &p),
        Err(Error::TokenOutOfVocab { .. })
    ));
    assert!(matches!(ngram_tree(&index, &[V], 2, 2, &p), Err(Error::TokenOutOfVocab { .. })));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The search's split of g(v | a, b) — `trigram_probs`, then the one-token column of b
    /// (memoised per b and shared between contexts) where it is NaN — equals the two-token
    /// `cond_probs` bit for bit, on the index and on the model.
    #[test]
    fn trigram_level_plus_one_token_backoff_is_cond_probs(
        seq in prop::collection::vec(0..V, 1..300),
        a in 0..V, b in 0..V,
        cands in prop::collection::btree_set(0..V, 1..V as usize),
        ub in any::<bool>(),
    ) {
        let (_dir, index) = build(&seq);
        let model = Model::new(seq.clone(), V);
        let cands: Vec<u32> = cands.into_iter().collect();
        let n = cands.len();
        for scorer in [&index as &dyn NgramScorer, &model] {
            let (mut want, mut tri, mut one) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            scorer.cond_probs(&[a, b], &cands, ub, &mut want);
            scorer.trigram_probs([a, b], &cands, &mut tri);
            scorer.cond_probs(&[b], &cands, ub, &mut one);
            for i in 0..n {
                let got = if tri[i].is_nan() { one[i] } else { tri[i] };
                prop_assert_eq!(got.to_bits(), want[i].to_bits(), "candidate {}", cands[i]);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// `backoff_bound(b)` and the bound of `trigram_context` (the search prunes lookups with
    /// them) are never below a real probability, on contexts with and without a stored top-k
    /// row (over 32 children) and with large (escaped) counts; `trigram_probs_at` equals
    /// `trigram_probs`.
    #[test]
    fn pruning_bounds_are_upper_bounds(
        tail in prop::collection::vec(0..400u32, 2..400),
        repeats in 0..3000usize,
        ub in any::<bool>(),
    ) {
        const W: u32 = 400;
        // token 0 is followed by many distinct tokens and by token 1 `repeats` times; so is
        // the pair (1, 0)
        let mut seq = Vec::new();
        for &t in &tail {
            seq.extend([0, t, 1]);
        }
        seq.extend(std::iter::repeat_n([0, 1], repeats).flatten());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.idx");
        let mut bld = Builder::new(BuildOptions { vocab_size: W, threads: Some(1), temp_dir: Some(dir.path().to_path_buf()), ..BuildOptions::default() }).unwrap();
        bld.add_document(&seq).unwrap();
        bld.finish(&path, "{}").unwrap();
        let index = Index::from_bytes(std::fs::read(&path).unwrap()).unwrap();
        let cands: Vec<u32> = (0..W).collect();
        let mut out = vec![0.0f64; W as usize];
        let mut at = vec![0.0f64; W as usize];
        for b in [0, 1, tail[0], tail[1], W - 1] {
            let bound = index.backoff_bound(b, ub);
            index.cond_probs(&[b], &cands, ub, &mut out);
            let max = out.iter().copied().fold(0.0, f64::max);
            prop_assert!(bound >= max && bound <= 1.0, "b = {}: bound {} < max {}", b, bound, max);
            // the two-token context (x, b): its handle gives trigram_probs bit for bit, and
            // its bound is never below a value
            for x in [0, 1, tail[0], W - 1] {
                let (handle, bound) = NgramScorer::trigram_context(&index, [x, b]);
                NgramScorer::trigram_probs(&index, [x, b], &cands, &mut out);
                NgramScorer::trigram_probs_at(&index, [x, b], handle, &cands, &mut at);
                for (o, a) in out.iter().zip(&at) {
                    prop_assert_eq!(o.to_bits(), a.to_bits());
                }
                // the index's node handle (trigram_probs_at) gives the same values
                let (node, node_bound) = Index::trigram_context(&index, x, b);
                prop_assert_eq!(node_bound.to_bits(), bound.to_bits());
                Index::trigram_probs_at(&index, node, &cands, &mut at);
                for (o, a) in out.iter().zip(&at) {
                    prop_assert_eq!(o.to_bits(), a.to_bits());
                }
                let max = out.iter().copied().filter(|g| !g.is_nan()).fold(0.0, f64::max);
                prop_assert!(bound >= max && bound <= 1.0, "({}, {}): bound {} < max {}", x, b, bound, max);
            }
        }
    }
}

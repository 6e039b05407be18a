//! Eq. (10) beam search and the n-gram tree against plain-loop references.
mod common;

use common::{check_tree, ref_beam_search, ref_keep, ref_select, token_paths, Model, RefNode};
use dart_tree::{beam_search, beam_search_batch, ngram_tree, Candidates, Error, NoNgram, SearchParams, TopkRows};
use proptest::prelude::*;

const V: u32 = 10;

/// Random small problem: corpus, context, [d, k] rows with distinct tokens, parameters.
#[derive(Debug, Clone)]
struct Case {
    seq: Vec<u32>,
    context: Vec<u32>,
    toks: Vec<u32>,
    lps: Vec<f32>,
    d: usize,
    k: usize,
    params: SearchParams,
}

fn logprob() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => -8.0f32..0.0,
        1 => Just(0.0f32),
        1 => Just((0.5f32).ln()),
        1 => Just(f32::NEG_INFINITY),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..5, 1usize..6).prop_flat_map(|(d, k)| {
        (
            prop::collection::vec(0..V, 0..120),
            prop::collection::vec(0..V, 1..5),
            prop::collection::vec(Just((0..V).collect::<Vec<u32>>()).prop_shuffle(), d),
            prop::collection::vec(logprob(), d * k),
            (1usize..5, 1usize..25, prop_oneof![Just(0.0), Just(0.5), Just(1.0)], any::<bool>(), any::<bool>()),
            prop::collection::vec(0..V, 0..2),
            // Exact-tie regimes: ε = 0, no decay, no depth divisor make equal Δs across levels.
            (prop_oneof![Just(1e-10), Just(0.0)], prop_oneof![Just(0.9), Just(1.0)], prop_oneof![Just(0.7), Just(0.0)]),
        )
            .prop_map(move |(seq, context, perms, lps, (w, theta, nw, first, ub), eos, (eps, decay, expo))| {
                let toks = perms.iter().flat_map(|p| p[..k].to_vec()).collect();
                let params = SearchParams {
                    beam_width: w,
                    max_nodes: theta,
                    ngram_weight: nw,
                    ngram_first_level: first,
                    unigram_backoff: ub,
                    eos,
                    eps,
                    level_decay: decay,
                    depth_exponent: expo,
                    candidates: Candidates::Beam,
                };
                Case { seq, context, toks, lps, d, k, params }
            })
    })
}

fn paths_and_scores(t: &dart_tree::Tree) -> Vec<(Vec<u32>, f64)> {
    token_paths(t).into_iter().zip(t.scores[1..].iter().copied()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn beam_search_equals_reference(c in case()) {
        let model = Model::new(c.seq.clone(), V);
        let tree = beam_search(&model, &c.context, TopkRows::new(&c.toks, &c.lps, c.d, c.k), &c.params).unwrap();
        check_tree(&tree, c.params.max_nodes);
        prop_assert_eq!(tree.tokens[0], *c.context.last().unwrap());
        let mut got = paths_and_scores(&tree);
        let mut want = ref_beam_search(&c.seq, &c.context, &c.toks, &c.lps, c.d, c.k, &c.params);
        // Same node set (by path) with the same scores; order within a depth is pop order,
        // the reference lists selection order, so compare sorted by path.
        got.sort_by(|a, b| a.0.cmp(&b.0));
        want.sort_by(|a, b| a.0.cmp(&b.0));
        prop_assert_eq!(got.len(), want.len());
        for ((gp, gs), (wp, ws)) in got.iter().zip(&want) {
            prop_assert_eq!(gp, wp);
            prop_assert!(gs == ws || (gs - ws).abs() <= 1e-9 * ws.abs().max(1.0), "{} vs {}", gs, ws);
        }
        // −inf tokens never appear; EOS nodes are leaves.
        for i in 1..tree.len() {
            let l = tree.depths[i] as usize - 1;
            let j = c.toks[l * c.k..(l + 1) * c.k].iter().position(|&t| t == tree.tokens[i]).unwrap();
            prop_assert!(c.lps[l * c.k + j] != f32::NEG_INFINITY);
            if c.params.eos.contains(&tree.tokens[i]) {
                prop_assert!(!tree.parents.contains(&(i as i32)));
            }
        }
    }

    #[test]
    fn batch_equals_single_calls(cs in prop::collection::vec(case(), 1..5)) {
        // Same d, k and params for the batch: take them from the first case.
        let (d, k, params) = (cs[0].d, cs[0].k, cs[0].params.clone());
        let model = Model::new(cs[0].seq.clone(), V);
        let cases: Vec<&Case> = cs.iter().filter(|c| c.d == d && c.k == k).collect();
        let contexts: Vec<&[u32]> = cases.iter().map(|c| c.context.as_slice()).collect();
        let toks: Vec<u32> = cases.iter().flat_map(|c| c.toks.clone()).collect();
        let lps: Vec<f32> = cases.iter().flat_map(|c| c.lps.clone()).collect();
        let trees = beam_search_batch(&model, &contexts, TopkRows::new(&toks, &lps, d, k), &params).unwrap();
        prop_assert_eq!(trees.len(), cases.len());
        for (t, c) in trees.iter().zip(&cases) {
            prop_assert_eq!(t, &beam_search(&model, &c.context, TopkRows::new(&c.toks, &c.lps, d, k), &params).unwrap());
        }
    }

    #[test]
    fn ngram_tree_equals_reference(
        seq in prop::collection::vec(0..V, 0..150),
        context in prop::collection::vec(0..V, 1..4),
        depth in 1usize..5, k in 1usize..5, w in 1usize..4, theta in 1usize..20, ub in any::<bool>(),
    ) {
        let model = Model::new(seq.clone(), V);
        let params = SearchParams { beam_width: w, max_nodes: theta, unigram_backoff: ub, ..SearchParams::default() };
        let tree = ngram_tree(&model, &context, depth, k, &params).unwrap();
        check_tree(&tree, theta);
        // Reference: children of the longest suffix with any continuation, by scanning.
        let mut cands: Vec<RefNode> = Vec::new();
        let mut beam: Vec<Option<usize>> = vec![None];
        for l in 0..depth {
            let scale = params.ngram_weight / ((l + 1) as f64).powf(params.depth_exponent);
            let mut level_nodes = Vec::new();
            for &e in &beam {
                let (ppath, ps) = e.map_or((vec![], 0.0), |i| (cands[i].path.clone(), cands[i].score));
                let mut full = context.clone();
                full.extend(&ppath);
                let lo = if ub { 0 } else { 1 };
                for len in (lo..=full.len().min(2)).rev() {
                    let c = &full[full.len() - len..];
                    let mut counts = vec![0u64; V as usize];
                    for i in len..seq.len() {
                        if &seq[i - len..i] == c { counts[seq[i] as usize] += 1; }
                    }
                    let total: u64 = counts.iter().sum();
                    if total == 0 { continue; }
                    let mut kids: Vec<u32> = (0..V).filter(|&v| counts[v as usize] > 0).collect();
                    kids.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
                    for &v in kids.iter().take(k) {
                        let g = counts[v as usize] as f64 / total as f64;
                        let mut path = ppath.clone();
                        path.push(v);
                        level_nodes.push(RefNode { path, score: ps + scale * (g + params.eps).ln(), level: l, parent: e });
                    }
                    break;
                }
            }
            beam = ref_keep(&mut cands, level_nodes, w, &[]).into_iter().map(Some).collect();
        }
        let mut want: Vec<(Vec<u32>, f64)> = ref_select(&cands, theta).into_iter().map(|i| (cands[i].path.clone(), cands[i].score)).collect();
        let mut got = paths_and_scores(&tree);
        got.sort_by(|a, b| a.0.cmp(&b.0));
        want.sort_by(|a, b| a.0.cmp(&b.0));
        prop_assert_eq!(got.len(), want.len());
        for ((gp, gs), (wp, ws)) in got.iter().zip(&want) {
            prop_assert_eq!(gp, wp);
            prop_assert!(gs == ws || (gs - ws).abs() <= 1e-9 * ws.abs().max(1.0));
        }
    }
}

/// Chains of probability 1.0: every level adds ln(1 + ε) > 0, so each child outscores its
/// parent by ~1e-10. A global sort-and-cut (the official code) keeps the deepest nodes and
/// loses their ancestors; the best-first selection must return the first θ levels.
#[test]
fn probability_one_chains_stay_ancestor_closed() {
    let d = 10;
    // Corpus that is itself a chain, so g = 1 too and the n-gram term is also ln(1 + ε).
    let chain: Vec<u32> = (0..12).collect();
    let model = Model::new(chain.clone(), 12);
    for &theta in &[3usize, 5, 8] {
        for &nw in &[0.0, 0.5] {
            let params = SearchParams { max_nodes: theta, ngram_weight: nw, ..SearchParams::default() };
            let toks: Vec<u32> = (2..2 + d as u32).collect();
            let lps = vec![0.0f32; d];
            let tree = beam_search(&model, &[0, 1], TopkRows::new(&toks, &lps, d, 1), &params).unwrap();
            check_tree(&tree, theta);
            assert_eq!(tree.len(), theta + 1);
            assert_eq!(tree.tokens, (1..2 + theta as u32).collect::<Vec<_>>());
            assert_eq!(tree.depths, (0..=theta as u16).collect::<Vec<_>>());
            // Scores do increase down the chain: this is the case that breaks sort-and-cut.
            assert!(tree.scores.windows(2).all(|w| w[1] > w[0]), "{:?}", tree.scores);
            let mut all: Vec<(usize, f64)> = (0..d)
                .map(|l| {
                    let t = beam_search(
                        &model,
                        &[0, 1],
                        TopkRows::new(&toks, &lps, d, 1),
                        &SearchParams { max_nodes: d, ..params.clone() },
                    )
                    .unwrap();
                    (l, t.scores[l + 1])
                })
                .collect();
            all.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
            let cut: Vec<usize> = all[..theta].iter().map(|x| x.0).collect();
            assert!(!cut.contains(&0), "sort-and-cut would keep level 0, so the test pins nothing");
        }
    }
}

/// `beam_width = 1` keeps one node per level: the tree is the greedy chain.
#[test]
fn beam_width_one_is_a_chain() {
    let toks: Vec<u32> = (0..12).collect();
    let lps = vec![-1.0f32, -0.2, -3.0, -0.1, -2.0, -2.5, -4.0, -1.0, -0.3, -0.7, -0.6, -5.0];
    let params = SearchParams {
        beam_width: 1,
        max_nodes: 59,
        ngram_weight: 0.0,
        candidates: Candidates::Beam,
        ..SearchParams::default()
    };
    let t = beam_search(&NoNgram, &[50], TopkRows::new(&toks, &lps, 4, 3), &params).unwrap();
    assert_eq!(t.tokens, vec![50, 1, 3, 8, 10]);
    assert_eq!(t.parents, vec![-1, 0, 1, 2, 3]);
}

/// Wide rows with two probability-1 branches and exact ties everywhere.
#[test]
fn ties_break_shallower_first_then_creation_order() {
    let d = 4;
    let k = 3;
    // Row l: tokens 3l..3l+3, equal probabilities 1/3 (exact ties across siblings and beams).
    let toks: Vec<u32> = (0..(d * k) as u32).collect();
    let lps = vec![(1.0f32 / 3.0).ln(); d * k];
    for &theta in &[3usize, 5, 8, 20] {
        let params = SearchParams {
            max_nodes: theta,
            ngram_weight: 0.0,
            beam_width: 2,
            candidates: Candidates::Beam,
            ..SearchParams::default()
        };
        let tree = beam_search(&NoNgram, &[100], TopkRows::new(&toks, &lps, d, k), &params).unwrap();
        check_tree(&tree, theta);
        let want = ref_beam_search(&[], &[100], &toks, &lps, d, k, &params);
        let got_paths = token_paths(&tree);
        let mut w: Vec<Vec<u32>> = want.into_iter().map(|x| x.0).collect();
        let mut g = got_paths.clone();
        w.sort();
        g.sort();
        assert_eq!(g, w, "theta {theta}");
    }
}

/// Equal scores on different levels: the shallower node goes first.
#[test]
fn cross_level_tie_prefers_the_shallower_node() {
    let half = (0.5f32).ln();
    let params = SearchParams {
        max_nodes: 3,
        ngram_weight: 0.0,
        eps: 0.0,
        level_decay: 1.0,
        depth_exponent: 0.0,
        ..SearchParams::default()
    };
    // Scores: 10 -> 0, 10/20 -> 0, then 11 and 10/21 tie exactly at ln(exp(half)).
    let tree =
        beam_search(&NoNgram, &[7], TopkRows::new(&[10, 11, 20, 21], &[0.0, half, 0.0, half], 2, 2), &params).unwrap();
    let mut paths = token_paths(&tree);
    paths.sort();
    assert_eq!(paths, vec![vec![10], vec![10, 20], vec![11]]);
}

#[test]
fn one_token_context_backs_off_to_bigrams() {
    let seq = vec![1, 2, 3, 1, 2, 4, 5, 2, 3];
    let model = Model::new(seq.clone(), 8);
    let toks = vec![3, 4, 5, 1];
    let lps = vec![-0.5f32, -1.0, -2.0, -3.0];
    let params = SearchParams::default();
    let tree = beam_search(&model, &[2], TopkRows::new(&toks, &lps, 1, 4), &params).unwrap();
    let want = ref_beam_search(&seq, &[2], &toks, &lps, 1, 4, &params);
    let mut got = paths_and_scores(&tree);
    let mut want = want;
    got.sort_by(|a, b| a.0.cmp(&b.0));
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got.len(), want.len());
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(a.0, b.0);
        assert!((a.1 - b.1).abs() < 1e-12);
    }
}

#[test]
fn bad_input_is_an_error() {
    let m = Model::new(vec![0, 1, 2, 3], 4);
    let p = SearchParams::default();
    let ok_t = [1u32, 2];
    let ok_l = [-0.1f32, -2.0];
    assert!(beam_search(&m, &[0], TopkRows::new(&ok_t, &ok_l, 1, 2), &p).is_ok());
    assert!(matches!(beam_search(&m, &[0], TopkRows::new(&ok_t, &ok_l, 2, 2), &p), Err(Error::Shape { .. })));
    assert!(matches!(beam_search(&m, &[0], TopkRows::new(&ok_t, &[-0.1], 1, 2), &p), Err(Error::Shape { .. })));
    assert!(matches!(
        beam_search(&m, &[0], TopkRows::new(&ok_t, &[f32::NAN, 0.0], 1, 2), &p),
        Err(Error::BadLogprob { .. })
    ));
    assert!(matches!(
        beam_search(&m, &[0], TopkRows::new(&ok_t, &[f32::INFINITY, 0.0], 1, 2), &p),
        Err(Error::BadLogprob { .. })
    ));
    assert!(matches!(beam_search(&m, &[], TopkRows::new(&ok_t, &ok_l, 1, 2), &p), Err(Error::EmptyContext)));
    assert!(matches!(beam_search(&m, &[9], TopkRows::new(&ok_t, &ok_l, 1, 2), &p), Err(Error::TokenOutOfVocab { .. })));
    assert!(matches!(
        beam_search(&m, &[0], TopkRows::new(&[1, 4], &ok_l, 1, 2), &p),
        Err(Error::TokenOutOfVocab { .. })
    ));
    assert!(matches!(
        beam_search(&m, &[0], TopkRows::new(&[1, 1], &ok_l, 1, 2), &p),
        Err(Error::DuplicateToken { .. })
    ));
    let zero = SearchParams { max_nodes: 0, ..p.clone() };
    assert!(matches!(beam_search(&m, &[0], TopkRows::new(&ok_t, &ok_l, 1, 2), &zero), Err(Error::ZeroBudget { .. })));
    let w0 = SearchParams { beam_width: 0, ..p.clone() };
    assert!(matches!(beam_search(&m, &[0], TopkRows::new(&ok_t, &ok_l, 1, 2), &w0), Err(Error::Param { .. })));
    let nan = SearchParams { eps: f64::NAN, ..p.clone() };
    assert!(matches!(beam_search(&m, &[0], TopkRows::new(&ok_t, &ok_l, 1, 2), &nan), Err(Error::Param { .. })));
    assert!(matches!(ngram_tree(&m, &[], 3, 2, &p), Err(Error::EmptyContext)));
    // All −inf: nothing is possible, the tree is the root alone.
    let t = beam_search(&m, &[0, 3], TopkRows::new(&ok_t, &[f32::NEG_INFINITY; 2], 1, 2), &p).unwrap();
    assert_eq!(t.tokens, vec![3]);
    // d = 0: root only.
    assert_eq!(beam_search(&m, &[0], TopkRows::new(&[], &[], 0, 2), &p).unwrap().len(), 1);
}

//! `Candidates::All` (Eq. (10) with every expansion of every level a candidate) against a
//! brute force written from the definition: every expansion is scored and kept, the next beam
//! is the best `beam_width` non-EOS expansions of the level, the tree is the best-first
//! selection of θ candidates (score descending, then shallower, then creation order).
mod common;

use common::{check_tree, g_scan, ref_select, token_paths, Model, RefNode};
use dart_tree::{beam_search, beam_search_batch, Candidates, NoNgram, SearchParams, TopkRows};
use proptest::prelude::*;

const V: u32 = 12;

/// Every expansion of every level with its path and score, in creation order (the beam of a
/// level expanded in beam order, each entry by its row in row order).
fn all_expansions(
    seq: &[u32],
    context: &[u32],
    toks: &[u32],
    lps: &[f32],
    d: usize,
    k: usize,
    p: &SearchParams,
) -> Vec<RefNode> {
    let mut nodes: Vec<RefNode> = Vec::new();
    let mut beam: Vec<Option<usize>> = vec![None];
    for l in 0..d {
        let div = ((l + 1) as f64).powf(p.depth_exponent);
        let start = nodes.len();
        for &e in &beam {
            let (path0, s0) = e.map_or((vec![], 0.0), |i| (nodes[i].path.clone(), nodes[i].score));
            for j in 0..k {
                let lp = lps[l * k + j];
                if lp == f32::NEG_INFINITY {
                    continue;
                }
                let v = toks[l * k + j];
                let mut text = context.to_vec();
                text.extend(&path0);
                let mut delta = p.level_decay.powi(l as i32) * ((lp as f64).exp() + p.eps).ln() / div;
                if p.ngram_weight != 0.0 && (l > 0 || p.ngram_first_level) {
                    let g = g_scan(seq, &text[text.len().saturating_sub(2)..], v, p.unigram_backoff);
                    delta += p.ngram_weight / div * (g + p.eps).ln();
                }
                let mut path = path0.clone();
                path.push(v);
                nodes.push(RefNode { path, score: s0 + delta, level: l, parent: e });
            }
        }
        // next beam: the best w non-EOS expansions of this level (score desc, creation order)
        let mut level: Vec<usize> =
            (start..nodes.len()).filter(|&i| !p.eos.contains(nodes[i].path.last().unwrap())).collect();
        level.sort_by(|&a, &b| nodes[b].score.partial_cmp(&nodes[a].score).unwrap().then(a.cmp(&b)));
        level.truncate(p.beam_width);
        beam = level.into_iter().map(Some).collect();
        if beam.is_empty() {
            break;
        }
    }
    nodes
}

fn brute_force(
    seq: &[u32],
    context: &[u32],
    toks: &[u32],
    lps: &[f32],
    d: usize,
    k: usize,
    p: &SearchParams,
) -> Vec<(Vec<u32>, f64)> {
    let nodes = all_expansions(seq, context, toks, lps, d, k, p);
    let mut out: Vec<(Vec<u32>, f64)> =
        ref_select(&nodes, p.max_nodes).into_iter().map(|i| (nodes[i].path.clone(), nodes[i].score)).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn got(t: &dart_tree::Tree) -> Vec<(Vec<u32>, f64)> {
    let mut v: Vec<(Vec<u32>, f64)> = token_paths(t).into_iter().zip(t.scores[1..].iter().copied()).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

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
        2 => Just(0.0f32),              // near-certain: ln(1 + ε) > 0, a child outscores its parent
        1 => Just((0.5f32).ln()),       // exact ties
        1 => Just(f32::NEG_INFINITY),   // impossible
    ]
}

fn case() -> impl Strategy<Value = Case> {
    // k up to 8 with w down to 1: k > w is common; θ up to 60: often more than the candidates
    (1usize..5, 1usize..9).prop_flat_map(|(d, k)| {
        (
            prop::collection::vec(0..V, 0..120),
            prop::collection::vec(0..V, 1..5),
            prop::collection::vec(Just((0..V).collect::<Vec<u32>>()).prop_shuffle(), d),
            prop::collection::vec(logprob(), d * k),
            (1usize..5, 1usize..60, prop_oneof![Just(0.0), Just(0.5), Just(1.0)], any::<bool>(), any::<bool>()),
            prop::collection::vec(0..V, 0..3),
            (prop_oneof![Just(1e-10), Just(0.0)], prop_oneof![Just(0.9), Just(1.0)], prop_oneof![Just(0.7), Just(0.0)]),
        )
            .prop_map(move |(seq, context, perms, lps, (w, theta, nw, first, ub), eos, (eps, decay, expo))| {
                Case {
                    seq,
                    context,
                    toks: perms.iter().flat_map(|p| p[..k].to_vec()).collect(),
                    lps,
                    d,
                    k,
                    params: SearchParams {
                        beam_width: w,
                        max_nodes: theta,
                        ngram_weight: nw,
                        ngram_first_level: first,
                        unigram_backoff: ub,
                        eos,
                        eps,
                        level_decay: decay,
                        depth_exponent: expo,
                        candidates: Candidates::All,
                    },
                }
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn all_candidates_equal_brute_force(c in case()) {
        let model = Model::new(c.seq.clone(), V);
        let tree = beam_search(&model, &c.context, TopkRows::new(&c.toks, &c.lps, c.d, c.k), &c.params).unwrap();
        check_tree(&tree, c.params.max_nodes);
        let (g, want) = (got(&tree), brute_force(&c.seq, &c.context, &c.toks, &c.lps, c.d, c.k, &c.params));
        prop_assert_eq!(g.len(), want.len());
        for ((gp, gs), (wp, ws)) in g.iter().zip(&want) {
            prop_assert_eq!(gp, wp);
            prop_assert!(gs == ws || (gs - ws).abs() <= 1e-9 * ws.abs().max(1.0), "{} vs {}", gs, ws);
        }
        // EOS nodes are leaves
        for i in 1..tree.len() {
            if c.params.eos.contains(&tree.tokens[i]) {
                prop_assert!(!tree.parents.contains(&(i as i32)));
            }
        }
    }

    #[test]
    fn all_candidates_batch_equals_single_calls(cs in prop::collection::vec(case(), 1..4)) {
        let (d, k, params) = (cs[0].d, cs[0].k, cs[0].params.clone());
        let model = Model::new(cs[0].seq.clone(), V);
        let cases: Vec<&Case> = cs.iter().filter(|c| c.d == d && c.k == k).collect();
        let contexts: Vec<&[u32]> = cases.iter().map(|c| c.context.as_slice()).collect();
        let toks: Vec<u32> = cases.iter().flat_map(|c| c.toks.clone()).collect();
        let lps: Vec<f32> = cases.iter().flat_map(|c| c.lps.clone()).collect();
        let trees = beam_search_batch(&model, &contexts, TopkRows::new(&toks, &lps, d, k), &params).unwrap();
        for (t, c) in trees.iter().zip(&cases) {
            prop_assert_eq!(t, &beam_search(&model, &c.context, TopkRows::new(&c.toks, &c.lps, d, k), &params).unwrap());
        }
    }
}

/// k > w at level 0: the (w+1)-th drafter token is a candidate of the paper's set (and is in
/// the tree when it beats the deeper nodes), never of the beam set.
#[test]
fn k_above_w_puts_the_next_drafter_token_in_the_tree() {
    let lp = |p: f32| p.ln();
    // level 0: tokens 1, 2, 3 with p 0.5, 0.3, 0.2; level 1: token 9 with p 0.01 (and 8 ~ 0)
    let toks = [1, 2, 3, 9, 8, 7];
    let lps = [lp(0.5), lp(0.3), lp(0.2), lp(0.01), f32::NEG_INFINITY, f32::NEG_INFINITY];
    let base = SearchParams {
        beam_width: 2,
        max_nodes: 3,
        ngram_weight: 0.0,
        candidates: Candidates::Beam,
        ..SearchParams::default()
    };
    let beam = beam_search(&NoNgram, &[0], TopkRows::new(&toks, &lps, 2, 3), &base).unwrap();
    let all = beam_search(
        &NoNgram,
        &[0],
        TopkRows::new(&toks, &lps, 2, 3),
        &SearchParams { candidates: Candidates::All, ..base.clone() },
    )
    .unwrap();
    let (pb, pa) = (token_paths(&beam), token_paths(&all));
    assert!(!pb.contains(&vec![3]) && pb.contains(&vec![1, 9]), "{pb:?}");
    assert_eq!(pa, vec![vec![1], vec![2], vec![3]]);
}

/// EOS-ended expansions are candidates but never in the beam: with w = 1 and the best token
/// EOS, the beam continues from the best non-EOS token, and EOS stays a leaf of the tree.
#[test]
fn eos_is_a_candidate_but_not_expanded() {
    let toks = [5, 1, 2, 6, 7, 8];
    let lps = [(0.6f32).ln(), (0.4f32).ln(), f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, f32::NEG_INFINITY];
    let p = SearchParams {
        beam_width: 1,
        max_nodes: 10,
        ngram_weight: 0.0,
        eos: vec![5],
        candidates: Candidates::All,
        ..SearchParams::default()
    };
    let t = beam_search(&NoNgram, &[0], TopkRows::new(&toks, &lps, 2, 3), &p).unwrap();
    assert_eq!(token_paths(&t), vec![vec![5], vec![1], vec![1, 6]]);
}

/// Probability-1 chains (ln(1 + ε) > 0 at every level) with θ below the depth: the first θ
/// levels, ancestor-closed, whatever the candidate set.
#[test]
fn near_certain_chain_stays_ancestor_closed() {
    let d = 6;
    let toks: Vec<u32> = (0..d as u32).flat_map(|l| [10 + l, 30 + l]).collect();
    let lps: Vec<f32> = (0..d).flat_map(|_| [0.0, f32::NEG_INFINITY]).collect();
    for theta in 1..=d {
        let p = SearchParams {
            beam_width: 3,
            max_nodes: theta,
            ngram_weight: 0.0,
            candidates: Candidates::All,
            ..SearchParams::default()
        };
        let t = beam_search(&NoNgram, &[0], TopkRows::new(&toks, &lps, d, 2), &p).unwrap();
        check_tree(&t, theta);
        assert_eq!(t.len(), theta + 1);
        assert_eq!(t.depths.iter().copied().max().unwrap() as usize, theta);
    }
}

//! The search's pruning (against the level's best w, the per-context n-gram bounds, and the
//! tree's θ-th best path minimum) changes no tree: `beam_search` equals
//! `beam_search_unpruned`, which scores every expansion of every beam entry, bit for bit,
//! for both candidate sets, on random inputs with ties, near-certain tokens (ln(1 + ε) > 0),
//! EOS, k > w and θ above the number of candidates.
mod common;

use common::{check_tree, Model};
use dart_tree::{beam_search, beam_search_unpruned, Candidates, NoNgram, SearchParams, TopkRows};
use proptest::prelude::*;

const V: u32 = 40;

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
        2 => Just(0.0f32),            // near-certain: a child can outscore its parent
        2 => Just((0.5f32).ln()),     // exact ties
        1 => Just((0.25f32).ln()),
        1 => Just(f32::NEG_INFINITY), // impossible
    ]
}

fn case() -> impl Strategy<Value = Case> {
    // up to 8 levels and k = 12 with w down to 1 (k > w is common), θ from 1 to 80 (often
    // more than the candidates)
    (1usize..9, 1usize..13).prop_flat_map(|(d, k)| {
        (
            prop::collection::vec(0..V, 0..300),
            prop::collection::vec(0..V, 1..5),
            prop::collection::vec(Just((0..V).collect::<Vec<u32>>()).prop_shuffle(), d),
            prop::collection::vec(logprob(), d * k),
            (
                1usize..6,
                1usize..80,
                prop_oneof![Just(0.0), Just(0.5), Just(1.0), Just(-0.5)],
                any::<bool>(),
                any::<bool>(),
            ),
            prop::collection::vec(0..V, 0..4),
            (
                prop_oneof![4 => Just(1e-10), 1 => Just(0.0), 1 => Just(0.3)],
                prop_oneof![Just(0.9), Just(1.0)],
                prop_oneof![Just(0.7), Just(0.0)],
            ),
            any::<bool>(),
        )
            .prop_map(
                move |(seq, context, perms, lps, (w, theta, nw, first, ub), eos, (eps, decay, expo), all)| Case {
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
                        candidates: if all { Candidates::All } else { Candidates::Beam },
                    },
                },
            )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn pruning_changes_no_tree(c in case()) {
        let model = Model::new(c.seq.clone(), V);
        let pruned = beam_search(&model, &c.context, TopkRows::new(&c.toks, &c.lps, c.d, c.k), &c.params).unwrap();
        let full = beam_search_unpruned(&model, &c.context, TopkRows::new(&c.toks, &c.lps, c.d, c.k), &c.params).unwrap();
        check_tree(&pruned, c.params.max_nodes);
        prop_assert_eq!(&pruned, &full);
        let scores = |t: &dart_tree::Tree| t.scores.iter().map(|x| x.to_bits()).collect::<Vec<u64>>();
        prop_assert_eq!(scores(&pruned), scores(&full));
    }
}

/// Deep rows of equal log-probabilities (every level a wall of ties) and θ reached after a
/// few levels: the pruning against the tree drops whole levels, the tree stays the same.
#[test]
fn pruning_with_ties_at_every_level() {
    for (d, k, w, theta) in [(8, 6, 3, 10), (8, 12, 5, 59), (6, 4, 4, 7), (8, 3, 1, 5)] {
        let toks: Vec<u32> = (0..d).flat_map(|l| (0..k as u32).map(move |j| (j * 7 + l as u32) % 40)).collect();
        let lps: Vec<f32> = (0..d * k).map(|i| [(0.5f32).ln(), (0.25f32).ln(), 0.0][i % 3]).collect();
        for candidates in [Candidates::Beam, Candidates::All] {
            let p = SearchParams {
                beam_width: w,
                max_nodes: theta,
                ngram_weight: 0.0,
                eos: vec![3],
                candidates,
                ..SearchParams::default()
            };
            let a = beam_search(&NoNgram, &[0], TopkRows::new(&toks, &lps, d, k), &p).unwrap();
            let b = beam_search_unpruned(&NoNgram, &[0], TopkRows::new(&toks, &lps, d, k), &p).unwrap();
            assert_eq!(a, b, "d {d} k {k} w {w} theta {theta} {candidates:?}");
            check_tree(&a, theta);
        }
    }
}

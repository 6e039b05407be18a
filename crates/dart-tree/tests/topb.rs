//! Deferred top-B, DDTree best-first and the tree encoding against plain references.
mod common;

use common::{check_tree, token_paths};
use dart_tree::{ancestor_bits, best_first, top_b, Error, Tree};
use proptest::prelude::*;

/// A random supertree built depth by depth: parents, scores = parent + ln q + β·1.
fn supertree(max_n: usize, beta: impl Strategy<Value = f64>) -> impl Strategy<Value = (Vec<i64>, Vec<f64>)> {
    (
        prop::collection::vec(
            (any::<prop::sample::Index>(), prop_oneof![Just(1.0f64), Just(0.5), Just(0.25), 0.01f64..1.0]),
            1..max_n,
        ),
        beta,
    )
        .prop_map(|(nodes, beta)| {
            let mut parents = Vec::new();
            let mut scores: Vec<f64> = Vec::new();
            for (i, (pick, q)) in nodes.into_iter().enumerate() {
                // Parent: −1 or one of the earlier nodes.
                let choice = pick.index(i + 1);
                let p = choice as i64 - 1;
                let base = if p < 0 { 0.0 } else { scores[p as usize] };
                parents.push(p);
                scores.push(base + q.ln() + beta);
            }
            (parents, scores)
        })
}

/// Best-first heap order by linear scans: the best node whose parent is already taken
/// (score desc, shallower, lower index).
fn heap_order(parents: &[i64], scores: &[f64], b: usize) -> Vec<usize> {
    let n = parents.len();
    let depth: Vec<usize> = {
        let mut d = vec![0; n];
        for i in 0..n {
            d[i] = if parents[i] < 0 { 1 } else { d[parents[i] as usize] + 1 };
        }
        d
    };
    let mut taken = vec![false; n];
    let mut out = Vec::new();
    while out.len() < b {
        let mut best: Option<usize> = None;
        for i in 0..n {
            if taken[i] || (parents[i] >= 0 && !taken[parents[i] as usize]) {
                continue;
            }
            if best.is_none_or(|j| scores[i] > scores[j] || (scores[i] == scores[j] && depth[i] < depth[j])) {
                best = Some(i);
            }
        }
        let Some(j) = best else { break };
        taken[j] = true;
        out.push(j);
    }
    out
}

fn closed(parents: &[i64], sel: &[usize]) -> bool {
    sel.iter().all(|&i| parents[i] < 0 || sel.contains(&(parents[i] as usize)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn top_b_equals_heap_when_beta_nonpositive(
        (parents, scores) in supertree(60, prop_oneof![Just(0.0), Just(-0.2), -1.0f64..0.0]),
        b in 1usize..70,
    ) {
        let got = top_b(&parents, &scores, b).unwrap();
        prop_assert_eq!(&got, &heap_order(&parents, &scores, b));
        prop_assert!(closed(&parents, &got));
    }

    #[test]
    fn top_b_is_ancestor_closed_for_any_beta(
        (parents, scores) in supertree(60, -1.0f64..1.0),
        b in 1usize..70,
    ) {
        let got = top_b(&parents, &scores, b).unwrap();
        prop_assert_eq!(got.len(), b.min(parents.len()));
        prop_assert!(closed(&parents, &got));
        let mut s = got.clone();
        s.sort();
        s.dedup();
        prop_assert_eq!(s.len(), got.len());
    }

    #[test]
    fn best_first_equals_exhaustive_reference(
        d in 1usize..4, k in 1usize..4, b in 1usize..30,
        lps in prop::collection::vec(prop_oneof![Just(0.0f32), Just((0.5f32).ln()), Just(f32::NEG_INFINITY), -3.0f32..0.0], 9),
    ) {
        let lps = &lps[..d * k];
        let toks: Vec<u32> = (0..(d * k) as u32).map(|t| t + 100).collect();
        let tree = best_first(&toks, lps, d, k, 5, b).unwrap();
        check_tree(&tree, b);
        // Exhaustive: every path of the full K-ary tree of depth d with its score, selected
        // by repeated scans with full (not lazy) child pushes. Creation order = (pop order of
        // the parent, column rank by log-prob desc then column).
        #[derive(Clone)]
        struct N { path: Vec<u32>, score: f64, level: usize, parent_pop: i64, rank: usize }
        let ranked: Vec<Vec<usize>> = (0..d).map(|l| {
            let mut c: Vec<usize> = (0..k).filter(|&j| lps[l * k + j] != f32::NEG_INFINITY).collect();
            c.sort_by(|&a, &bb| lps[l * k + bb].partial_cmp(&lps[l * k + a]).unwrap().then(a.cmp(&bb)));
            c
        }).collect();
        let mut avail: Vec<N> = ranked[0].iter().enumerate().map(|(r, &j)| N { path: vec![toks[j]], score: lps[j] as f64, level: 0, parent_pop: -1, rank: r }).collect();
        let mut chosen: Vec<N> = Vec::new();
        while chosen.len() < b && !avail.is_empty() {
            let mut bi = 0;
            for i in 1..avail.len() {
                let (x, y) = (&avail[i], &avail[bi]);
                let better = x.score > y.score || (x.score == y.score && (x.level, x.parent_pop, x.rank) < (y.level, y.parent_pop, y.rank));
                if better { bi = i; }
            }
            let n = avail.remove(bi);
            let me = chosen.len() as i64;
            if n.level + 1 < d {
                for (r, &j) in ranked[n.level + 1].iter().enumerate() {
                    let mut path = n.path.clone();
                    path.push(toks[(n.level + 1) * k + j]);
                    avail.push(N { path, score: n.score + lps[(n.level + 1) * k + j] as f64, level: n.level + 1, parent_pop: me, rank: r });
                }
            }
            chosen.push(n);
        }
        let mut want: Vec<(Vec<u32>, f64)> = chosen.into_iter().map(|n| (n.path, n.score)).collect();
        let mut got: Vec<(Vec<u32>, f64)> = token_paths(&tree).into_iter().zip(tree.scores[1..].iter().copied()).collect();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        got.sort_by(|a, b| a.0.cmp(&b.0));
        prop_assert_eq!(got, want);
    }

    #[test]
    fn ancestor_bits_match_naive(nodes in prop::collection::vec(any::<prop::sample::Index>(), 0..150)) {
        let mut parents = vec![-1i32];
        for (i, pick) in nodes.iter().enumerate() {
            parents.push(pick.index(i + 1) as i32);
        }
        let n = parents.len();
        let w = n.div_ceil(64);
        let bits = ancestor_bits(&parents);
        prop_assert_eq!(bits.len(), n * w);
        for i in 0..n {
            let mut anc = vec![false; n];
            let mut c = i as i32;
            while c >= 0 { anc[c as usize] = true; c = parents[c as usize]; }
            for j in 0..n {
                prop_assert_eq!((bits[i * w + j / 64] >> (j % 64)) & 1 == 1, anc[j], "row {} col {}", i, j);
            }
        }
    }
}

#[test]
fn tree_paths_and_children() {
    let t = Tree {
        tokens: vec![9, 1, 2, 3, 4],
        parents: vec![-1, 0, 0, 1, 1],
        depths: vec![0, 1, 1, 2, 2],
        scores: vec![0.0, -1.0, -2.0, -1.5, -1.7],
    };
    assert_eq!(t.paths(), vec![vec![0, 2], vec![0, 1, 3], vec![0, 1, 4]]);
    assert_eq!(t.children(), vec![vec![1, 2], vec![3, 4], vec![], vec![], vec![]]);
    assert_eq!(t.path(4), vec![0, 1, 4]);
}

#[test]
fn bad_input_is_an_error() {
    assert!(matches!(top_b(&[-1, 0], &[0.0], 1), Err(Error::Shape { .. })));
    assert!(matches!(top_b(&[-1, 0], &[0.0, -1.0], 0), Err(Error::ZeroBudget { .. })));
    assert!(matches!(top_b(&[-1, 1], &[0.0, -1.0], 1), Err(Error::BadParent { .. })));
    assert!(matches!(top_b(&[-1, -2], &[0.0, -1.0], 1), Err(Error::BadParent { .. })));
    assert!(matches!(top_b(&[-1, 0], &[0.0, f64::NAN], 1), Err(Error::NanScore { .. })));
    assert_eq!(top_b(&[], &[], 3).unwrap(), Vec::<usize>::new());
    assert!(matches!(best_first(&[1, 2], &[0.0, -1.0], 1, 2, 0, 0), Err(Error::ZeroBudget { .. })));
    assert!(matches!(best_first(&[1, 2], &[f32::NAN, -1.0], 1, 2, 0, 3), Err(Error::BadLogprob { .. })));
    assert!(matches!(best_first(&[1, 1], &[0.0, -1.0], 1, 2, 0, 3), Err(Error::DuplicateToken { .. })));
    assert!(matches!(best_first(&[1, 2, 3], &[0.0, -1.0], 1, 2, 0, 3), Err(Error::Shape { .. })));
}

//! Brute-force trigram model and plain-loop references shared by the integration tests.
#![allow(dead_code)]
use std::collections::HashMap;

use dart_tree::{NgramScorer, Result, SearchParams, Tree};

/// Counts of every (a,b,c), (b,c) and (c) in one token sequence, in hash maps.
pub struct Model {
    pub seq: Vec<u32>,
    pub vocab: u32,
    tri: HashMap<(u32, u32), HashMap<u32, u64>>,
    bi: HashMap<u32, HashMap<u32, u64>>,
    uni: HashMap<u32, u64>,
}

impl Model {
    pub fn new(seq: Vec<u32>, vocab: u32) -> Self {
        let mut tri: HashMap<(u32, u32), HashMap<u32, u64>> = HashMap::new();
        let mut bi: HashMap<u32, HashMap<u32, u64>> = HashMap::new();
        let mut uni: HashMap<u32, u64> = HashMap::new();
        for i in 0..seq.len() {
            *uni.entry(seq[i]).or_default() += 1;
            if i >= 1 {
                *bi.entry(seq[i - 1]).or_default().entry(seq[i]).or_default() += 1;
            }
            if i >= 2 {
                *tri.entry((seq[i - 2], seq[i - 1])).or_default().entry(seq[i]).or_default() += 1;
            }
        }
        Model { seq, vocab, tri, bi, uni }
    }

    fn dist(&self, ctx: &[u32]) -> Option<&HashMap<u32, u64>> {
        match ctx.len() {
            2 => self.tri.get(&(ctx[0], ctx[1])),
            1 => self.bi.get(&ctx[0]),
            _ => Some(&self.uni),
        }
    }
}

impl NgramScorer for Model {
    fn vocab_size(&self) -> u32 {
        self.vocab
    }
    fn cond_probs(&self, context: &[u32], cands: &[u32], ub: bool, out: &mut [f64]) {
        assert!(cands.windows(2).all(|w| w[0] < w[1]), "candidates must be sorted");
        assert!(context.len() <= 2);
        for (o, &v) in out.iter_mut().zip(cands) {
            *o = 0.0;
            let lo = if ub { 0 } else { 1 };
            for len in (lo..=context.len()).rev() {
                let ctx = &context[context.len() - len..];
                if let Some(d) = self.dist(ctx) {
                    if let Some(&c) = d.get(&v) {
                        *o = c as f64 / d.values().sum::<u64>() as f64;
                        break;
                    }
                }
            }
        }
    }
    fn trigram_probs(&self, context: [u32; 2], cands: &[u32], out: &mut [f64]) {
        assert!(cands.windows(2).all(|w| w[0] < w[1]), "candidates must be sorted");
        for (o, &v) in out.iter_mut().zip(cands) {
            *o = f64::NAN;
            if let Some(d) = self.dist(&context) {
                if let Some(&c) = d.get(&v) {
                    *o = c as f64 / d.values().sum::<u64>() as f64;
                }
            }
        }
    }
    fn top_children(&self, context: &[u32], k: usize, ub: bool, t: &mut Vec<u32>, p: &mut Vec<f64>) -> Result<()> {
        t.clear();
        p.clear();
        let lo = if ub { 0 } else { 1 };
        for len in (lo..=context.len()).rev() {
            if let Some(d) = self.dist(&context[context.len() - len..]) {
                if d.is_empty() {
                    continue;
                }
                let total: u64 = d.values().sum();
                let mut kids: Vec<(u32, u64)> = d.iter().map(|(&a, &b)| (a, b)).collect();
                kids.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
                for (tok, c) in kids.into_iter().take(k) {
                    t.push(tok);
                    p.push(c as f64 / total as f64);
                }
                return Ok(());
            }
        }
        Ok(())
    }
}

/// g(v|ctx) by scanning the raw sequence (independent of the hash maps).
pub fn g_scan(seq: &[u32], ctx: &[u32], v: u32, ub: bool) -> f64 {
    let lo = if ub { 0 } else { 1 };
    for len in (lo..=ctx.len().min(2)).rev() {
        let c = &ctx[ctx.len() - len..];
        let (mut hit, mut total) = (0u64, 0u64);
        for i in len..seq.len() {
            if &seq[i - len..i] == c {
                total += 1;
                if seq[i] == v {
                    hit += 1;
                }
            }
        }
        if hit > 0 {
            return hit as f64 / total as f64;
        }
    }
    0.0
}

/// A candidate of the reference search.
#[derive(Clone, Debug)]
pub struct RefNode {
    pub path: Vec<u32>,
    pub score: f64,
    pub level: usize,
    pub parent: Option<usize>,
}

/// Select the final tree from a candidate list by repeated linear scans: the best node whose
/// parent is already chosen (score desc, then shallower, then lower creation index).
pub fn ref_select(cands: &[RefNode], theta: usize) -> Vec<usize> {
    let mut chosen: Vec<usize> = Vec::new();
    let mut is_chosen = vec![false; cands.len()];
    while chosen.len() < theta {
        let mut best: Option<usize> = None;
        for (i, c) in cands.iter().enumerate() {
            if is_chosen[i] || !c.parent.is_none_or(|p| is_chosen[p]) {
                continue;
            }
            let better = match best {
                None => true,
                Some(b) => {
                    let cb = &cands[b];
                    c.score > cb.score || (c.score == cb.score && c.level < cb.level)
                }
            };
            if better {
                best = Some(i);
            }
        }
        let Some(b) = best else { break };
        is_chosen[b] = true;
        chosen.push(b);
    }
    chosen
}

/// Keep the best `w` of a level's new nodes (score desc, then creation order) as candidates
/// (appended to `cands`); returns the indices in `cands` of the kept non-EOS ones (next beam).
pub fn ref_keep(cands: &mut Vec<RefNode>, level_nodes: Vec<RefNode>, w: usize, eos: &[u32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..level_nodes.len()).collect();
    order.sort_by(|&a, &b| level_nodes[b].score.partial_cmp(&level_nodes[a].score).unwrap().then(a.cmp(&b)));
    order.truncate(w);
    let mut beam = Vec::new();
    for i in order {
        let n = level_nodes[i].clone();
        let is_eos = eos.contains(n.path.last().unwrap());
        cands.push(n);
        if !is_eos {
            beam.push(cands.len() - 1);
        }
    }
    beam
}

/// Eq. (10) with plain loops: every expansion with its full path, g by scanning the corpus,
/// the kept nodes by full sorts, the tree by [`ref_select`]. Returns (path, score) of every
/// tree node except the root, in selection order.
pub fn ref_beam_search(
    seq: &[u32],
    context: &[u32],
    toks: &[u32],
    lps: &[f32],
    d: usize,
    k: usize,
    p: &SearchParams,
) -> Vec<(Vec<u32>, f64)> {
    let mut cands: Vec<RefNode> = Vec::new();
    let mut beam: Vec<Option<usize>> = vec![None];
    for l in 0..d {
        let div = ((l + 1) as f64).powf(p.depth_exponent);
        let decay = p.level_decay.powi(l as i32);
        let mut level_nodes = Vec::new();
        for &e in &beam {
            let (ppath, pscore) = match e {
                None => (Vec::new(), 0.0),
                Some(i) => (cands[i].path.clone(), cands[i].score),
            };
            for j in 0..k {
                let lp = lps[l * k + j];
                if lp == f32::NEG_INFINITY {
                    continue;
                }
                let v = toks[l * k + j];
                let mut full: Vec<u32> = context.to_vec();
                full.extend(&ppath);
                let ctx = &full[full.len().saturating_sub(2)..];
                let a = decay * ((lp as f64).exp() + p.eps).ln() / div;
                let mut delta = a;
                if p.ngram_weight != 0.0 && (l > 0 || p.ngram_first_level) {
                    let g = g_scan(seq, ctx, v, p.unigram_backoff);
                    delta += p.ngram_weight / div * (g + p.eps).ln();
                }
                let mut path = ppath.clone();
                path.push(v);
                level_nodes.push(RefNode { path, score: pscore + delta, level: l, parent: e });
            }
        }
        beam = ref_keep(&mut cands, level_nodes, p.beam_width, &p.eos).into_iter().map(Some).collect();
    }
    ref_select(&cands, p.max_nodes).into_iter().map(|i| (cands[i].path.clone(), cands[i].score)).collect()
}

/// Token path (root excluded) of every non-root node of a tree.
pub fn token_paths(t: &Tree) -> Vec<Vec<u32>> {
    (1..t.len()).map(|i| t.path(i)[1..].iter().map(|&n| t.tokens[n]).collect()).collect()
}

/// The structural guarantees every builder output must satisfy.
pub fn check_tree(t: &Tree, max_nodes: usize) {
    let n = t.len();
    assert!(n >= 1 && n <= max_nodes + 1, "size {n} > 1 + {max_nodes}");
    assert_eq!(t.parents.len(), n);
    assert_eq!(t.depths.len(), n);
    assert_eq!(t.scores.len(), n);
    assert_eq!((t.parents[0], t.depths[0]), (-1, 0));
    for i in 1..n {
        let p = t.parents[i];
        assert!(p >= 0 && (p as usize) < i, "parent {p} of node {i} is not an earlier node");
        assert_eq!(t.depths[i], t.depths[p as usize] + 1);
        assert!(t.depths[i] >= t.depths[i - 1], "not depth-sorted at {i}");
    }
    let mut paths = token_paths(t);
    paths.sort();
    let before = paths.len();
    paths.dedup();
    assert_eq!(paths.len(), before, "duplicate paths");
}

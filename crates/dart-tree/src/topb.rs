//! DARTree's deferred global top-B and DDTree's best-first heap over factorised marginals.
use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::{Error, Result, TopkRows, Tree};

/// DARTree's deferred pruning: the global top-`b` nodes of a supertree, best first.
///
/// `parents[i]` is −1 for a node hanging off the (implicit) root, else the index of an earlier
/// node (`parents[i] < i`: supertrees are built depth by depth). Nodes are ranked by score
/// descending, ties ancestor-first: shallower first, then lower index (Lemma 1 of DARTree:
/// when scores never increase along a path — β ≤ 0 — this order is exactly the pop order of
/// a best-first heap, and every prefix of it is ancestor-closed).
///
/// Where a child outscores its parent (β > 0, or ln(1 + ε) > 0) a plain global top-B could
/// keep the child without the parent. We rank by the path minimum of the scores instead
/// (`key(i) = min(score(i), key(parent(i)))`), which equals the score whenever scores are
/// non-increasing along paths, and keeps the result ancestor-closed in every case.
///
/// Returns at most `b` node indices in rank order (`np.sort` them for topological order).
pub fn top_b(parents: &[i64], scores: &[f64], b: usize) -> Result<Vec<usize>> {
    if parents.len() != scores.len() {
        return Err(Error::shape(format!("parents has {} entries, scores {}", parents.len(), scores.len())));
    }
    if b == 0 {
        return Err(Error::ZeroBudget { name: "b" });
    }
    let n = parents.len();
    let mut key = Vec::with_capacity(n);
    let mut depth: Vec<u32> = Vec::with_capacity(n);
    for i in 0..n {
        let (p, s) = (parents[i], scores[i]);
        if s.is_nan() {
            return Err(Error::NanScore { node: i });
        }
        if p == -1 {
            key.push(s);
            depth.push(1);
        } else if p >= 0 && (p as usize) < i {
            key.push(s.min(key[p as usize]));
            depth.push(depth[p as usize] + 1);
        } else {
            return Err(Error::BadParent { node: i, parent: p });
        }
    }
    let rank = |a: &usize, c: &usize| -> Ordering {
        key[*c].total_cmp(&key[*a]).then(depth[*a].cmp(&depth[*c])).then(a.cmp(c))
    };
    let mut order: Vec<usize> = (0..n).collect();
    if n > b {
        order.select_nth_unstable_by(b - 1, rank);
        order.truncate(b);
    }
    order.sort_unstable_by(rank);
    Ok(order)
}

/// Heap entry of [`best_first`]: node `rank` of row `level` (columns sorted by log-prob)
/// under the node popped `parent_pop`-th (−1 = root).
#[derive(Clone, Copy)]
struct Entry {
    score: f64,
    /// Score of the parent (adding, not subtracting, keeps sibling scores exact).
    base: f64,
    level: u16,
    parent_pop: i32,
    rank: u32,
}

impl Ord for Entry {
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.level.cmp(&self.level))
            .then_with(|| o.parent_pop.cmp(&self.parent_pop))
            .then_with(|| o.rank.cmp(&self.rank))
    }
}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Entry {}

/// DDTree's tree: best-first search over factorised marginals. A node at depth l + 1 takes
/// token `tokens[l, j]` and scores `score(parent) + logprobs[l, j]` (f64 sums of the given
/// log-probabilities, no ε); the `b` best nodes are popped from a heap that starts with the
/// root's children and pushes a popped node's children (ties: shallower first, then the
/// parent popped earlier, then the higher log-prob / lower column). −inf marks an impossible
/// token. Children are pushed lazily (next sibling + first child) since rows are visited in
/// sorted order, so the heap holds O(b) entries instead of O(b·K).
pub fn best_first(tokens: &[u32], logprobs: &[f32], d: usize, k: usize, root: u32, b: usize) -> Result<Tree> {
    TopkRows::new(tokens, logprobs, d, k).check(u32::MAX)?;
    if b == 0 {
        return Err(Error::ZeroBudget { name: "b" });
    }
    if b > i32::MAX as usize - 1 {
        return Err(Error::TooLarge { what: format!("b = {b}") });
    }
    // Per row: valid columns sorted by log-prob descending (stable: lower column first).
    let mut order: Vec<Vec<u32>> = Vec::with_capacity(d);
    for l in 0..d {
        let row = &logprobs[l * k..(l + 1) * k];
        let mut cols: Vec<u32> = (0..k as u32).filter(|&j| row[j as usize] != f32::NEG_INFINITY).collect();
        cols.sort_by(|&a, &c| row[c as usize].total_cmp(&row[a as usize]));
        let mut seen: Vec<u32> = tokens[l * k..(l + 1) * k].to_vec();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::DuplicateToken { row: l, token: w[0] });
        }
        order.push(cols);
    }
    let col = |level: u16, rank: u32| order[level as usize][rank as usize] as usize;
    // popped[t] = (level, parent_pop, column, score)
    let mut popped: Vec<(u16, i32, usize, f64)> = Vec::with_capacity(b);
    let mut heap = BinaryHeap::new();
    if d > 0 && !order[0].is_empty() {
        heap.push(Entry { score: logprobs[col(0, 0)] as f64, base: 0.0, level: 0, parent_pop: -1, rank: 0 });
    }
    while popped.len() < b {
        let Some(e) = heap.pop() else { break };
        let c = col(e.level, e.rank);
        let me = popped.len() as i32;
        popped.push((e.level, e.parent_pop, c, e.score));
        let lvl = e.level as usize;
        if (e.rank as usize) + 1 < order[lvl].len() {
            let sc = col(e.level, e.rank + 1);
            heap.push(Entry {
                score: e.base + logprobs[lvl * k + sc] as f64,
                base: e.base,
                level: e.level,
                parent_pop: e.parent_pop,
                rank: e.rank + 1,
            });
        }
        if lvl + 1 < d && !order[lvl + 1].is_empty() {
            let fc = col(e.level + 1, 0);
            heap.push(Entry {
                score: e.score + logprobs[(lvl + 1) * k + fc] as f64,
                base: e.score,
                level: e.level + 1,
                parent_pop: me,
                rank: 0,
            });
        }
    }
    // Depth order, pop order within a depth.
    let mut idx: Vec<usize> = (0..popped.len()).collect();
    idx.sort_by_key(|&t| popped[t].0);
    let mut tree_idx = vec![0i32; popped.len()];
    let mut tree = Tree::root_only(root);
    for (pos, &t) in idx.iter().enumerate() {
        let (level, parent_pop, c, score) = popped[t];
        tree_idx[t] = pos as i32 + 1;
        tree.tokens.push(tokens[level as usize * k + c]);
        tree.parents.push(if parent_pop < 0 { 0 } else { tree_idx[parent_pop as usize] });
        tree.depths.push(level + 1);
        tree.scores.push(score);
    }
    Ok(tree)
}

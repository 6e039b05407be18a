//! The draft tree handed to verification: flat arrays in depth order.

/// A draft tree. Node 0 is the root (the bonus token, parent −1, depth 0, score 0); the other
/// nodes follow sorted by depth, so every ancestor comes before its descendants and
/// `parents[i] < i` for every `i > 0`. Within one depth nodes are in the order the builder
/// selected them (best score first).
#[derive(Debug, Clone, PartialEq)]
pub struct Tree {
    /// Token id of every node.
    pub tokens: Vec<u32>,
    /// Parent index of every node, −1 for the root.
    pub parents: Vec<i32>,
    /// Depth of every node: 0 for the root, l + 1 for a node drafted from row l.
    pub depths: Vec<u16>,
    /// Cumulative path score of every node (0 for the root); what the builder ranked by.
    pub scores: Vec<f64>,
}

impl Tree {
    /// A tree holding only the root.
    pub fn root_only(token: u32) -> Self {
        Tree { tokens: vec![token], parents: vec![-1], depths: vec![0], scores: vec![0.0] }
    }

    /// Number of nodes, root included.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Always false: a tree has at least its root.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Number of u64 words per row of [`Tree::ancestor_bits`]: ceil(n / 64).
    pub fn words_per_row(&self) -> usize {
        self.len().div_ceil(64)
    }

    /// Row-major `n × ceil(n/64)` bit matrix: bit `j` of row `i` (word `j / 64`, bit `j % 64`)
    /// is set iff node `j` is an ancestor of node `i` or `i` itself. One pass: a row is its
    /// parent's row plus its own bit, which needs `parents[i] < i`.
    pub fn ancestor_bits(&self) -> Vec<u64> {
        ancestor_bits(&self.parents)
    }

    /// Node indices on the path from the root (inclusive) to `node` (inclusive).
    pub fn path(&self, node: usize) -> Vec<usize> {
        let mut path = vec![node];
        let mut cur = node;
        while self.parents[cur] >= 0 {
            cur = self.parents[cur] as usize;
            path.push(cur);
        }
        path.reverse();
        path
    }

    /// Root-to-leaf paths (node indices, root first), one per leaf, in leaf order.
    pub fn paths(&self) -> Vec<Vec<usize>> {
        let mut has_child = vec![false; self.len()];
        for &p in &self.parents[1..] {
            has_child[p as usize] = true;
        }
        (0..self.len()).filter(|&i| !has_child[i]).map(|i| self.path(i)).collect()
    }

    /// Children of every node, in node order.
    pub fn children(&self) -> Vec<Vec<usize>> {
        let mut out = vec![Vec::new(); self.len()];
        for (i, &p) in self.parents.iter().enumerate().skip(1) {
            out[p as usize].push(i);
        }
        out
    }
}

/// [`Tree::ancestor_bits`] for a bare parent array in topological order (`parents[i] < i`,
/// −1 for a root). Parents that break that order are treated as roots rather than read out
/// of bounds; callers validate first.
pub fn ancestor_bits(parents: &[i32]) -> Vec<u64> {
    let n = parents.len();
    let w = n.div_ceil(64);
    let mut bits = vec![0u64; n * w];
    for i in 0..n {
        let p = parents[i];
        if p >= 0 && (p as usize) < i {
            let (src, dst) = bits.split_at_mut(i * w);
            dst[..w].copy_from_slice(&src[p as usize * w..p as usize * w + w]);
        }
        bits[i * w + i / 64] |= 1u64 << (i % 64);
    }
    bits
}

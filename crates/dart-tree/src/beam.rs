//! Eq. (10): the n-gram–guided beam search of DART, and the n-gram-only tree.
//!
//! Both searches run a beam search level by level: every beam entry is expanded by the
//! level's tokens, the best `beam_width` expansions of the level are kept, and the kept ones
//! that do not end in EOS are the next beam. The kept nodes of all levels are the
//! *candidates* (so `beam_width = 1` yields one chain). [`Candidates::All`] is the paper's
//! set instead (the official searcher records every expansion in `all`): every expansion of
//! every level is a candidate, and the best `beam_width` non-EOS expansions of a level are the
//! next beam; from the same inputs it can pick nodes the beam set never has (with k > w at
//! level 0, the (w+1)-th drafter token). The tree is then picked by a
//! best-first traversal of the candidate tree: a heap keyed by score (ties: shallower first,
//! then creation order) that starts with the level-0 candidates and, on popping a node,
//! pushes the node's candidate children. The first `max_nodes` popped nodes plus the root
//! are the tree. A node is only ever pushed after its parent was popped, so the tree is
//! ancestor-closed by construction, even where a child outscores its parent (ln(1 + ε) > 0
//! in f64) — the case where the official sort-all-and-cut implementation drops a parent but
//! keeps its child.
use std::cell::RefCell;
use std::collections::BinaryHeap;

use crate::memo::{Cache, Memo};
use crate::order::{total_key, BestOf, HeapKey, TopW};
use crate::params::{Candidates, SearchParams};
use crate::rows::TopkRows;
use crate::{Error, NgramScorer, Result, Tree};

const NONE: u32 = u32::MAX;

/// One node of the candidate tree.
#[derive(Clone, Copy)]
struct Cand {
    score: f64,
    token: u32,
    /// Token before this one on the path (the parent's token; the root token at level 0):
    /// with `token` it is the trigram context of this node's children.
    prev: u32,
    /// Candidate index of the parent, `NONE` at level 0.
    parent: u32,
    level: u16,
    /// Children occupy `child_start .. child_start + child_len` (0 if never expanded).
    child_start: u32,
    child_len: u32,
    /// Index in the output tree once selected.
    tree_idx: u32,
    /// A candidate of the tree (among the best `beam_width` of its level, or any stored
    /// expansion with [`Candidates::All`]).
    kept: bool,
    /// The lowest score on the path to this node (itself included), for the pruning
    /// against the tree.
    path_min: f64,
}

/// Reused buffers: one search allocates nothing after the first on a thread.
#[derive(Default)]
struct Scratch {
    cands: Vec<Cand>,
    beam: Vec<u32>,
    next: Vec<u32>,
    drafter: Vec<f64>,
    valid: Vec<u32>,
    sorted: Vec<u32>,
    keys: Vec<u64>,
    eos: Vec<bool>,
    gbuf: Vec<f64>,
    ngram: Vec<f64>,
    /// Column sets of the level are bitsets of `wn = nv.div_ceil(64)` words (column vi is bit
    /// vi % 64 of word vi / 64): the passes of an entry visit only the set bits (trailing
    /// zeros), where per-column `bool`/`u8` arrays cost a data-dependent branch per column in
    /// each of five passes over the row. On tools/bench_tree.py (real rows: ~117 entries per
    /// search, ~15 of 25 columns alive after the first bound, ~10 after the n-gram bounds)
    /// search CPU p50 138 -> 125 µs (min of 8 interleaved runs), trees bit-identical.
    /// `alive`: the current entry's columns still in reach of the level's best w.
    alive: Vec<u64>,
    /// Scratch column set: the columns to look up next.
    want: Vec<u64>,
    /// Scratch set of token ranks (positions in `sorted`).
    tmask: Vec<u64>,
    /// Token rank of each column: `sorted[rank[vi]] == vi`.
    rank: Vec<u32>,
    memo_ctx: Vec<CtxMemo>,
    /// Per two-token context (`wn` words from `slot * wn`): columns whose term is known
    /// (`known`), and columns not seen after both tokens whose term is the one-token term of
    /// the last token, not known yet for this context (`pending`).
    known: Vec<u64>,
    pending: Vec<u64>,
    g1: Vec<f64>,
    /// Per last token (`wn` words from its memo index `* wn`): columns whose term is in `g1`.
    known1: Vec<u64>,
    /// Per last token b: (b, offset in g1, upper bound of its backoff term).
    memo_b: Vec<(u32, usize, f64)>,
    /// Answers of [`NgramScorer::trigram_context`] (key (a, b, 0)) and
    /// [`NgramScorer::backoff_bound`] (key (`NONE`, b, 1), handle `[0; 3]`) of the search so far, all
    /// levels: on tools/bench_tree.py with real drafter rows 44 % of a search's context
    /// resolutions repeat one of an earlier level (synthetic rows: ~1 %). (A linear scan of
    /// a list cost ~28 k instructions per search with synthetic rows: ~80 contexts.)
    resolved: Memo<([u64; 3], f64)>,
    /// ln(g + ε) of the probabilities looked up so far in the search, all levels: of
    /// g(v | a, b) under context (a, b) (NaN: v not seen after both), of the backoff g(v | b)
    /// under (`NONE`, b). The per-level memos above miss these: a level's row has other
    /// tokens, but on tools/bench_tree.py (real rows) 36 % of the two-token and 43 % of the
    /// one-token candidates of a search were looked up at an earlier level already. Only the
    /// misses (`miss_tokens`, at positions `miss_at` of the level's list) go to the index, and
    /// only their ln is made (the level's scale multiplies it). 673 k -> 670 k instructions
    /// per search, search CPU p50 min 94.5 -> 92.6 µs, median 97.0 -> 94.9 µs (24
    /// interleaved runs). (The same with a branch on hit or miss in `memo_split`: 656 k
    /// instructions, but ~1 % slower than without the cache: the outcome is a coin flip for
    /// the predictor. With 1,024 slots instead of 4,096: +6 %.)
    gmemo: Cache,
    miss_tokens: Vec<u32>,
    miss_at: Vec<u32>,
    gmiss: Vec<f64>,
    sub_tokens: Vec<u32>,
    sub_cols: Vec<u32>,
    top: TopW,
    /// The best `max_nodes` path minima of the candidates so far (with [`Candidates::Beam`],
    /// of the finished levels).
    tree_top: BestOf,
    /// Per level, what the levels from it on can add to a score ([`gain_bounds`]).
    rest: Vec<f64>,
    popped: Vec<u32>,
    heap: BinaryHeap<HeapKey>,
    child_tokens: Vec<u32>,
    child_probs: Vec<f64>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl Scratch {
    /// Beam entry `e` of level `l`: (parent candidate, its score, trigram context of its
    /// children). Level 0 has one entry, the root, whose context is the last two context tokens.
    fn entry(&self, l: usize, e: usize, context: &[u32]) -> (u32, f64, [u32; 2]) {
        if l == 0 {
            let rc = root_context(context);
            (NONE, 0.0, if rc.len() == 2 { [rc[0], rc[1]] } else { [NONE, rc[0]] })
        } else {
            let c = &self.cands[self.beam[e] as usize];
            (self.beam[e], c.score, [c.prev, c.token])
        }
    }

    fn push_cand(&mut self, score: f64, token: u32, prev: u32, parent: u32, level: usize) {
        push_cand(&mut self.cands, score, token, prev, parent, level);
    }

    /// Record that `parent`'s children are the candidates created since `child_start`.
    fn close_children(&mut self, parent: u32, child_start: u32) {
        if parent != NONE {
            let end = self.cands.len() as u32;
            let p = &mut self.cands[parent as usize];
            p.child_start = child_start;
            p.child_len = end - child_start;
        }
    }
}

fn push_cand(cands: &mut Vec<Cand>, score: f64, token: u32, prev: u32, parent: u32, level: usize) {
    cands.push(Cand {
        score,
        token,
        prev,
        parent,
        level: level as u16,
        child_start: 0,
        child_len: 0,
        tree_idx: NONE,
        kept: false,
        path_min: score,
    });
}

/// A trigram context as the index wants it: one token when there is no token before the root.
fn context_slice(ctx: &[u32; 2]) -> &[u32] {
    if ctx[0] == NONE {
        &ctx[1..]
    } else {
        &ctx[..]
    }
}

fn with_scratch<T>(f: impl FnOnce(&mut Scratch) -> T) -> T {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        // Re-entered from inside a scorer: use a fresh buffer set instead of panicking.
        Err(_) => f(&mut Scratch::default()),
    })
}

fn check_context(context: &[u32], vocab: u32) -> Result<()> {
    if context.is_empty() {
        return Err(Error::EmptyContext);
    }
    // Only the last two tokens are ever read; older ones need not be valid ids.
    for &t in &context[context.len().saturating_sub(2)..] {
        if t >= vocab {
            return Err(Error::TokenOutOfVocab { what: "context", token: t as u64, vocab });
        }
    }
    Ok(())
}

/// The trigram context of the root's children: the last (up to) two committed tokens.
fn root_context(context: &[u32]) -> &[u32] {
    &context[context.len().saturating_sub(2)..]
}

/// Eq. (10) beam search over `d` rows of drafter top-k.
///
/// * `context`: committed tokens, at least one; the last is the root (the bonus token), the
///   last two are the trigram context of level 0. A one-token context backs off to the
///   bigram (then unigram) statistics of that token.
/// * `rows`: `d` rows of `k`; row l is the top-k of drafter row l and its log-probabilities
///   renormalised inside the top-k (log-softmax over the k logits, computed in fp32 by the
///   caller; `dartcore.tree.topk_logprobs` does it). Here p = exp(logprob) and ln(p + ε) are
///   computed in f64. A −inf log-probability marks an impossible token: it is never a
///   candidate (so short rows can be padded with −inf).
///
/// For a node v at level l with trigram context c (the two tokens before v on
/// committed text + path): `Δs = (level_decay^l · ln(p_l(v) + ε) + ngram_weight ·
/// ln(g(v|c) + ε)) / (l + 1)^depth_exponent`, s(v) = s(parent) + Δs, s(root) = 0.
/// Each level expands every beam entry (in beam order) by row l's tokens (in row order); that
/// is the creation order used for ties. The next beam is the best `beam_width` non-EOS
/// candidates of the level (score descending, then creation order). The tree is selected by
/// the best-first traversal described in the module docs: each level keeps its best
/// `beam_width` expansions (score descending, then creation order) as candidates, and those
/// not ending in EOS are the next beam.
pub fn beam_search<S: NgramScorer + ?Sized>(
    scorer: &S,
    context: &[u32],
    rows: TopkRows<'_>,
    params: &SearchParams,
) -> Result<Tree> {
    checked_search(scorer, context, rows, params, true)
}

/// [`beam_search`] without any of its pruning: every expansion of a reachable beam entry is
/// scored (all its n-gram terms looked up) and offered to the level's best w and the tree.
/// The tests compare it with [`beam_search`], which must return the same tree bit for bit.
#[doc(hidden)]
pub fn beam_search_unpruned<S: NgramScorer + ?Sized>(
    scorer: &S,
    context: &[u32],
    rows: TopkRows<'_>,
    params: &SearchParams,
) -> Result<Tree> {
    checked_search(scorer, context, rows, params, false)
}

/// The arguments checked, then one search on this thread's scratch (`prune`: see
/// [`beam_search_unpruned`]).
fn checked_search<S: NgramScorer + ?Sized>(
    scorer: &S,
    context: &[u32],
    rows: TopkRows<'_>,
    params: &SearchParams,
    prune: bool,
) -> Result<Tree> {
    params.validate()?;
    let vocab = scorer.vocab_size();
    check_context(context, vocab)?;
    rows.check(vocab)?;
    with_scratch(|s| beam_search_in(s, scorer, context, rows, params, prune))
}

/// Upper bounds for the pruning against the tree's θ-th best path minimum (see
/// [`beam_search_in`]): `rest[l]` bounds what levels `l..d` can add to a score (the sum of
/// each level's largest possible positive term; zero unless ε makes ln(1 + ε) > 0 or a weight
/// is negative), and `margin` absorbs rounding, one value for the whole search.
fn gain_bounds(rest: &mut Vec<f64>, d: usize, params: &SearchParams) -> f64 {
    rest.clear();
    rest.resize(d + 1, 0.0);
    let (ln_top, ln_eps) = ((1.0 + params.eps).ln(), params.eps.ln());
    // The largest |term| of any level bounds |score| / d; NaN or inf (ε = 0) turns the
    // pruning off (an infinite margin), never on.
    let mut mag = 0.0f64;
    for l in (0..d).rev() {
        let div = ((l + 1) as f64).powf(params.depth_exponent);
        let decay = params.level_decay.powi(l as i32);
        let use_ngram = params.ngram_weight != 0.0 && (l > 0 || params.ngram_first_level);
        let scale = if use_ngram { params.ngram_weight / div } else { 0.0 };
        let (a_hi, a_lo) = (decay * ln_top / div, decay * ln_eps / div);
        let (b_hi, b_lo) = (scale * ln_top, scale * ln_eps);
        let gain = a_hi.max(a_lo).max(0.0) + b_hi.max(b_lo).max(0.0);
        rest[l] = rest[l + 1] + if gain.is_nan() { f64::INFINITY } else { gain };
        let m = a_hi.abs().max(a_lo.abs()) + b_hi.abs().max(b_lo.abs());
        mag += if m.is_nan() { f64::INFINITY } else { m };
    }
    1e-9 * (1.0 + mag)
}

/// One search (see [`beam_search`]): level by level, every beam entry is expanded by the
/// level's row ([`expand_entry`]) as far as the pruning lets the expansions matter
/// ([`entry_reach`], [`mark_alive`], [`ngram_terms`]); the level's best w become candidates and
/// the next beam ([`keep_top`]); the tree is picked from the candidates ([`select_tree`]).
fn beam_search_in<S: NgramScorer + ?Sized>(
    s: &mut Scratch,
    scorer: &S,
    context: &[u32],
    rows: TopkRows<'_>,
    params: &SearchParams,
    prune: bool,
) -> Result<Tree> {
    let root = *context.last().expect("checked non-empty");
    s.cands.clear();
    s.beam.clear();
    s.resolved.clear();
    s.gmemo.clear();
    s.tree_top.clear();
    let all = params.candidates == Candidates::All;
    let mmargin = gain_bounds(&mut s.rest, rows.d, params);
    for l in 0..rows.d {
        let lv = load_level(s, rows, l, params)?;
        let n_entries = if l == 0 { 1 } else { s.beam.len() };
        if lv.use_ngram {
            reserve_memos(s, n_entries, lv.nv, lv.wn);
        }
        for e in 0..n_entries {
            let (parent, pscore, ctx) = s.entry(l, e, context);
            let low = match entry_reach(s, &lv, parent, pscore, params, all, prune, mmargin) {
                Reach::Stop => break,
                Reach::Skip => continue,
                Reach::Above(low) => low,
            };
            if !mark_alive(s, lv.nv, low) {
                continue;
            }
            let memo = if lv.use_ngram {
                let slot = memo_offset(s, ctx, lv.nv);
                ngram_terms(s, scorer, slot, lv.nv, lv.wn, (lv.scale, lv.scale_ln_eps), params, -(low + lv.bmax));
                s.memo_ctx[slot].off
            } else {
                usize::MAX
            };
            let child_start = s.cands.len() as u32;
            expand_entry(s, &lv, parent, pscore, ctx[1], memo, params, all, prune);
            s.close_children(parent, child_start);
        }
        keep_top(s, params, !all);
        if s.beam.is_empty() {
            break;
        }
    }
    if all && prune {
        drop_below_cut(s, params.max_nodes);
    }
    Ok(select_tree(s, root, params.max_nodes))
}

/// What [`load_level`] works out once per level, for every entry of the level.
struct Level<'r> {
    l: usize,
    /// The level's row of drafter tokens (column order).
    row_tokens: &'r [u32],
    /// Columns that can be candidates (finite log-prob), and `nv.div_ceil(64)` words of bits.
    nv: usize,
    wn: usize,
    /// Whether the level has an n-gram term; its weight `ngram_weight / (l + 1)^depth_exponent`
    /// and the term of g = 0.
    use_ngram: bool,
    scale: f64,
    scale_ln_eps: f64,
    /// The largest possible n-gram term (0 without one) and drafter term of the level.
    bmax: f64,
    amax: f64,
}

/// Read row `l` into the scratch: the valid columns with their drafter terms and EOS flags,
/// sorted by token as the index wants them (a duplicate token is an error), and the column
/// sets sized to the row.
fn load_level<'r>(s: &mut Scratch, rows: TopkRows<'r>, l: usize, params: &SearchParams) -> Result<Level<'r>> {
    let (row_tokens, row_lp) = rows.row(l);
    let div = ((l + 1) as f64).powf(params.depth_exponent);
    let decay = params.level_decay.powi(l as i32);
    // Columns that can be candidates (finite log-prob), their drafter terms, EOS flags.
    s.valid.clear();
    s.drafter.clear();
    s.eos.clear();
    for (j, &lp) in row_lp.iter().enumerate() {
        if lp != f32::NEG_INFINITY {
            s.valid.push(j as u32);
            s.drafter.push(decay * ((lp as f64).exp() + params.eps).ln() / div);
            s.eos.push(params.eos.contains(&row_tokens[j]));
        }
    }
    // The index wants strictly increasing candidate ids: sort the valid columns by token.
    // (As (token, column) pairs packed in u64 keys: a sort of plain integers, where
    // sorting the columns by a key read through two indirections cost ~10 k
    // instructions per search.)
    s.keys.clear();
    let key = |(i, &j): (usize, &u32)| (row_tokens[j as usize] as u64) << 32 | i as u64;
    s.keys.extend(s.valid.iter().enumerate().map(key));
    s.keys.sort_unstable();
    // `valid` and `sorted` now describe the row; build the sorted token list in `next`'s
    // spare buffer (child_tokens) to avoid another allocation.
    s.sorted.clear();
    s.child_tokens.clear();
    for &key in &s.keys {
        s.sorted.push(key as u32);
        s.child_tokens.push((key >> 32) as u32);
    }
    if let Some(w) = s.child_tokens.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::DuplicateToken { row: l, token: w[0] });
    }
    let nv = s.valid.len();
    let use_ngram = params.ngram_weight != 0.0 && (l > 0 || params.ngram_first_level);
    let scale = params.ngram_weight / div;
    // Largest possible n-gram term (g ∈ [0, 1]); an upper bound for pruning below.
    // The term of g = 0, computed once per level (ln is ~5 % of a search).
    let scale_ln_eps = scale * params.eps.ln();
    let bmax = if use_ngram { (scale * (1.0 + params.eps).ln()).max(scale_ln_eps) } else { 0.0 };
    let amax = s.drafter.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    s.drafter.resize(nv.div_ceil(64) * 64, f64::NEG_INFINITY);
    s.top.clear();
    let wn = nv.div_ceil(64);
    s.gbuf.resize(nv, 0.0);
    s.gmiss.resize(nv, 0.0);
    s.miss_tokens.resize(nv, 0);
    s.miss_at.resize(nv, 0);
    s.sub_tokens.resize(nv, 0);
    s.sub_cols.resize(nv, 0);
    s.memo_ctx.clear();
    s.memo_b.clear();
    s.alive.resize(wn, 0);
    s.want.resize(wn, 0);
    s.tmask.resize(wn, 0);
    s.rank.resize(nv, 0);
    for (si, &vi) in s.sorted.iter().enumerate() {
        s.rank[vi as usize] = si as u32;
    }
    Ok(Level { l, row_tokens, nv, wn, use_ngram, scale, scale_ln_eps, bmax, amax })
}

/// Make room in the n-gram memos for `n_entries` beam entries of a level of `nv` columns
/// (`wn` words) and clear their column sets.
fn reserve_memos(s: &mut Scratch, n_entries: usize, nv: usize, wn: usize) {
    // Room for one two-token memo and one backoff memo per beam entry, reserved once
    // per level: the vectors only grow (from search to search), the column sets are
    // cleared, the terms are read only where set. (A resize per memo cost ~25 k
    // instructions per search on tools/bench_tree.py.)
    let (nf, nw) = (n_entries * nv, n_entries * wn);
    for v in [&mut s.ngram, &mut s.g1] {
        if v.len() < nf {
            v.resize(nf, 0.0);
        }
    }
    for v in [&mut s.known, &mut s.pending, &mut s.known1] {
        if v.len() < nw {
            v.resize(nw, 0);
        }
        v[..nw].fill(0);
    }
}

/// How far down an entry's expansions can matter (see [`entry_reach`]).
enum Reach {
    /// Neither this entry nor any later one of the level (they score lower) can add a
    /// candidate: the level is done.
    Stop,
    /// This entry cannot; later ones may.
    Skip,
    /// Columns whose drafter term is below this cannot (`-inf` without pruning).
    Above(f64),
}

/// The pruning threshold of beam entry (`parent`, `pscore`) of level `lv`.
#[allow(clippy::too_many_arguments)]
#[inline]
fn entry_reach(
    s: &Scratch,
    lv: &Level<'_>,
    parent: u32,
    pscore: f64,
    params: &SearchParams,
    all: bool,
    prune: bool,
    mmargin: f64,
) -> Reach {
    // Exact pruning. Only the best `beam_width` expansions of a level are kept, and
    // a later expansion that ties the current w-th best loses on creation order, so
    // an expansion whose score cannot exceed the current w-th best score (`floor`)
    // is never kept, never a candidate, never expanded: skip it, and its index
    // lookup. Beam entries come in descending score, so once a whole entry is out of
    // reach, so are all after it. The margin absorbs rounding (the bound adds terms
    // in another order than the score). Measured on the real-text benchmark index
    // (tools/bench_tree.py): ~4x fewer cond_probs candidates and ln() calls. (Taking
    // the pairs of a level in best-bound-first order instead saved under 10% of the
    // lookups there: the bound is loose, real n-gram terms are far below it.)
    //
    // With Candidates::All an expansion also matters when it can be in the tree. The
    // tree holds no node with θ candidates ahead of it in an ancestor-closed set: the
    // candidates whose path minimum beats it (the best-first traversal pops all of
    // them first). So the threshold is the lower of the beam's floor and the θ-th
    // best path minimum so far (`tree_top`), and the same bounds prune the lookups.
    let bfloor = s.top.floor(params.beam_width);
    let mut floor = bfloor;
    if all {
        floor = floor.min(s.tree_top.floor(params.max_nodes));
    }
    let margin = 1e-9 * (1.0 + floor.abs());
    // Column a is out of reach when pscore + a + bmax + margin < floor, i.e. when
    // a < floor − pscore − bmax − margin (`low`): one comparison per column, eight
    // columns' flags packed into bits by one multiplication (no shift and OR per
    // column): ~18 k fewer instructions per search on tools/bench_tree.py (real rows).
    // Rounding either way is far inside the margin, so the test stays exact pruning.
    // NaN (−inf + inf with ε = 0, or floor = pscore = −inf) keeps every column, as
    // NaN in the sum did (`f64::max` ignores a NaN bound).
    let mut low = floor - pscore - lv.bmax - margin;
    // Pruning against the tree (both candidate sets). M, the θ-th best path minimum
    // of the candidates so far (`tree_top`; with `Beam` only of finished levels,
    // whose candidates are final), only rises. A node whose score stays below M is
    // never in the tree: θ candidates whose whole paths score above it are popped
    // first. Such nodes still compete for the beam, but dropping them changes the
    // best w of a level only below them: the nodes that enter the beam in their place
    // score lower still, so they and all their descendants stay below M too, and are
    // dropped in turn (an entry below M − rest is skipped whole). Every node that is
    // in one search and not the other thus scores below M, and the tree is the same,
    // bit for bit. `rest[l]` bounds what levels l.. can add (children can outscore
    // their parent by ln(1 + ε) > 0), `mmargin` the rounding. So a column is
    // dropped when its bound cannot reach M − rest[l + 1]; with `All` that is the
    // only test for a child of a parent on a path above M (every expansion is a
    // candidate), and a child of a parent below M (never in the tree itself) must
    // also be able to enter the beam.
    let mt = s.tree_top.floor(params.max_nodes);
    let tree_low = mt - s.rest[lv.l + 1] - pscore - lv.bmax - mmargin;
    low = low.max(tree_low);
    if !prune {
        low = f64::NEG_INFINITY;
    } else if pscore + 0.5 * mmargin < mt - s.rest[lv.l] || lv.amax < low {
        // Later entries score lower: out of reach too.
        return Reach::Stop;
    }
    if prune && all && parent != NONE && s.cands[parent as usize].path_min < mt {
        low = low.max(bfloor - pscore - lv.bmax - 1e-9 * (1.0 + bfloor.abs()));
        if lv.amax < low {
            return Reach::Skip;
        }
    }
    Reach::Above(low)
}

/// Set `s.alive` to the level's `nv` columns whose drafter term is not below `low`; false if
/// there are none.
#[inline]
fn mark_alive(s: &mut Scratch, nv: usize, low: f64) -> bool {
    let mut any = 0u64;
    for (wi, word) in s.alive.iter_mut().enumerate() {
        // `drafter` is padded to whole words; the padding's bits are cleared below.
        let mut m = 0u64;
        let used = (nv - wi * 64).min(64).div_ceil(8) * 8;
        for (ci, chunk) in s.drafter[wi * 64..wi * 64 + used].chunks_exact(8).enumerate() {
            let chunk: &[f64; 8] = chunk.try_into().expect("8 columns");
            // Eight 0/1 bytes, gathered into eight bits by one multiplication.
            let mut flags = [0u8; 8];
            for (f, &a) in flags.iter_mut().zip(chunk) {
                // Negated on purpose: a NaN bound must keep the node.
                #[allow(clippy::neg_cmp_op_on_partial_ord)]
                let ok = !(a < low);
                *f = ok as u8;
            }
            let byte = u64::from_le_bytes(flags).wrapping_mul(0x0102_0408_1020_4080) >> 56;
            m |= byte << (8 * ci);
        }
        if nv < wi * 64 + 64 {
            m &= (1u64 << (nv - wi * 64)) - 1;
        }
        *word = m;
        any |= m;
    }
    any != 0
}

/// Score the alive columns of the entry (`parent`, `pscore`) whose children have trigram
/// context (…, `prev`): drafter term plus the n-gram term at `s.ngram[memo + column]`
/// (`memo == usize::MAX`: none), and store the expansions that can still be kept.
#[allow(clippy::too_many_arguments)]
#[inline]
fn expand_entry(
    s: &mut Scratch,
    lv: &Level<'_>,
    parent: u32,
    pscore: f64,
    prev: u32,
    memo: usize,
    params: &SearchParams,
    all: bool,
    prune: bool,
) {
    for wi in 0..lv.wn {
        let mut m = s.alive[wi];
        while m != 0 {
            let vi = wi * 64 + m.trailing_zeros() as usize;
            m &= m - 1;
            let mut delta = s.drafter[vi];
            if memo != usize::MAX {
                delta += s.ngram[memo + vi];
            }
            let score = pscore + delta;
            // Only expansions that enter the level's best w so far are stored: the
            // others are never kept, so never in the tree nor expanded. Skipping them
            // keeps the creation order of the stored ones, the tie-breaker everywhere.
            let key = total_key(score);
            if all {
                // Stored when it can be in the beam (non-EOS, among the best w so far)
                // or in the tree (ahead of the θ-th best path minimum: a tie loses,
                // being deeper or later than every candidate before it).
                let to_beam = !s.eos[vi] && s.top.admits(key, params.beam_width);
                if to_beam || !prune || s.tree_top.admits(key, params.max_nodes) {
                    let idx = s.cands.len() as u32;
                    if to_beam {
                        s.top.insert(key, idx, params.beam_width);
                    }
                    let pmin = if parent == NONE { score } else { s.cands[parent as usize].path_min.min(score) };
                    let pkey = total_key(pmin);
                    if s.tree_top.admits(pkey, params.max_nodes) {
                        s.tree_top.insert(pkey, params.max_nodes);
                    }
                    s.push_cand(score, lv.row_tokens[s.valid[vi] as usize], prev, parent, lv.l);
                    let c = s.cands.last_mut().expect("just pushed");
                    c.kept = true;
                    c.path_min = pmin;
                }
            } else if s.top.admits(key, params.beam_width) {
                let idx = s.cands.len() as u32;
                s.top.insert(key, idx, params.beam_width);
                let pmin = if parent == NONE { score } else { s.cands[parent as usize].path_min.min(score) };
                s.push_cand(score, lv.row_tokens[s.valid[vi] as usize], prev, parent, lv.l);
                s.cands.last_mut().expect("just pushed").path_min = pmin;
            }
        }
    }
}

/// With [`Candidates::All`], after the last level: only the candidates at or above the final
/// cut stay candidates.
fn drop_below_cut(s: &mut Scratch, max_nodes: usize) {
    // A candidate whose score is below the final θ-th best path minimum M is never
    // selected (θ candidates, ancestors included, beat it), so the traversal need not
    // push it: the paper's set stores ~3x the beam set's candidates, most of them such.
    let m = s.tree_top.floor(max_nodes);
    for c in s.cands.iter_mut() {
        c.kept = c.score >= m;
    }
}

/// Slot of two-token context `ctx` in `s.memo_ctx` (its terms in `s.ngram`, its column sets
/// in `s.known` / `s.pending`), added if new.
fn memo_offset(s: &mut Scratch, ctx: [u32; 2], nv: usize) -> usize {
    match s.memo_ctx.iter().position(|m| m.ctx == ctx) {
        Some(i) => i,
        None => {
            let slot = s.memo_ctx.len();
            s.memo_ctx.push(CtxMemo { ctx, off: slot * nv, handle: [u64::MAX; 3], bound: f64::NAN });
            slot
        }
    }
}

/// A two-token context of a level: where its terms are, and (once resolved) its
/// [`NgramScorer::trigram_context`] handle and the bound of its trigram terms (NaN before).
#[derive(Clone, Copy)]
struct CtxMemo {
    ctx: [u32; 2],
    off: usize,
    handle: [u64; 3],
    bound: f64,
}

/// The n-gram terms `ngram_weight · ln(g(v|ctx) + ε) / (l + 1)^depth_exponent` (`scale` is
/// the weight over the divisor; `scale_ln_eps` = `scale · ln ε`) of the level's columns set in `s.alive`, into
/// `s.ngram[off + column]` (`off` from [`memo_offset`]), setting them in the context's
/// `s.known`. A column whose term turns out to be too small for the level's best w is
/// cleared in `s.alive` instead (below).
///
/// Two memos, both per level. Terms are kept per two-token context (different paths often
/// end in the same two tokens): only columns not yet known for `ctx` are looked up. And the
/// term of the backoff below the two-token level, g(v | b) for the last token b (then the
/// unigram), is kept per b in `s.g1`: the beams of a level end in few distinct tokens, whose
/// child lists are the long ones (thousands of children), so each is searched once per level
/// (on the real-text benchmark: 54 one-token queries per search instead of about 80). The
/// combination equals `cond_probs(ctx, ..)` bit for bit, as [`NgramScorer::trigram_probs`]
/// requires.
///
/// Exact pruning with per-context bounds, tighter than the g <= 1 of the caller's check. A
/// column seen after both tokens has g <= the bound of [`NgramScorer::trigram_context`] (the
/// largest probability after (a, b)); one not seen has g(v|ctx) = g(v|b) <=
/// [`NgramScorer::backoff_bound`] (the largest after b, or of the unigram). `gap` = parent
/// score − floor + margin (see the caller): a column cannot enter the level's best w when
/// `drafter + bound + gap < 0`. So before the two-token lookup, columns are dropped (for this
/// entry) against the larger of the two bounds, and before the one-token lookup against the
/// backoff bound. On the bench (tools/bench_tree.py, 2,000 searches) with real drafter rows
/// this cuts the candidates of two-token lookups from 1,358 to 858 per search and of
/// one-token lookups from 497 to 309; with synthetic rows from 1,166 to 967 and 620 to 501.
/// The context is resolved once per level (`trigram_context`), and later lookups of the same
/// context use its handle.
#[allow(clippy::too_many_arguments)]
fn ngram_terms<S: NgramScorer + ?Sized>(
    s: &mut Scratch,
    scorer: &S,
    slot: usize,
    nv: usize,
    wn: usize,
    (scale, scale_ln_eps): (f64, f64),
    params: &SearchParams,
    gap: f64,
) {
    let CtxMemo { ctx, off, .. } = s.memo_ctx[slot];
    let moff = slot * wn;
    // A term as a function of g is monotone (increasing, or decreasing for a negative weight):
    // the bound of the terms of all g in [0, gmax].
    let term_bound = |gmax: f64| (scale * (gmax + params.eps).ln()).max(scale_ln_eps);
    let b = ctx[1];
    let (bi, bound1) = match s.memo_b.iter().position(|(t, _, _)| *t == b) {
        Some(i) => (i, s.memo_b[i].2),
        None => {
            let boff = s.memo_b.len() * nv;
            let gmax = match s.resolved.get([NONE, b, 1]) {
                Some((_, g)) => g,
                None => {
                    let g = scorer.backoff_bound(b, params.unigram_backoff);
                    s.resolved.insert([NONE, b, 1], ([0; 3], g));
                    g
                }
            };
            let bound = term_bound(gmax);
            s.memo_b.push((b, boff, bound));
            (s.memo_b.len() - 1, bound)
        }
    };
    let (boff, b1off) = (s.memo_b[bi].1, bi * wn);
    // Columns wanted and never looked up for ctx.
    let mut wanted = 0u64;
    for wi in 0..wn {
        let w = s.alive[wi] & !(s.known[moff + wi] | s.pending[moff + wi]);
        s.want[wi] = w;
        wanted |= w;
    }
    if wanted != 0 {
        if ctx[0] == NONE {
            for wi in 0..wn {
                s.pending[moff + wi] |= s.want[wi];
            }
        } else {
            if s.memo_ctx[slot].bound.is_nan() {
                let (handle, gmax) = match s.resolved.get([ctx[0], ctx[1], 0]) {
                    Some(r) => r,
                    None => {
                        let r = scorer.trigram_context(ctx);
                        s.resolved.insert([ctx[0], ctx[1], 0], r);
                        r
                    }
                };
                s.memo_ctx[slot].handle = handle;
                s.memo_ctx[slot].bound = term_bound(gmax);
            }
            let CtxMemo { handle, bound: bound3, .. } = s.memo_ctx[slot];
            // Whether seen after both tokens or backed off, a term is at most `bound`: drop
            // the columns that cannot enter the level's best w even so (left unknown: a later
            // entry with the same context may still want them).
            let m = gather_wanted(s, wn, bound3.max(bound1), gap);
            let m2 = memo_split(s, [ctx[0], ctx[1]], m);
            if m2 > 0 {
                scorer.trigram_probs_at(ctx, handle, &s.miss_tokens[..m2], &mut s.gmiss[..m2]);
                memo_merge(s, [ctx[0], ctx[1]], m2, params.eps);
            }
            // Columns seen after both tokens get their term now; the others back off.
            for i in 0..m {
                let vi = s.sub_cols[i] as usize;
                let (wi, bit) = (moff + vi / 64, 1u64 << (vi % 64));
                let g = s.gbuf[i];
                if g.is_nan() {
                    s.pending[wi] |= bit;
                } else {
                    s.known[wi] |= bit;
                    s.ngram[off + vi] = scale * g;
                }
            }
        }
    }
    // Backed-off columns: the known one-token terms are copied, hopeless ones dropped, the
    // rest looked up in b's child list at once.
    let mut rest = 0u64;
    for wi in 0..wn {
        let pend = s.alive[wi] & s.pending[moff + wi];
        let mut hit = pend & s.known1[b1off + wi];
        if hit != 0 {
            s.known[moff + wi] |= hit;
            s.pending[moff + wi] &= !hit;
            while hit != 0 {
                let vi = wi * 64 + hit.trailing_zeros() as usize;
                hit &= hit - 1;
                s.ngram[off + vi] = s.g1[boff + vi];
            }
        }
        s.want[wi] = pend & !s.known1[b1off + wi];
        rest |= s.want[wi];
    }
    if rest == 0 {
        return;
    }
    let m1 = gather_wanted(s, wn, bound1, gap);
    if m1 > 0 {
        let m2 = memo_split(s, [NONE, b], m1);
        if m2 > 0 {
            scorer.cond_probs(&[b], &s.miss_tokens[..m2], params.unigram_backoff, &mut s.gmiss[..m2]);
            memo_merge(s, [NONE, b], m2, params.eps);
        }
        for i in 0..m1 {
            let vi = s.sub_cols[i] as usize;
            let (wi, bit) = (vi / 64, 1u64 << (vi % 64));
            let t = scale * s.gbuf[i];
            s.g1[boff + vi] = t;
            s.known1[b1off + wi] |= bit;
            s.ngram[off + vi] = t;
            s.known[moff + wi] |= bit;
            s.pending[moff + wi] &= !bit;
        }
    }
}

/// The probabilities of `s.sub_tokens[..m]` after context `key` known from `s.gmemo` into
/// `s.gbuf`; the others into `s.miss_tokens[..m2]` (ascending, as the index wants them),
/// their positions in `s.miss_at`. Returns m2.
fn memo_split(s: &mut Scratch, key: [u32; 2], m: usize) -> usize {
    let c = Cache::context(key[0], key[1]);
    let mut m2 = 0;
    let (miss_tokens, miss_at) = (&mut s.miss_tokens[..m], &mut s.miss_at[..m]);
    for (i, (&t, g)) in s.sub_tokens[..m].iter().zip(&mut s.gbuf[..m]).enumerate() {
        // Without a branch on the outcome (hits are ~40 %, a coin flip for the predictor):
        // every token is written at the end of the miss list, which only grows on a miss.
        let (hit, v) = s.gmemo.probe(c, t);
        *g = v;
        miss_tokens[m2] = t;
        miss_at[m2] = i as u32;
        m2 += usize::from(!hit);
    }
    m2
}

/// ln(g + ε) of the looked-up probabilities `s.gmiss[..m2]` (NaN stays NaN) into `s.gbuf`
/// and `s.gmemo`.
fn memo_merge(s: &mut Scratch, key: [u32; 2], m2: usize, eps: f64) {
    let c = Cache::context(key[0], key[1]);
    for ((&g, &t), &i) in s.gmiss[..m2].iter().zip(&s.miss_tokens[..m2]).zip(&s.miss_at[..m2]) {
        let v = if g.is_nan() { g } else { (g + eps).ln() };
        s.gbuf[i as usize] = v;
        s.gmemo.insert(c, t, v);
    }
}

/// The columns of `s.want` whose term can still bring them into the level's best w
/// (`drafter + bound + gap >= 0`), in ascending token order, into `s.sub_tokens[..m]` /
/// `s.sub_cols[..m]`; returns m. The others are dropped from `s.alive`. The kept columns are
/// set in a bitset by token rank (`s.rank`), which is then read in order: work in proportion
/// to the (few) wanted columns, not to the row. (A branch-free pass over all columns in
/// token order took 10% of the search on the bench; this one: search CPU p50 125 -> 117 µs.)
fn gather_wanted(s: &mut Scratch, wn: usize, bound: f64, gap: f64) -> usize {
    s.tmask.fill(0);
    for wi in 0..wn {
        let mut w = s.want[wi];
        while w != 0 {
            let bit = w.trailing_zeros();
            w &= w - 1;
            let vi = wi * 64 + bit as usize;
            if s.drafter[vi] + bound + gap < 0.0 {
                s.alive[wi] &= !(1u64 << bit);
            } else {
                let r = s.rank[vi] as usize;
                s.tmask[r / 64] |= 1u64 << (r % 64);
            }
        }
    }
    let mut m = 0;
    for wi in 0..wn {
        let mut t = s.tmask[wi];
        while t != 0 {
            let si = wi * 64 + t.trailing_zeros() as usize;
            t &= t - 1;
            s.sub_tokens[m] = s.child_tokens[si];
            s.sub_cols[m] = s.sorted[si];
            m += 1;
        }
    }
    m
}

/// Mark the level's best `beam_width` expansions (`s.top`) as candidates; those not ending in
/// EOS, best first, are the next beam. Equals [`select_beam`] over every expansion of the level.
/// With `to_tree`, their path minima also enter `s.tree_top` (they are final candidates).
fn keep_top(s: &mut Scratch, params: &SearchParams, to_tree: bool) {
    s.beam.clear();
    for &(_, i) in &s.top.0 {
        let c = &mut s.cands[i as usize];
        c.kept = true;
        if to_tree {
            let pkey = total_key(c.path_min);
            if s.tree_top.admits(pkey, params.max_nodes) {
                s.tree_top.insert(pkey, params.max_nodes);
            }
        }
        if !params.eos.contains(&c.token) {
            s.beam.push(i);
        }
    }
}

/// Keep the best `beam_width` nodes created since `level_start` (score descending, then
/// creation order) as candidates; the kept ones not ending in EOS, in that order, are the
/// next beam.
fn select_beam(s: &mut Scratch, level_start: usize, params: &SearchParams) {
    s.next.clear();
    s.next.extend(level_start as u32..s.cands.len() as u32);
    let cands = &s.cands;
    let better = |a: &u32, b: &u32| cands[*b as usize].score.total_cmp(&cands[*a as usize].score).then(a.cmp(b));
    let w = params.beam_width;
    if s.next.len() > w {
        s.next.select_nth_unstable_by(w - 1, better);
        s.next.truncate(w);
    }
    s.next.sort_unstable_by(better);
    s.beam.clear();
    for &i in &s.next {
        let c = &mut s.cands[i as usize];
        c.kept = true;
        if !params.eos.contains(&c.token) {
            s.beam.push(i);
        }
    }
}

/// Best-first traversal of the candidate tree (level-0 candidates are the roots): pops up to
/// `max_nodes` nodes and returns them, root first, in depth order.
fn select_tree(s: &mut Scratch, root: u32, max_nodes: usize) -> Tree {
    s.heap.clear();
    s.popped.clear();
    for (i, c) in s.cands.iter().enumerate() {
        if c.level != 0 {
            break;
        }
        if c.kept {
            s.heap.push(HeapKey::new(c.score, 0, i as u32));
        }
    }
    while s.popped.len() < max_nodes {
        let Some(top) = s.heap.pop() else { break };
        s.popped.push(top.idx());
        let c = s.cands[top.idx() as usize];
        for ci in c.child_start..c.child_start + c.child_len {
            let ch = &s.cands[ci as usize];
            if ch.kept {
                s.heap.push(HeapKey::new(ch.score, ch.level, ci));
            }
        }
    }
    // Stable by depth; within a depth, pop order (best first). Parents were popped earlier
    // and are shallower, so they get smaller indices.
    s.popped.sort_by_key(|&i| s.cands[i as usize].level);
    let n = s.popped.len() + 1;
    let mut tree = Tree {
        tokens: Vec::with_capacity(n),
        parents: Vec::with_capacity(n),
        depths: Vec::with_capacity(n),
        scores: Vec::with_capacity(n),
    };
    tree.tokens.push(root);
    tree.parents.push(-1);
    tree.depths.push(0);
    tree.scores.push(0.0);
    for (t, &ci) in s.popped.iter().enumerate() {
        let c = s.cands[ci as usize];
        s.cands[ci as usize].tree_idx = t as u32 + 1;
        let parent = if c.parent == NONE { 0 } else { s.cands[c.parent as usize].tree_idx as i32 };
        tree.tokens.push(c.token);
        tree.parents.push(parent);
        tree.depths.push(c.level + 1);
        tree.scores.push(c.score);
    }
    tree
}

/// The n-gram-only tree (no drafter): level l expands every beam entry by the index's top-`k`
/// children of the entry's trigram context (longest suffix with any continuation; see
/// [`NgramScorer::top_children`]), each scored by the n-gram term alone,
/// `Δs = ngram_weight · ln(g(v|c) + ε) / (l + 1)^depth_exponent`. Beam, candidates and
/// best-first selection as in [`beam_search`]; `level_decay` and `ngram_first_level` do not
/// apply.
pub fn ngram_tree<S: NgramScorer + ?Sized>(
    scorer: &S,
    context: &[u32],
    depth: usize,
    k: usize,
    params: &SearchParams,
) -> Result<Tree> {
    params.validate()?;
    check_context(context, scorer.vocab_size())?;
    if depth > u16::MAX as usize - 1 {
        return Err(Error::TooLarge { what: format!("depth = {depth}") });
    }
    with_scratch(|s| ngram_tree_in(s, scorer, context, depth, k, params))
}

fn ngram_tree_in<S: NgramScorer + ?Sized>(
    s: &mut Scratch,
    scorer: &S,
    context: &[u32],
    depth: usize,
    k: usize,
    params: &SearchParams,
) -> Result<Tree> {
    let root = *context.last().expect("checked non-empty");
    s.cands.clear();
    s.beam.clear();
    for l in 0..depth {
        let scale = params.ngram_weight / ((l + 1) as f64).powf(params.depth_exponent);
        let level_start = s.cands.len();
        let n_entries = if l == 0 { 1 } else { s.beam.len() };
        for e in 0..n_entries {
            let (parent, pscore, ctx) = s.entry(l, e, context);
            let cslice = context_slice(&ctx);
            scorer.top_children(cslice, k, params.unigram_backoff, &mut s.child_tokens, &mut s.child_probs)?;
            let child_start = s.cands.len() as u32;
            for (&t, &g) in s.child_tokens.iter().zip(&s.child_probs) {
                push_cand(&mut s.cands, pscore + scale * (g + params.eps).ln(), t, ctx[1], parent, l);
            }
            s.close_children(parent, child_start);
        }
        select_beam(s, level_start, params);
        if s.beam.is_empty() {
            break;
        }
    }
    Ok(select_tree(s, root, params.max_nodes))
}

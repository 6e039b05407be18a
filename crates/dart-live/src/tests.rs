//! The window and the mix against brute force over the same documents.
use std::collections::HashMap;

use dart_tree::{NgramScorer, NoNgram};
use proptest::prelude::*;

use super::*;

/// The window's content recomputed from scratch: the last `capacity` symbols of the
/// documents joined by separators.
fn flat(docs: &[Vec<u32>], capacity: usize) -> Vec<Option<u32>> {
    let mut all: Vec<Option<u32>> = Vec::new();
    for d in docs {
        if d.is_empty() {
            continue;
        }
        let d = &d[d.len().saturating_sub(capacity - 1)..];
        if !all.is_empty() {
            all.push(None);
        }
        all.extend(d.iter().map(|&t| Some(t)));
    }
    let n = all.len();
    all[n.saturating_sub(capacity)..].to_vec()
}

fn brute_g(w: &[Option<u32>], ctx: &[u32], v: u32) -> f64 {
    let mut tri: HashMap<u32, u64> = HashMap::new();
    let mut bi: HashMap<u32, u64> = HashMap::new();
    let n = ctx.len();
    for i in 0..w.len() {
        if n >= 2 && i + 2 < w.len() && w[i] == Some(ctx[n - 2]) && w[i + 1] == Some(ctx[n - 1]) {
            if let Some(c) = w[i + 2] {
                *tri.entry(c).or_default() += 1;
            }
        }
        if n >= 1 && i + 1 < w.len() && w[i] == Some(ctx[n - 1]) {
            if let Some(c) = w[i + 1] {
                *bi.entry(c).or_default() += 1;
            }
        }
    }
    let ratio = |m: &HashMap<u32, u64>| m.get(&v).map(|&c| c as f64 / m.values().sum::<u64>() as f64);
    ratio(&tri).or(ratio(&bi)).unwrap_or(0.0)
}

/// Longest earlier match (2..=max_match, latest on ties) by brute force.
fn brute_suffix(
    w: &[Option<u32>],
    ctx: &[u32],
    max_len: usize,
    min_match: usize,
    max_match: usize,
) -> (usize, Vec<u32>) {
    let n = ctx.len();
    let mut best: Option<(usize, usize)> = None; // (match length, continuation start)
    for q in (0..w.len()).rev() {
        // q: the position after a candidate match
        let mut m = 0;
        while m < max_match.min(n) && q > m && w[q - 1 - m] == Some(ctx[n - 1 - m]) {
            m += 1;
        }
        if m >= 2 && w[q].is_some() && best.is_none_or(|(bm, _)| m > bm) {
            best = Some((m, q));
        }
    }
    match best {
        Some((m, q)) if m >= min_match.max(2) && max_len > 0 => {
            (m, w[q..].iter().map_while(|t| *t).take(max_len).collect())
        }
        _ => (0, Vec::new()),
    }
}

fn docs_strategy() -> impl Strategy<Value = Vec<Vec<u32>>> {
    prop::collection::vec(prop::collection::vec(0u32..6, 0..30), 1..8)
}

/// Half the tokens 0: context 0 has more continuations than the small vector keeps.
fn wide_docs() -> impl Strategy<Value = Vec<Vec<u32>>> {
    let tok = prop_oneof![Just(0u32), 0u32..120];
    prop::collection::vec(prop::collection::vec(tok, 0..400), 1..6)
}

proptest! {
    #[test]
    fn window_equals_brute_force(docs in docs_strategy(), capacity in 4usize..60, ctx in prop::collection::vec(0u32..6, 0..5)) {
        let mut w = Window::new(capacity, 6).unwrap();
        for d in &docs {
            w.check(d).unwrap();
            w.insert(d);
        }
        let f = flat(&docs, capacity);
        prop_assert_eq!(w.len(), f.len());
        let cands: Vec<u32> = (0..6).collect();
        let mut got = vec![0.0; 6];
        live_probs(&w, &[], &ctx, &cands, &mut got);
        for v in 0..6u32 {
            let want = brute_g(&f, &ctx, v);
            prop_assert!((got[v as usize] - want).abs() < 1e-12, "g({v}|{ctx:?}) {} vs {want}", got[v as usize]);
        }
        for (max_len, min_match, max_match) in [(5, 2, 4), (3, 3, 8), (10, 2, 2)] {
            let want = brute_suffix(&f, &ctx, max_len, min_match, max_match);
            prop_assert_eq!(w.suffix_lookup(&ctx, max_len, min_match, max_match), want.clone());
            prop_assert_eq!(w.suffix_match(&ctx, max_len, min_match, max_match), want.1);
        }
    }

    #[test]
    fn wide_contexts_equal_brute_force(docs in wide_docs(), capacity in prop_oneof![Just(5000usize), 50usize..600], a in 0u32..120) {
        let mut w = Window::new(capacity, 120).unwrap();
        for d in &docs {
            w.insert(d);
        }
        let f = flat(&docs, capacity);
        let cands: Vec<u32> = (0..120).collect();
        for ctx in [vec![0], vec![a, 0], vec![0, a]] {
            let mut got = vec![0.0; 120];
            live_probs(&w, &[], &ctx, &cands, &mut got);
            for v in 0..120u32 {
                let want = brute_g(&f, &ctx, v);
                prop_assert!((got[v as usize] - want).abs() < 1e-12, "g({v}|{ctx:?}) {} vs {want}", got[v as usize]);
            }
        }
    }

    #[test]
    fn mix_backs_off_exactly_where_trigram_is_nan(docs in docs_strategy(), a in 0u32..6, b in 0u32..6, weight in 0.0f64..1.0, uni in any::<bool>()) {
        let w = {
            let mut w = Window::new(64, 6).unwrap();
            for d in &docs { w.insert(d); }
            w
        };
        let base = Window::new(64, 6).unwrap(); // an empty static source: everything backs off
        let m = Mixed { base: &Static(&base), live: &w, shared: &[], weight, unigram_backoff: uni };
        let cands: Vec<u32> = (0..6).collect();
        let mut tri = vec![0.0; 6];
        m.trigram_probs([a, b], &cands, &mut tri);
        let mut full = vec![0.0; 6];
        m.cond_probs(&[a, b], &cands, uni, &mut full);
        let mut back = vec![0.0; 6];
        m.cond_probs(&[b], &cands, uni, &mut back);
        for i in 0..6 {
            if tri[i].is_nan() {
                prop_assert_eq!(full[i].to_bits(), back[i].to_bits());
            } else {
                prop_assert_eq!(full[i].to_bits(), tri[i].to_bits());
            }
        }
        let bound = m.backoff_bound(b, uni);
        prop_assert!(back.iter().all(|&g| g <= bound + 1e-15));
    }

    #[test]
    fn trigram_context_bounds_the_mixed_trigram_values(docs in docs_strategy(), a in 0u32..6, b in 0u32..6, weight in 0.0f64..1.0, uni in any::<bool>()) {
        let mut w = Window::new(64, 6).unwrap();
        for d in &docs { w.insert(d); }
        let base = Window::new(64, 6).unwrap();
        let m = Mixed { base: &Static(&base), live: &w, shared: &[], weight, unigram_backoff: uni };
        let cands: Vec<u32> = (0..6).collect();
        let (handle, bound) = m.trigram_context([a, b]);
        let mut at = vec![0.0; 6];
        m.trigram_probs_at([a, b], handle, &cands, &mut at);
        let mut plain = vec![0.0; 6];
        m.trigram_probs([a, b], &cands, &mut plain);
        for i in 0..6 {
            prop_assert_eq!(at[i].to_bits(), plain[i].to_bits());
            prop_assert!(at[i].is_nan() || at[i] <= bound, "g {} above the bound {bound}", at[i]);
        }
    }
}

/// A window read as a static scorer (trigram and bigram levels, uniform unigram level).
struct Static<'a>(&'a Window);

impl NgramScorer for Static<'_> {
    fn vocab_size(&self) -> u32 {
        self.0.vocab_size()
    }
    fn cond_probs(&self, context: &[u32], c: &[u32], uni: bool, out: &mut [f64]) {
        live_probs(self.0, &[], context, c, out);
        if uni {
            for o in out.iter_mut() {
                if *o == 0.0 {
                    *o = 1.0 / 6.0;
                }
            }
        }
    }
    fn trigram_probs(&self, context: [u32; 2], c: &[u32], out: &mut [f64]) {
        NoNgram.trigram_probs(context, c, out);
        let _ = self.0;
    }
    fn top_children(&self, _: &[u32], _: usize, _: bool, t: &mut Vec<u32>, p: &mut Vec<f64>) -> dart_tree::Result<()> {
        t.clear();
        p.clear();
        Ok(())
    }
}

#[test]
fn eviction_leaves_nothing_behind() {
    let mut w = Window::new(8, 10).unwrap();
    for i in 0..50u32 {
        w.insert(&[i % 10, (i + 3) % 10, (i + 7) % 10]);
    }
    w.insert(&[1, 2, 3, 4, 5, 6, 7, 8, 9]); // longer than the window: its last 7 tokens stay
    assert_eq!(w.tail(8), vec![u32::MAX, 3, 4, 5, 6, 7, 8, 9]);
    let mut g = vec![0.0; 1];
    live_probs(&w, &[], &[3, 4], &[5], &mut g);
    assert_eq!(g[0], 1.0);
    live_probs(&w, &[], &[0], &[3], &mut g);
    assert_eq!(g[0], 0.0, "evicted n-grams are gone");
    assert_eq!(w.suffix_match(&[9, 3, 4], 3, 2, 4), vec![5, 6, 7]);
    assert_eq!(w.suffix_lookup(&[9, 3, 4], 3, 2, 4), (2, vec![5, 6, 7]), "the document's start ends the match");
    assert_eq!(w.suffix_lookup(&[9, 3, 4], 0, 2, 4), (0, vec![]));
    w.clear();
    assert!(w.is_empty());
    assert!(w.suffix_match(&[3, 4], 3, 2, 4).is_empty());
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    assert!(matches!(Window::new(3, 10), Err(Error::Param { name: "capacity", .. })));
    assert!(matches!(Window::new(10, 0), Err(Error::Param { name: "vocab_size", .. })));
    let layer = LiveLayer::new(16, 10).unwrap();
    layer.insert(&[1, 2, 3]).unwrap();
    let e = layer.insert(&[1, 10, 2]).unwrap_err();
    assert_eq!(e, Error::TokenOutOfVocab { position: 1, token: 10, vocab: 10 });
    assert_eq!(layer.snapshot().tail(16), vec![1, 2, 3]);
}

#[test]
fn readers_see_whole_inserts_while_a_writer_runs() {
    let layer = Arc::new(LiveLayer::new(1 << 12, 100).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (layer, stop) = (layer.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut seen = 0;
                while seen < 1000 || !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let s = layer.snapshot();
                    // every document is [7, 8, 9, i]: a snapshot never holds half of one
                    assert_eq!(s.inserted() % 4, 0);
                    if s.inserted() > 0 {
                        assert_eq!(s.suffix_match(&[7, 8], 1, 2, 2), vec![9]);
                    }
                    seen += 1;
                }
                seen
            })
        })
        .collect();
    for i in 0..2000u32 {
        layer.insert(&[7, 8, 9, i % 100]).unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
    let s = layer.snapshot(); // held across two writes: the writer copies instead of waiting
    assert_eq!(s.inserted(), 8000);
    layer.clear();
    assert!(layer.snapshot().is_empty());
    layer.insert(&[1, 2]).unwrap();
    layer.insert(&[3, 4]).unwrap();
    assert_eq!(layer.snapshot().inserted(), 4);
    assert_eq!(s.inserted(), 8000, "a snapshot never changes");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    /// A window plus the deltas of other windows reads as one window over all their documents.
    #[test]
    fn shared_deltas_add_their_counts(own in docs_strategy(), others in prop::collection::vec(docs_strategy(), 1..3),
                                      ctx in prop::collection::vec(0u32..6, 0..3), weight in 0.0f64..1.0, uni in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Window::new(1 << 12, 6).unwrap();
        let mut union = Window::new(1 << 12, 6).unwrap();
        for d in &own { w.insert(d); union.insert(d); }
        let mut deltas = Vec::new();
        for (i, docs) in others.iter().enumerate() {
            let mut o = Window::new(1 << 12, 6).unwrap();
            for d in docs { o.insert(d); union.insert(d); }
            let p = dir.path().join(format!("{i}.delta"));
            write_delta(&o, &p, "{}").unwrap();
            deltas.push(Arc::new(open_delta(&p, 6).unwrap()));
        }
        let cands: Vec<u32> = (0..6).collect();
        let (mut got, mut want) = (vec![0.0; 6], vec![0.0; 6]);
        live_probs(&w, &deltas, &ctx, &cands, &mut got);
        live_probs(&union, &[], &ctx, &cands, &mut want);
        for i in 0..6 {
            prop_assert!((got[i] - want[i]).abs() < 1e-12, "g({i}|{ctx:?}) {} vs {}", got[i], want[i]);
        }
        let base = Window::new(64, 6).unwrap();
        let m = Mixed { base: &Static(&base), live: &w, shared: &deltas, weight, unigram_backoff: uni };
        let u = Mixed { base: &Static(&base), live: &union, shared: &[], weight, unigram_backoff: uni };
        m.cond_probs(&ctx, &cands, uni, &mut got);
        u.cond_probs(&ctx, &cands, uni, &mut want);
        for i in 0..6 {
            prop_assert!((got[i] - want[i]).abs() < 1e-12);
        }
        if let Some(&b) = ctx.last() {
            let mut back = vec![0.0; 6];
            m.cond_probs(&[b], &cands, uni, &mut back);
            let bound = m.backoff_bound(b, uni);
            prop_assert!(back.iter().all(|&g| g <= bound + 1e-12));
        }
    }
}

#[test]
fn a_delta_holds_the_window_documents() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = Window::new(7, 10).unwrap();
    w.insert(&[1, 2, 3, 4]);
    w.insert(&[5, 6, 7]); // 1 is evicted: the window holds [2 3 4] | [5 6 7]
    assert_eq!(w.documents().collect::<Vec<_>>(), vec![vec![2, 3, 4], vec![5, 6, 7]]);
    let p = dir.path().join("x.delta");
    write_delta(&w, &p, "{}").unwrap();
    let d = open_delta(&p, 10).unwrap();
    assert_eq!(d.header().tokens, 6);
    assert_eq!(d.count(&[2, 3], 4), (1, 1));
    assert_eq!(d.count(&[1], 2), (0, 0));
    assert!(matches!(open_delta(&p, 11), Err(dart_ngram::Error::Merge(_))));
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 9]).unwrap();
    assert!(matches!(open_delta(&p, 10), Err(dart_ngram::Error::Format(_))));
    std::fs::write(&p, b"not an index at all").unwrap();
    assert!(matches!(open_delta(&p, 10), Err(dart_ngram::Error::Format(_))));
    let layer = LiveLayer::new(16, 10).unwrap();
    assert!(layer.set_shared(vec![Arc::new(d)]).is_ok());
    assert_eq!(layer.shared().len(), 1);
}

/// The latest occurrence of the longest recurring 2..=max_match suffix, then its depth, by
/// brute force over every start.
fn brute_context(ctx: &[i64], min_match: usize, max_match: usize, measure: usize) -> Option<(usize, usize)> {
    let n_ctx = ctx.len();
    for n in (min_match.max(1)..=max_match).rev() {
        if n >= n_ctx {
            continue;
        }
        let latest = (0..n_ctx - n).filter(|&i| ctx[i..i + n] == ctx[n_ctx - n..]).max();
        if let Some(i) = latest {
            let start = i + n;
            let depth =
                (0..start.min(measure).max(n)).take_while(|&k| ctx[start - 1 - k] == ctx[n_ctx - 1 - k]).count();
            return Some((depth.max(n), start));
        }
    }
    None
}

proptest! {
    #[test]
    fn context_match_equals_brute_force(ctx in prop::collection::vec(0i64..4, 0..60), min_match in 1usize..4, extra in 0usize..4, measure in 0usize..40) {
        let max_match = min_match + extra;
        prop_assert_eq!(crate::context_match(&ctx, min_match, max_match, measure), brute_context(&ctx, min_match, max_match, measure));
    }
}

#[test]
fn context_match_measures_how_deep_the_repeat_goes() {
    // the last four tokens (2 3 4 5) recur at 2..6, and the repeat is five deep (7 != 9 before it)
    let ctx = [7, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5];
    assert_eq!(crate::context_match(&ctx, 2, 4, 30), Some((5, 6)));
    assert_eq!(crate::context_match(&ctx, 2, 4, 3), Some((4, 6)), "at least the suffix found");
    assert_eq!(crate::context_match(&[1, 2, 3], 2, 4, 30), None);
    assert_eq!(crate::context_match(&[], 2, 4, 30), None);
    assert_eq!(crate::context_match(&[5, 5, 5], 2, 4, 30), Some((2, 2)), "an overlapping occurrence");
}

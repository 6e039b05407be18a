//! Build → open → query round trips against a brute-force reference (plain maps over the
//! documents), plus bad-input behaviour.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;

use dart_ngram::{BuildOptions, Builder, Children, Error, Index};
use proptest::prelude::*;

/// The reference: plain counts over the documents, pruned like the builder documents it.
struct Reference {
    vocab: u32,
    tokens: u64,
    uni: BTreeMap<u32, u64>,
    /// count(a,b) and total(a,b) (pre-pruning)
    bi: BTreeMap<(u32, u32), u64>,
    tot1: BTreeMap<u32, u64>,
    tri: BTreeMap<(u32, u32, u32), u64>,
    tot2: BTreeMap<(u32, u32), u64>,
}

impl Reference {
    fn new(docs: &[Vec<u32>], vocab: u32, min_count: u64, cap: Option<usize>) -> Self {
        let mut r = Reference {
            vocab,
            tokens: 0,
            uni: BTreeMap::new(),
            bi: BTreeMap::new(),
            tot1: BTreeMap::new(),
            tri: BTreeMap::new(),
            tot2: BTreeMap::new(),
        };
        for d in docs {
            for i in 0..d.len() {
                r.tokens += 1;
                *r.uni.entry(d[i]).or_default() += 1;
                if i + 1 < d.len() {
                    *r.bi.entry((d[i], d[i + 1])).or_default() += 1;
                    *r.tot1.entry(d[i]).or_default() += 1;
                }
                if i + 2 < d.len() {
                    *r.tri.entry((d[i], d[i + 1], d[i + 2])).or_default() += 1;
                    *r.tot2.entry((d[i], d[i + 1])).or_default() += 1;
                }
            }
        }
        // pruning: min_count on bigram and trigram nodes, then caps (bigram cap drops subtrees)
        r.bi.retain(|_, c| *c >= min_count);
        r.tri.retain(|_, c| *c >= min_count);
        let bi = r.bi.clone();
        r.tri.retain(|&(a, b, _), _| bi.contains_key(&(a, b)));
        if let Some(cap) = cap {
            let mut by_ctx: HashMap<(u32, u32), Vec<(u32, u64)>> = HashMap::new();
            for (&(a, b, c), &n) in &r.tri {
                by_ctx.entry((a, b)).or_default().push((c, n));
            }
            for ((a, b), mut v) in by_ctx {
                v.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
                for &(c, _) in v.iter().skip(cap) {
                    r.tri.remove(&(a, b, c));
                }
            }
            let mut by_a: HashMap<u32, Vec<(u32, u64)>> = HashMap::new();
            for (&(a, b), &n) in &r.bi {
                by_a.entry(a).or_default().push((b, n));
            }
            for (a, mut v) in by_a {
                v.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
                for &(b, _) in v.iter().skip(cap) {
                    r.bi.remove(&(a, b));
                    let gone: Vec<_> = r.tri.range((a, b, 0)..=(a, b, u32::MAX)).map(|(k, _)| *k).collect();
                    for k in gone {
                        r.tri.remove(&k);
                    }
                }
            }
        }
        r
    }

    /// children list (count desc, token asc) of a context of length 0..=2, if any
    fn kids(&self, ctx: &[u32]) -> Vec<(u32, u64)> {
        let mut v: Vec<(u32, u64)> = match ctx.len() {
            0 => self.uni.iter().map(|(&t, &c)| (t, c)).collect(),
            1 => self.bi.range((ctx[0], 0)..=(ctx[0], u32::MAX)).map(|(k, &c)| (k.1, c)).collect(),
            _ => self.tri.range((ctx[0], ctx[1], 0)..=(ctx[0], ctx[1], u32::MAX)).map(|(k, &c)| (k.2, c)).collect(),
        };
        v.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
        v
    }
    fn total(&self, ctx: &[u32]) -> u64 {
        match ctx.len() {
            0 => self.tokens,
            1 => self.tot1.get(&ctx[0]).copied().unwrap_or(0),
            _ => self.tot2.get(&(ctx[0], ctx[1])).copied().unwrap_or(0),
        }
    }
    fn children(&self, ctx: &[u32], k: usize) -> (Vec<(u32, u64)>, u8, u64) {
        let n = ctx.len();
        for (len, order) in [(2usize, 3u8), (1, 2)] {
            if n >= len {
                let c = &ctx[n - len..];
                let v = self.kids(c);
                if !v.is_empty() {
                    return (v.into_iter().take(k).collect(), order, self.total(c));
                }
            }
        }
        let v = self.kids(&[]);
        (v.into_iter().take(k).collect(), if self.tokens > 0 { 1 } else { 0 }, self.tokens)
    }
    fn prob(&self, ctx: &[u32], v: u32, uni: bool) -> f64 {
        let n = ctx.len();
        for len in [2usize, 1] {
            if n >= len {
                let c = &ctx[n - len..];
                let cnt = match len {
                    2 => self.tri.get(&(c[0], c[1], v)).copied().unwrap_or(0),
                    _ => self.bi.get(&(c[0], v)).copied().unwrap_or(0),
                };
                if cnt > 0 && self.total(c) > 0 {
                    return cnt as f64 / self.total(c) as f64;
                }
            }
        }
        if (uni || n == 0) && self.tokens > 0 {
            return self.uni.get(&v).copied().unwrap_or(0) as f64 / self.tokens as f64;
        }
        0.0
    }
}

fn build(docs: &[Vec<u32>], opts: BuildOptions, spill: bool) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.idx");
    let mut opts = opts;
    if spill {
        opts.memory_limit_bytes = 1 << 20; // 64 Ki keys per run
    }
    let mut b = Builder::new(opts).unwrap();
    let refs: Vec<&[u32]> = docs.iter().map(|d| d.as_slice()).collect();
    // mix the single and batch entry points
    let (x, y) = refs.split_at(refs.len() / 2);
    for d in x {
        b.add_document(d).unwrap();
    }
    b.add_documents(y).unwrap();
    b.finish(&out, r#"{"test":true}"#).unwrap();
    std::fs::read(&out).unwrap()
}

fn check(ix: &Index<Vec<u8>>, r: &Reference) {
    ix.verify().unwrap();
    let v = r.vocab;
    let mut ch = Children::new();
    let mut contexts: Vec<Vec<u32>> = vec![vec![]];
    for a in 0..v {
        contexts.push(vec![a]);
        for b in 0..v {
            contexts.push(vec![a, b]);
        }
    }
    let cands: Vec<u32> = (0..v).collect();
    let mut out = vec![0.0; cands.len()];
    for c in &contexts {
        for k in [1usize, 3, 25, 33, 1000] {
            let m = ix.children(c, k, &mut ch).unwrap();
            let (want, order, total) = r.children(c, k);
            let got: Vec<(u32, u64)> = ch.tokens().iter().copied().zip(ch.counts().iter().copied()).collect();
            assert_eq!(got, want, "children of {c:?}, k={k}");
            assert_eq!((m.order, m.total), (order, total), "order/total of {c:?}");
        }
        for uni in [false, true] {
            ix.cond_probs(c, &cands, uni, &mut out);
            for (&t, &p) in cands.iter().zip(&out) {
                let want = r.prob(c, t, uni);
                assert!((p - want).abs() < 1e-12, "g({t}|{c:?}) = {p}, want {want}");
                assert_eq!(ix.prob(c, t, uni), p);
            }
        }
        if c.len() <= 2 {
            for t in 0..v {
                let (cnt, tot) = ix.count(c, t);
                let want_cnt = match c.len() {
                    0 => r.uni.get(&t).copied().unwrap_or(0),
                    1 => r.bi.get(&(c[0], t)).copied().unwrap_or(0),
                    _ => r.tri.get(&(c[0], c[1], t)).copied().unwrap_or(0),
                };
                assert_eq!(cnt, want_cnt, "count({c:?}, {t})");
                if cnt > 0 {
                    assert_eq!(tot, r.total(c));
                }
            }
        }
    }
}

fn zipf_docs(seed: u64, n_docs: usize, len: usize, vocab: u32) -> Vec<Vec<u32>> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..n_docs)
        .map(|_| {
            let l = (next() % len as u64) as usize;
            (0..l)
                .map(|_| {
                    // skewed: min of two uniforms, squared-ish
                    let x = (next() % vocab as u64) as u32;
                    let y = (next() % vocab as u64) as u32;
                    x.min(y) * (x.min(y)) / vocab.max(1)
                })
                .collect()
        })
        .collect()
}

#[test]
fn roundtrip_fixed_with_escapes_and_large_contexts() {
    // vocab 48, tokens forced to 21 bits -> 11-bit counts: escapes from 2047 on.
    let vocab = 48;
    let mut docs = zipf_docs(7, 300, 400, vocab);
    docs.push(vec![0; 5000]); // huge counts for (0,0,0): escapes at every level
    let r = Reference::new(&docs, vocab, 1, None);
    for spill in [false, true] {
        let opts = BuildOptions { vocab_size: vocab, token_bits: Some(21), ..Default::default() };
        let bytes = build(&docs, opts, spill);
        let ix = Index::from_bytes(bytes).unwrap();
        assert!(ix.header().n_esc2 > 0 && ix.header().n_esc3 > 0, "escapes exercised");
        assert!(ix.header().n_large1 > 0 && ix.header().n_large2 > 0, "top-k tables exercised");
        assert_eq!(ix.metadata_json(), r#"{"test":true}"#);
        check(&ix, &r);
    }
}

#[test]
fn pruning_min_count_and_cap() {
    let vocab = 40;
    let docs = zipf_docs(11, 200, 200, vocab);
    for (min_count, cap) in [(2u64, None), (1, Some(3usize)), (3, Some(5))] {
        let r = Reference::new(&docs, vocab, min_count, cap);
        let opts = BuildOptions {
            vocab_size: vocab,
            min_count,
            max_children_per_context: cap.map(|c| c as u32),
            ..Default::default()
        };
        let ix = Index::from_bytes(build(&docs, opts, false)).unwrap();
        check(&ix, &r);
    }
}

#[test]
fn deterministic_bytes_across_spills_and_threads() {
    let vocab = 64;
    let docs = zipf_docs(3, 400, 600, vocab);
    let a = build(&docs, BuildOptions { vocab_size: vocab, threads: Some(1), ..Default::default() }, false);
    let b = build(&docs, BuildOptions { vocab_size: vocab, threads: Some(3), ..Default::default() }, true);
    assert!(a == b, "bytes differ between thread counts / spilling");
}

#[test]
fn sharded_map_reduce_equals_single_build() {
    let vocab = 50;
    let docs = zipf_docs(5, 300, 300, vocab);
    let dir = tempfile::tempdir().unwrap();
    let opts = BuildOptions { vocab_size: vocab, memory_limit_bytes: 1 << 20, ..Default::default() };
    let mut runs = Vec::new();
    for shard in docs.chunks(100) {
        let mut b = Builder::new(opts.clone()).unwrap();
        for d in shard {
            b.add_document(d).unwrap();
        }
        runs.extend(b.write_runs(&dir.path().join("runs")).unwrap());
    }
    let out = dir.path().join("merged.idx");
    let s = dart_ngram::merge_runs(&runs, &out, &opts, r#"{"test":true}"#).unwrap();
    assert_eq!(s.documents, docs.len() as u64);
    let merged = std::fs::read(&out).unwrap();
    let single = build(&docs, opts.clone(), false);
    assert!(merged == single, "sharded build differs from the single build");
    // a corrupted run is a typed error, and nothing is written
    let mut bytes = std::fs::read(&runs[0]).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0x40;
    std::fs::write(&runs[0], &bytes).unwrap();
    let out2 = dir.path().join("bad.idx");
    assert!(matches!(dart_ngram::merge_runs(&runs, &out2, &opts, "{}"), Err(Error::Run { .. })));
    assert!(!out2.exists());
}

#[test]
fn partitioned_reduce_equals_single_build() {
    // Partitions by first-token range (including empty ones and a cut inside the data),
    // merged per range into sorted runs, then those runs merged: the same bytes as the
    // single build, and the same documents.
    let vocab = 50;
    let docs = zipf_docs(7, 300, 300, vocab);
    let dir = tempfile::tempdir().unwrap();
    let opts = BuildOptions { vocab_size: vocab, memory_limit_bytes: 1 << 20, ..Default::default() };
    let mut runs = Vec::new();
    for shard in docs.chunks(70) {
        let mut b = Builder::new(opts.clone()).unwrap();
        for d in shard {
            b.add_document(d).unwrap();
        }
        runs.extend(b.write_runs(&dir.path().join("runs")).unwrap());
    }
    let single = build(&docs, opts.clone(), false);
    for cuts in [vec![], vec![1u64], vec![3, 9, 20, 21, 49], vec![60]] {
        let mut bounds = vec![0u64];
        bounds.extend(cuts.iter().map(|a| a << 42));
        bounds.push(u64::MAX);
        let mut parts = Vec::new();
        for (i, w) in bounds.windows(2).enumerate() {
            let p = dir.path().join(format!("part-{i}.dartrun"));
            let s = dart_ngram::merge_run_range(&runs, &p, &opts, w[0], w[1]).unwrap();
            assert_eq!(s.documents, if i == 0 { docs.len() as u64 } else { 0 });
            parts.push(p);
        }
        let out = dir.path().join("parts.idx");
        let s = dart_ngram::merge_runs(&parts, &out, &opts, r#"{"test":true}"#).unwrap();
        assert_eq!(s.documents, docs.len() as u64);
        assert!(std::fs::read(&out).unwrap() == single, "partitioned reduce {cuts:?} differs from the single build");
        for p in parts {
            std::fs::remove_file(p).unwrap();
        }
    }
    let p = dir.path().join("bad.dartrun");
    assert!(matches!(dart_ngram::merge_run_range(&runs, &p, &opts, 5, 5), Err(Error::Run { .. })));
    assert!(matches!(dart_ngram::merge_run_range(&runs, &runs[0], &opts, 0, u64::MAX), Err(Error::Run { .. })));
}

#[test]
fn empty_corpus_is_a_valid_empty_index() {
    let ix = Index::from_bytes(build(&[], BuildOptions { vocab_size: 10, ..Default::default() }, false)).unwrap();
    ix.verify().unwrap();
    let mut ch = Children::new();
    let m = ix.children(&[1, 2], 5, &mut ch).unwrap();
    assert_eq!((m.order, m.total, ch.len()), (0, 0, 0));
    assert_eq!(ix.prob(&[1], 2, true), 0.0);
    let ix = Index::from_bytes(build(&[vec![], vec![]], BuildOptions { vocab_size: 10, ..Default::default() }, false))
        .unwrap();
    assert_eq!(ix.header().documents, 2);
}

#[test]
fn bad_tokens_are_typed_errors() {
    let mut b = Builder::new(BuildOptions { vocab_size: 10, ..Default::default() }).unwrap();
    assert!(matches!(b.add_document(&[1, 2, 10]), Err(Error::TokenOutOfRange { token: 10, vocab_size: 10 })));
    b.add_document(&[1, 2, 3]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("i.idx");
    b.finish(&out, "{}").unwrap();
    let ix = Index::open(&out).unwrap();
    assert_eq!(ix.header().tokens, 3, "the rejected document was not counted");
    let mut ch = Children::new();
    assert!(matches!(ix.children(&[11], 3, &mut ch), Err(Error::TokenOutOfRange { .. })));
    assert_eq!(ix.prob(&[1], 99, true), 0.0);
    assert!(matches!(Index::open(dir.path().join("missing.idx")), Err(Error::NotFound { .. })));
    assert!(Builder::new(BuildOptions { vocab_size: 0, ..Default::default() }).is_err());
}

#[test]
fn batch_matches_single() {
    let vocab = 30;
    let docs = zipf_docs(9, 200, 300, vocab);
    let ix = Index::from_bytes(build(&docs, BuildOptions { vocab_size: vocab, ..Default::default() }, false)).unwrap();
    let ctxs: Vec<[u32; 2]> = (0..100).map(|i| [i % vocab, (i * 7) % vocab]).collect();
    let pool = dart_ngram::pool::get();
    let b = ix.children_batch(&ctxs, 5, &pool).unwrap();
    let mut ch = Children::new();
    for (i, c) in ctxs.iter().enumerate() {
        let m = ix.children(c, 5, &mut ch).unwrap();
        assert_eq!(b.totals[i], m.total);
        assert_eq!(b.orders[i], m.order);
        let row = &b.tokens[i * 5..i * 5 + 5];
        assert_eq!(&row[..ch.len()], ch.tokens());
        assert!(row[ch.len()..].iter().all(|&t| t == u32::MAX));
        assert_eq!(&b.counts[i * 5..i * 5 + ch.len()], ch.counts());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    #[test]
    fn prop_roundtrip(docs in prop::collection::vec(prop::collection::vec(0u32..12, 0..40), 0..30),
                      min_count in 1u64..3, cap in prop::option::of(1usize..4), spill in any::<bool>()) {
        let r = Reference::new(&docs, 12, min_count, cap);
        let opts = BuildOptions { vocab_size: 12, min_count, max_children_per_context: cap.map(|c| c as u32),
                                  token_bits: Some(21), ..Default::default() };
        let ix = Index::from_bytes(build(&docs, opts, spill)).unwrap();
        check(&ix, &r);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    /// Random mutations of a valid file never panic: open fails with a Format error, or open
    /// succeeds and every query returns (verify() reports a Format error for real damage).
    #[test]
    fn prop_mutations_never_panic(seed in any::<u64>(), flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..6),
                                  cut in prop::option::of(any::<usize>())) {
        let docs = zipf_docs(seed % 5, 30, 60, 20);
        let mut bytes = build(&docs, BuildOptions { vocab_size: 20, token_bits: Some(21), ..Default::default() }, false);
        let n = bytes.len();
        for (pos, x) in flips {
            // bias half the flips into the header and section table
            let p = if pos % 2 == 0 { pos % 800.min(n) } else { pos % n };
            bytes[p] ^= x | 1;
        }
        if let Some(c) = cut { bytes.truncate(c % (n + 1)); }
        match Index::from_bytes(bytes) {
            Err(Error::Format(_)) => {}
            Err(e) => panic!("unexpected error kind {e}"),
            Ok(ix) => {
                let _ = ix.verify();
                let mut ch = Children::new();
                let cands: Vec<u32> = (0..25).collect();
                let mut out = vec![0.0; 25];
                for a in 0..20 { for b in 0..20 {
                    let _ = ix.children(&[a, b], 40, &mut ch);
                    let _ = ix.children(&[a, b], 5, &mut ch);
                    ix.cond_probs(&[a, b], &cands, true, &mut out);
                    let _ = ix.count(&[a, b], 3);
                }}
            }
        }
    }
}

#[test]
fn wide_delta_blocks() {
    // One 64-context block whose trigram span exceeds u16: (0,1,*), (0,2,*), (0,3,*) with
    // 30,000 children each, so the delta of (0,3) is 60,000 and of (0,4) 90,000.
    let vocab = 30_000u32;
    let mut docs: Vec<Vec<u32>> = Vec::new();
    for b in 1..=4u32 {
        for c in 0..vocab {
            docs.push(vec![0, b, c]);
        }
    }
    docs.push(vec![0, 5, 7, 7]);
    let r = Reference::new(&docs, vocab, 1, None);
    let ix = Index::from_bytes(build(&docs, BuildOptions { vocab_size: vocab, ..Default::default() }, false)).unwrap();
    assert!(ix.header().n_wide >= 1, "a wide block was written");
    ix.verify().unwrap();
    let mut ch = Children::new();
    for ctx in [[0u32, 1], [0, 2], [0, 3], [0, 4], [0, 5], [5, 7], [7, 7]] {
        for k in [3usize, 40] {
            let m = ix.children(&ctx, k, &mut ch).unwrap();
            let (want, order, total) = r.children(&ctx, k);
            let got: Vec<(u32, u64)> = ch.tokens().iter().copied().zip(ch.counts().iter().copied()).collect();
            assert_eq!((got, m.order, m.total), (want, order, total), "{ctx:?}");
        }
        for t in [0u32, 7, 29_999] {
            assert!((ix.prob(&ctx, t, true) - r.prob(&ctx, t, true)).abs() < 1e-15);
        }
    }
}

#[test]
fn outputs_that_cannot_be_written_are_refused_before_work() {
    let vocab = 20;
    let dir = tempfile::tempdir().unwrap();
    let opts = BuildOptions { vocab_size: vocab, memory_limit_bytes: 1 << 20, ..Default::default() };
    let mut b = Builder::new(opts.clone()).unwrap();
    b.add_document(&[1, 2, 3, 4]).unwrap();
    let runs = b.write_runs(&dir.path().join("runs")).unwrap();
    let before = std::fs::read(&runs[0]).unwrap();
    // the output is one of the merged runs: refused, the run untouched
    let e = dart_ngram::merge_runs(&runs, &runs[0], &opts, "{}").unwrap_err();
    assert!(matches!(&e, Error::InvalidOption(m) if m.contains("one of the inputs")), "{e}");
    assert_eq!(std::fs::read(&runs[0]).unwrap(), before);
    // a directory, a missing directory
    let e = dart_ngram::merge_runs(&runs, dir.path(), &opts, "{}").unwrap_err();
    assert!(e.to_string().contains("is a directory"), "{e}");
    let e = dart_ngram::merge_runs(&runs, &dir.path().join("no/x.idx"), &opts, "{}").unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
    // thread counts above the pool's cap
    let e = Builder::new(BuildOptions { threads: Some(1_000_000), ..opts.clone() }).err().unwrap();
    assert!(e.to_string().contains("threads must be in 1..=4096"), "{e}");
}

#[test]
fn stale_temp_files_are_swept_and_live_ones_kept() {
    use std::os::unix::io::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join(".dart-ngram-sections-dead");
    std::fs::create_dir(&dead).unwrap();
    std::fs::write(dead.join(".lock"), b"").unwrap();
    let live = dir.path().join(".dart-ngram-sections-live");
    std::fs::create_dir(&live).unwrap();
    let held = File::create(live.join(".lock")).unwrap();
    // SAFETY: flock on an open descriptor owned by `held`.
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let mut b = Builder::new(BuildOptions { vocab_size: 10, ..Default::default() }).unwrap();
    b.add_document(&[1, 2, 3]).unwrap();
    b.finish(&dir.path().join("x.idx"), "{}").unwrap();
    assert!(!dead.exists(), "a dead builder's sections dir is removed");
    assert!(live.exists(), "a live builder's sections dir is kept");
    drop(held);
}

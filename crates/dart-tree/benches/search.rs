//! Criterion benchmark of the Eq. (10) search (d = 8, k = 25, w = 20, θ = 59), one thread.
//!
//! Index: set `DART_BENCH_INDEX=/path/to.idx` to use a real index (tools/bench_tree.py
//! builds one from the Python standard library and /usr/share/doc with the SmolLM2
//! tokenizer and prints its path). Without it, a synthetic Markov corpus (3 M tokens, V =
//! 49,152, Zipf successors) is built into a temp dir — say so when quoting numbers.
//! Drafter rows: synthetic, peaked at level 0 and flatter with depth (see `rows`).
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use dart_ngram::{BuildOptions, Builder, Index, Mmap};
use dart_tree::{beam_search, beam_search_batch, top_b, SearchParams, TopkRows};

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

const V: u32 = 49_152;

fn synthetic_index(dir: &std::path::Path) -> Index<Mmap> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let table: Vec<u32> = (0..4096).map(|_| rng.below(V as u64) as u32).collect();
    let mut doc = Vec::with_capacity(3_000_000);
    let mut prev = 0u32;
    for _ in 0..3_000_000 {
        // Zipf-ish rank via inverse power, shifted by a context-specific offset.
        let rank = ((1.0 / (rng.unit() + 1e-9)).powf(0.9) as u64).min(V as u64 - 1) as u32;
        let t = (rank + table[(prev % 4096) as usize]) % V;
        doc.push(t);
        prev = t;
    }
    let path = dir.join("bench.idx");
    let mut b =
        Builder::new(BuildOptions { vocab_size: V, temp_dir: Some(dir.to_path_buf()), ..BuildOptions::default() })
            .unwrap();
    b.add_document(&doc).unwrap();
    b.finish(&path, "{}").unwrap();
    Index::open(&path).unwrap()
}

/// Rows of plausible candidates: each row holds the index's top children of a random
/// context (so lookups hit real data) topped up with random ids; log-probs are a softmax
/// over logits -α_l·ln(rank+1) with α from 3.0 (peaked) at level 0 to 1.2 (flat) at level 7.
fn rows(index: &Index<Mmap>, rng: &mut Rng, d: usize, k: usize) -> (Vec<u32>, Vec<f32>) {
    let mut toks = Vec::with_capacity(d * k);
    let mut lps = Vec::with_capacity(d * k);
    let mut ch = dart_ngram::Children::new();
    let mut ctx = [rng.below(V as u64) as u32, rng.below(V as u64) as u32];
    for l in 0..d {
        index.children(&ctx, k, &mut ch).unwrap();
        let mut row: Vec<u32> = ch.tokens().to_vec();
        while row.len() < k {
            let t = rng.below(V as u64) as u32;
            if !row.contains(&t) {
                row.push(t);
            }
        }
        let alpha = 3.0 - 1.8 * l as f64 / (d.max(2) - 1) as f64;
        let logits: Vec<f64> = (0..k).map(|r| -alpha * ((r + 1) as f64).ln()).collect();
        let z = logits.iter().map(|x| x.exp()).sum::<f64>().ln();
        lps.extend(logits.iter().map(|x| (x - z) as f32));
        ctx = [ctx[1], row[0]];
        toks.extend(row);
    }
    (toks, lps)
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let index = match std::env::var("DART_BENCH_INDEX") {
        Ok(p) => Index::open(p).unwrap(),
        Err(_) => synthetic_index(dir.path()),
    };
    let (d, k) = (8, 25);
    let mut rng = Rng(42);
    type Input = (Vec<u32>, (Vec<u32>, Vec<f32>));
    let inputs: Vec<Input> = (0..64)
        .map(|_| {
            let ctx = vec![
                rng.below(V.min(index.vocab_size()) as u64) as u32,
                rng.below(V.min(index.vocab_size()) as u64) as u32,
            ];
            (ctx, rows(&index, &mut rng, d, k))
        })
        .map(|(c, (t, l))| (c, (t.into_iter().map(|x| x % index.vocab_size()).collect(), l)))
        .collect();
    let p = SearchParams::default();
    let mut i = 0;
    c.bench_function("eq10_d8_k25_w20_theta59", |b| {
        b.iter(|| {
            let (ctx, (t, l)) = &inputs[i % inputs.len()];
            i += 1;
            black_box(beam_search(&index, ctx, TopkRows::new(t, l, d, k), &p).unwrap())
        })
    });
    let nong = SearchParams { ngram_weight: 0.0, ..p.clone() };
    c.bench_function("eq10_no_ngram_d8_k25_w20_theta59", |b| {
        b.iter(|| {
            let (ctx, (t, l)) = &inputs[i % inputs.len()];
            i += 1;
            black_box(beam_search(&index, ctx, TopkRows::new(t, l, d, k), &nong).unwrap())
        })
    });
    let ctxs: Vec<&[u32]> = inputs[..8].iter().map(|x| x.0.as_slice()).collect();
    let bt: Vec<u32> = inputs[..8].iter().flat_map(|x| x.1 .0.clone()).collect();
    let bl: Vec<f32> = inputs[..8].iter().flat_map(|x| x.1 .1.clone()).collect();
    c.bench_function("eq10_batch8_pool", |b| {
        b.iter(|| black_box(beam_search_batch(&index, &ctxs, TopkRows::new(&bt, &bl, d, k), &p).unwrap()))
    });
    // DARTree deferred top-B: 8 depths x 12 kept x 64 candidates supertree, B = 64.
    let n = 8 * 12 * 64;
    let parents: Vec<i64> =
        (0..n).map(|i| if i < 64 { -1 } else { (rng.below((i.min(n / 2)) as u64)) as i64 }).collect();
    let mut scores = vec![0.0f64; n];
    for i in 0..n {
        let base = if parents[i] < 0 { 0.0 } else { scores[parents[i] as usize] };
        scores[i] = base + (rng.unit() + 1e-9).ln() - 0.2;
    }
    c.bench_function("top_b_6144_to_64", |b| b.iter(|| black_box(top_b(&parents, &scores, 64).unwrap())));
}

criterion_group!(benches, bench);
criterion_main!(benches);

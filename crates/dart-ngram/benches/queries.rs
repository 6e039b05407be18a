//! Criterion benches of the query paths on a synthetic Zipf-like index (~2 M tokens;
//! tools/bench_index.py measures the ≥ 50 M-node figures). `cargo bench -p dart-ngram`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use dart_ngram::{BuildOptions, Builder, Children, Index};

const V: u32 = 151_669;

fn corpus(tokens: usize) -> Vec<Vec<u32>> {
    // token = (z_i + H[z_{i-1} mod 1024]) mod V, z ~ a heavy-tailed draw (as tools/bench_index.py)
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let table: Vec<u64> = (0..1024).map(|_| next() % (V as u64 - 1)).collect();
    let zipf = |u: u64| -> u64 {
        let x = (u >> 11) as f64 / (1u64 << 53) as f64;
        ((1.0 - x).powf(-1.0 / 0.3) - 1.0).min(1e12) as u64
    };
    let mut docs = Vec::new();
    let mut made = 0;
    let mut prev = zipf(next());
    while made < tokens {
        let len = 200 + (next() % 3800) as usize;
        let mut d = Vec::with_capacity(len + 1);
        for _ in 0..len {
            let z = zipf(next());
            d.push(((z % (V as u64 - 1) + table[(prev % 1024) as usize]) % (V as u64 - 1)) as u32);
            prev = z;
        }
        d.push(V - 1);
        made += d.len();
        docs.push(d);
    }
    docs
}

fn bench(c: &mut Criterion) {
    let docs = corpus(2_000_000);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bench.idx");
    let mut b = Builder::new(BuildOptions { vocab_size: V, ..Default::default() }).unwrap();
    let refs: Vec<&[u32]> = docs.iter().map(|d| d.as_slice()).collect();
    b.add_documents(&refs).unwrap();
    b.finish(&out, "{}").unwrap();
    let ix = Index::open(&out).unwrap();
    let all: Vec<u32> = docs.concat();
    let ctx: Vec<[u32; 2]> = (0..4096)
        .map(|i| {
            let p = (i * 7919) % (all.len() - 2);
            [all[p], all[p + 1]]
        })
        .collect();
    let mut cands: Vec<u32> = all[..2000].to_vec();
    cands.sort_unstable();
    cands.dedup();
    cands.truncate(25);
    let mut ch = Children::with_capacity(25);
    let mut i = 0;
    c.bench_function("children_top25", |bn| {
        bn.iter(|| {
            i = (i + 1) % ctx.len();
            black_box(ix.children(&ctx[i], 25, &mut ch).unwrap());
        })
    });
    let mut outp = vec![0.0; cands.len()];
    c.bench_function("cond_probs_25", |bn| {
        bn.iter(|| {
            i = (i + 1) % ctx.len();
            ix.cond_probs(&ctx[i], &cands, true, &mut outp);
            black_box(&outp);
        })
    });
    let pool = dart_ngram::pool::get();
    c.bench_function("children_batch_141", |bn| {
        bn.iter(|| black_box(ix.children_batch(&ctx[..141], 25, &pool).unwrap()))
    });
    c.bench_function("open", |bn| bn.iter(|| black_box(Index::open(&out).unwrap())));
}

criterion_group!(benches, bench);
criterion_main!(benches);

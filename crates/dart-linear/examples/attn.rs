//! SmolLM2-135M's attention (9 query heads, 3 kv heads, head size 64) over 30 layers' caches
//! for a block of 1..8 rows after L cached positions: the median of `REPEATS` passes of the
//! 30 layers, in µs, on the instruction set `DARTCORE_LINEAR_ISA` picks; then a checksum of the
//! outputs' bits (tree masks and causal blocks), which a change of the arithmetic's order moves.
//!
//!     [DARTCORE_LINEAR_ISA=avx2] cargo run --release -p dart-linear --example attn [threads] [repeats]

use dart_linear::ops::{block_attention, Heads};
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let threads = args.first().copied().unwrap_or(2);
    let repeats = args.get(1).copied().unwrap_or(41);
    let hd = Heads { heads: 9, kv_heads: 3, head_dim: 64 };
    let (layers, capacity, d) = (30, 1024, hd.head_dim);
    let width = (hd.heads + 2 * hd.kv_heads) * d;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let cache_len = hd.kv_heads * capacity * d;
    let mut k: Vec<Vec<f32>> = (0..layers).map(|_| (0..cache_len).map(|_| next()).collect()).collect();
    let mut v: Vec<Vec<f32>> = (0..layers).map(|_| (0..cache_len).map(|_| next()).collect()).collect();
    let qkv: Vec<f32> = (0..8 * width).map(|_| next() * 4.0).collect();
    let cos: Vec<f32> = (0..8 * d).map(|_| next()).collect();
    let sin: Vec<f32> = (0..8 * d).map(|_| next()).collect();
    // a chain's ancestor mask (row i sees rows 0..=i), and a tree: 0 <- 1 <- 2, 0 <- 3, 1 <- 4 ...
    let tree = |n: usize| -> Vec<u8> {
        let parent = |i: usize| if i == 0 { usize::MAX } else { (i - 1) / 2 };
        let mut m = vec![0u8; n * n];
        for i in 0..n {
            let mut a = i;
            while a != usize::MAX {
                m[i * n + a] = 1;
                a = parent(a);
            }
        }
        m
    };
    let mut out = vec![0f32; 8 * hd.heads * d];
    let isa = dart_linear::isa().map_or("portable", |i| i.name());
    println!("{isa}, threads {threads}, median of {repeats} passes of 30 layers, µs");
    for prefix in [40usize, 150, 400] {
        let mut line = format!("L {prefix:>4}:");
        for n in [1usize, 2, 3, 4, 6, 8] {
            let m = tree(n);
            let mut times: Vec<f64> = (0..repeats + 2)
                .map(|_| {
                    let t = Instant::now();
                    for l in 0..layers {
                        block_attention(
                            &qkv[..n * width],
                            n,
                            hd,
                            None,
                            &cos[..n * d],
                            &sin[..n * d],
                            &mut k[l],
                            &mut v[l],
                            prefix,
                            Some(&m),
                            0.125,
                            &mut out[..n * hd.heads * d],
                            threads,
                        )
                        .unwrap();
                    }
                    t.elapsed().as_secs_f64() * 1e6
                })
                .skip(2)
                .collect();
            times.sort_by(f64::total_cmp);
            line += &format!(" {n}:{:.0}", times[times.len() / 2]);
        }
        println!("{line}");
    }
    // checksum of the outputs' bits over prefixes, row counts, masks and thread counts
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for prefix in [0usize, 1, 15, 16, 17, 40, 150, 401] {
        for n in 1..=8 {
            for masked in [false, true] {
                for t in [1, 2] {
                    let m = tree(n);
                    let o = &mut out[..n * hd.heads * d];
                    block_attention(
                        &qkv[..n * width],
                        n,
                        hd,
                        None,
                        &cos[..n * d],
                        &sin[..n * d],
                        &mut k[0],
                        &mut v[0],
                        prefix,
                        masked.then_some(&m[..]),
                        0.125,
                        o,
                        t,
                    )
                    .unwrap();
                    for x in o.iter() {
                        h = (h ^ x.to_bits() as u64).wrapping_mul(0x100_0000_01b3);
                    }
                }
            }
        }
    }
    println!("checksum {h:016x}");
}

//! The integer path's products of a whole SmolLM2-135M layer stack (30 layers of q|k|v, o,
//! gate|up and down as Q4_1, each its own allocation) run one after another, against one
//! weight of the same bytes in a single call: how much of a forward's time is the products'
//! own stream and how much the calls' seams.
//!
//!     cargo run --release -p dart-linear --example layer_seq [threads] [repeats] [rows ...]

use dart_linear::int8::{interleave, linear_on, Kernel};
use dart_linear::quant::Format;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let threads = args.first().copied().unwrap_or(2);
    let repeats = args.get(1).copied().unwrap_or(30);
    let counts = if args.len() > 2 { args[2..].to_vec() } else { vec![1, 2, 3, 4, 6] };
    let f = Format::Q4_1;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut make = |n: usize, k: usize| {
        let mut file: Vec<u8> = (0..n * f.row_bytes(k).unwrap()).map(|_| next() as u8).collect();
        for block in file.chunks_exact_mut(f.block_bytes()) {
            block[..2].copy_from_slice(&0x1c00u16.to_le_bytes());
            block[2..4].copy_from_slice(&0x1c00u16.to_le_bytes());
        }
        (interleave(f, &file, n, k).unwrap(), n, k)
    };
    let shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)];
    let layers: Vec<_> = (0..30)
        .flat_map(|_| shapes.iter().map(|&(n, k)| (n, k)).collect::<Vec<_>>())
        .map(|(n, k)| make(n, k))
        .collect();
    let total: usize = layers.iter().map(|(w, _, _)| w.len()).sum();
    // the same weights side by side in one allocation (huge pages where the kernel gives them)
    let huge = std::env::var("HUGE").is_ok();
    let joined: &mut [u8] = unsafe {
        let size = total.next_multiple_of(2 << 20);
        let ptr = std::alloc::alloc(std::alloc::Layout::from_size_align(size, 2 << 20).unwrap());
        if huge {
            extern "C" {
                fn madvise(addr: *mut u8, len: usize, advice: i32) -> i32;
            }
            println!("madvise: {}", madvise(ptr, size, 14));
        }
        std::slice::from_raw_parts_mut(ptr, size)
    };
    let mut spans = Vec::new();
    let mut at = 0;
    for (w, n, k) in &layers {
        spans.push((at, w.len(), *n, *k));
        joined[at..at + w.len()].copy_from_slice(w);
        at += w.len();
    }
    let big_n = (total / f.row_bytes(576).unwrap()).next_multiple_of(16);
    let big = make(big_n, 576);
    let x: Vec<f32> = (0..16 * 3072).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let mut out = vec![0f32; 16 * big_n.max(3072)];
    let kernel = Kernel::supported_here().into_iter().find(|k| k.name() == "vnni").unwrap_or(Kernel::Avx2);
    println!("{} MB in {} weights, {threads} threads, kernel {}", total >> 20, layers.len(), kernel.name());
    for &rows in &counts {
        let mut seq: Vec<f64> = Vec::new();
        let mut one: Vec<f64> = Vec::new();
        let mut packed: Vec<f64> = Vec::new();
        for _ in 0..repeats {
            let s = Instant::now();
            for &(at, len, n, k) in &spans {
                linear_on(
                    kernel,
                    f,
                    &x[..rows * k],
                    rows,
                    k,
                    &joined[at..at + len],
                    n,
                    None,
                    &mut out[..rows * n],
                    threads,
                )
                .unwrap();
            }
            packed.push(s.elapsed().as_secs_f64() * 1e3);
            let s = Instant::now();
            for (w, n, k) in &layers {
                linear_on(kernel, f, &x[..rows * k], rows, *k, w, *n, None, &mut out[..rows * n], threads).unwrap();
            }
            seq.push(s.elapsed().as_secs_f64() * 1e3);
            let s = Instant::now();
            linear_on(kernel, f, &x[..rows * 576], rows, 576, &big.0, big_n, None, &mut out[..rows * big_n], threads)
                .unwrap();
            one.push(s.elapsed().as_secs_f64() * 1e3);
        }
        seq.sort_by(f64::total_cmp);
        one.sort_by(f64::total_cmp);
        packed.sort_by(f64::total_cmp);
        println!(
            "rows {rows}: 120 calls {:.3} ms, 120 calls in one allocation {:.3} ms, one call {:.3} ms",
            seq[seq.len() / 2],
            packed[packed.len() / 2],
            one[one.len() / 2]
        );
    }
}

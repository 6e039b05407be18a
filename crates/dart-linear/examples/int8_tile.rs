//! The integer path's kernel alone on one L2-sized weight (3072 x 576 Q4_1 by default), one
//! thread: ns per row-block at 1..16 rows, to see the per-row cost without the memory stream.
//!
//!     [DART_LINEAR_FORMAT=q4_0|q8_0] cargo run --release -p dart-linear --example int8_tile [threads] [repeats] [n] [k] [rows ...]

use dart_linear::int8::{interleave, linear_on, Kernel};
use dart_linear::quant::Format;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let threads = args.first().copied().unwrap_or(1);
    let repeats = args.get(1).copied().unwrap_or(50);
    let n = args.get(2).copied().unwrap_or(3072);
    let k = args.get(3).copied().unwrap_or(576);
    let f = match std::env::var("DART_LINEAR_FORMAT").as_deref() {
        Ok("q4_0") => Format::Q4_0,
        Ok("q8_0") => Format::Q8_0,
        _ => Format::Q4_1,
    };
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut file: Vec<u8> = (0..n * f.row_bytes(k).unwrap()).map(|_| next() as u8).collect();
    for block in file.chunks_exact_mut(f.block_bytes()) {
        block[..2].copy_from_slice(&0x1c00u16.to_le_bytes());
        block[2..4].copy_from_slice(&0x1c00u16.to_le_bytes());
    }
    let w = interleave(f, &file, n, k).unwrap();
    let x: Vec<f32> = (0..16 * k).map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5).collect();
    let mut out = vec![0f32; 16 * n];
    for kernel in Kernel::supported_here() {
        let mut line = format!("{}: {} {n}x{k}, {threads} threads, us:", kernel.name(), f.name());
        let counts = if args.len() > 4 { args[4..].to_vec() } else { vec![1, 2, 3, 4, 5, 6, 7, 8, 12, 16] };
        for &rows in counts.iter().filter(|&&r| (1..=16).contains(&r)) {
            let mut t: Vec<f64> = (0..repeats)
                .map(|_| {
                    let s = Instant::now();
                    linear_on(kernel, f, &x[..rows * k], rows, k, &w, n, None, &mut out[..rows * n], threads).unwrap();
                    s.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            t.sort_by(f64::total_cmp);
            line += &format!(" {rows}:{:.0}", t[t.len() / 4]);
        }
        println!("{line}");
    }
}

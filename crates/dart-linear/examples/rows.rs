//! SmolLM2-135M's decoding products (30 layers' fused q|k|v, o, gate|up, down, and the LM
//! head: 134 M weights, streamed from memory) at 1..16 rows, per instruction set this CPU runs:
//! the median of `REPEATS` passes, in ms. Weights f32, or a GGML block format named by the
//! environment's `DART_LINEAR_FORMAT` (q4_0, q4_1, q8_0: random blocks), on the exact path
//! (`Weights::Packed`) or, with `DART_LINEAR_NUMERICS=int8`, on the integer path
//! (`Weights::Int8`), then per integer kernel this CPU runs.
//!
//!     [DART_LINEAR_FORMAT=q4_1 [DART_LINEAR_NUMERICS=int8]] cargo run --release -p dart-linear --example rows [threads] [repeats] [rows ...]

use dart_linear::quant::Format;
use dart_linear::{int8, linear_on, Isa, Weights};
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let threads = args.first().copied().unwrap_or(1);
    let repeats = args.get(1).copied().unwrap_or(7);
    let counts: Vec<usize> = if args.len() > 2 {
        args[2..].iter().copied().filter(|&r| (1..=16).contains(&r)).collect()
    } else {
        vec![1, 2, 3, 4, 5, 6, 8, 12, 16]
    };
    let (h, i, v) = (576, 1536, 49152);
    let mut shapes: Vec<(usize, usize)> = (0..30).flat_map(|_| [(960, h), (h, h), (2 * i, h), (h, i)]).collect();
    shapes.push((v, h));
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04
    };
    let format = std::env::var("DART_LINEAR_FORMAT").ok().and_then(|f| Format::from_name(&f));
    let int8 = format.is_some() && std::env::var("DART_LINEAR_NUMERICS").is_ok_and(|v| v == "int8");
    let weights: Vec<Vec<f32>> = if format.is_none() {
        shapes.iter().map(|&(n, k)| (0..n * k).map(|_| next()).collect()).collect()
    } else {
        Vec::new()
    };
    // block rows: random bytes, every block's fp16 scales (and Q4_1 offset) set to 2^-8
    let blocks: Vec<Vec<u8>> = match format {
        Some(f) => shapes
            .iter()
            .map(|&(n, k)| {
                let mut b: Vec<u8> = (0..n * f.row_bytes(k).unwrap()).map(|_| (next() * 6000.0) as i32 as u8).collect();
                let scales = if f == Format::Q4_1 { 4 } else { 2 };
                for block in b.chunks_exact_mut(f.block_bytes()) {
                    for s in block[..scales].chunks_exact_mut(2) {
                        s.copy_from_slice(&0x1c00u16.to_le_bytes());
                    }
                }
                if int8 {
                    dart_linear::int8::interleave(f, &b, n, k).unwrap()
                } else {
                    dart_linear::quant::pack_vec(f, &b, n, k).unwrap()
                }
            })
            .collect(),
        None => Vec::new(),
    };
    let x: Vec<f32> = (0..16 * i).map(|_| next()).collect();
    let mut out = vec![0f32; 16 * v];
    println!(
        "threads {threads}, {}{}, median of {repeats} passes, ms",
        format.map_or("f32", Format::name),
        if int8 { " int8" } else { "" }
    );
    // the instruction sets, then (integer path) each kernel on its own
    let runs: Vec<(Isa, Option<int8::Kernel>)> = Isa::supported_here()
        .into_iter()
        .map(|isa| (isa, None))
        .chain(int8::Kernel::supported_here().into_iter().filter(|_| int8).map(|k| (Isa::Avx2, Some(k))))
        .collect();
    for (isa, kernel) in runs {
        let name = kernel.map_or_else(|| isa.name().to_string(), |k| format!("int8 {}", k.name()));
        let mut line = format!("{name:>12}:");
        for &rows in &counts {
            let mut times: Vec<f64> = (0..repeats + 1)
                .map(|_| {
                    let t = Instant::now();
                    for (j, &(n, k)) in shapes.iter().enumerate() {
                        let w = match format {
                            Some(f) if int8 => Weights::Int8(f, &blocks[j]),
                            Some(f) => Weights::Packed(f, &blocks[j]),
                            None => Weights::F32(&weights[j]),
                        };
                        let (x, out) = (&x[..rows * k], &mut out[..rows * n]);
                        match (kernel, format) {
                            (Some(kernel), Some(f)) => {
                                int8::linear_on(kernel, f, x, rows, k, &blocks[j], n, None, out, threads)
                            }
                            _ => linear_on(isa, x, rows, k, w, n, None, out, threads),
                        }
                        .unwrap();
                    }
                    t.elapsed().as_secs_f64() * 1e3
                })
                .skip(1)
                .collect();
            times.sort_by(f64::total_cmp);
            line += &format!(" {rows} rows {:.1}", times[times.len() / 2]);
        }
        println!("{line}");
    }
}

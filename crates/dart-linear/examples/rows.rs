//! SmolLM2-135M's decoding products (30 layers' fused q|k|v, o, gate|up, down, and the LM
//! head: 134 M weights, streamed from memory) at 1..16 rows, per instruction set this CPU runs:
//! the median of `REPEATS` passes, in ms. Weights f32, or a GGML block format named by the
//! environment's `DART_LINEAR_FORMAT` (q4_0, q4_1, q8_0: random blocks), on the exact path
//! (`Weights::Packed`) or, with `DART_LINEAR_NUMERICS=int8`, on the integer path
//! (`Weights::Int8`), then per integer kernel this CPU runs. With `DART_LINEAR_HUGE=1` the
//! block rows lie side by side in one allocation advised for transparent huge pages (Linux
//! `MADV_HUGEPAGE`), as `share_huge_pages` places a loaded target's; else each weight is an
//! allocation of its own on 4 KB pages.
//!
//!     [DART_LINEAR_FORMAT=q4_1 [DART_LINEAR_NUMERICS=int8] [DART_LINEAR_HUGE=1]] cargo run --release -p dart-linear --example rows [threads] [repeats] [rows ...]

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
    let huge = std::env::var("DART_LINEAR_HUGE").is_ok_and(|v| v == "1");
    let arena = if huge { huge_page_copy(&blocks) } else { Vec::new() };
    let blocks: Vec<&[u8]> = if huge { arena_views(&arena, &blocks) } else { blocks.iter().map(|b| &b[..]).collect() };
    let x: Vec<f32> = (0..16 * i).map(|_| next()).collect();
    let mut out = vec![0f32; 16 * v];
    println!(
        "threads {threads}, {}{}{}, median of {repeats} passes, ms",
        format.map_or("f32", Format::name),
        if int8 { " int8" } else { "" },
        if huge { ", huge pages" } else { "" }
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
                            Some(f) if int8 => Weights::Int8(f, blocks[j]),
                            Some(f) => Weights::Packed(f, blocks[j]),
                            None => Weights::F32(&weights[j]),
                        };
                        let (x, out) = (&x[..rows * k], &mut out[..rows * n]);
                        match (kernel, format) {
                            (Some(kernel), Some(f)) => {
                                int8::linear_on(kernel, f, x, rows, k, blocks[j], n, None, out, threads)
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

/// Bytes of a transparent huge page (x86-64's PMD size).
const HUGE_PAGE: usize = 2 << 20;

/// One buffer holding every weight's bytes side by side from a huge-page boundary on, advised
/// `MADV_HUGEPAGE` before its pages are first written (the buffer starts with `HUGE_PAGE`
/// bytes of slack for the alignment; see [`arena_views`]).
fn huge_page_copy(blocks: &[Vec<u8>]) -> Vec<u8> {
    let total: usize = blocks.iter().map(Vec::len).sum();
    let mut arena = vec![0u8; total + 2 * HUGE_PAGE];
    let start = arena.as_ptr().align_offset(HUGE_PAGE);
    extern "C" {
        fn madvise(addr: *mut u8, len: usize, advice: i32) -> i32;
    }
    const MADV_HUGEPAGE: i32 = 14;
    // SAFETY: the range lies inside `arena` (start + a whole number of huge pages <= its
    // length); madvise only changes how the kernel backs those pages.
    let advised = unsafe { madvise(arena.as_mut_ptr().add(start), total.next_multiple_of(HUGE_PAGE), MADV_HUGEPAGE) };
    if advised != 0 {
        eprintln!("madvise(MADV_HUGEPAGE) refused: the weights stay on small pages");
    }
    let mut at = start;
    for b in blocks {
        arena[at..at + b.len()].copy_from_slice(b);
        at += b.len();
    }
    arena
}

/// Each weight's bytes in the buffer [`huge_page_copy`] filled.
fn arena_views<'a>(arena: &'a [u8], blocks: &[Vec<u8>]) -> Vec<&'a [u8]> {
    let mut at = arena.as_ptr().align_offset(HUGE_PAGE);
    blocks
        .iter()
        .map(|b| {
            let view = &arena[at..at + b.len()];
            at += b.len();
            view
        })
        .collect()
}

//! The integer path for GGML block weights: `y[m, n] ≈ x[m, :] · w[n, :]` with the rows of `x`
//! quantised to int8 in 32-value blocks ([`quantize_rows`]) and every block product an integer
//! dot product, as llama.cpp feeds its Q4 / Q8 kernels. Not the products of the dequantised f32
//! weight (that is [`crate::linear`] on [`crate::Weights::Packed`], bit for bit): a second,
//! named numerics whose every output is still one fixed computation:
//!
//! * `x` row, block `b` (32 values): `amax` = the largest `|x_i|`, `d_x = amax / 127`, `q_i =
//!   round_ties_even(x_i · (127 / amax))` clamped to ±127 (all 0 where `amax` is 0), `s_x = Σ
//!   q_i`, and `ds_x = d_x · s_x` (f32).
//! * weight row `j`, block `b`: the integer `p = Σ w_i q_i` over the block's integer weights
//!   (`nibble − 8` for Q4_0, `nibble` for Q4_1, the int8 for Q8_0), exact in i32;
//! * `acc = fma(d_w · d_x, f32(p), acc)` and for Q4_1 `acc = fma(m_w, ds_x, acc)`, block after
//!   block along `k` from `acc = 0`; then `y = acc + bias`.
//!
//! [`reference`] is that definition in plain loops; the SIMD kernels compute the integer `p`
//! their own way (exact whatever the way) and then the same f32 operations in the same order,
//! so they equal it bit for bit, whatever the number of rows and however the threads split the
//! weight rows (tests).
//!
//! Why a layout of its own ([`interleave`], made once at load, the same number of bytes as the
//! file's blocks plus the padding of the last group): the weight rows are interleaved in groups
//! of [`GROUP`] = 8, four bytes at a time, so that one 32-byte vector holds four consecutive
//! weights of eight rows and a `vpdpbusd` (or `maddubs` + `madd`) against the broadcast four
//! bytes of `x` leaves each row's partial sum in its own i32 lane. A block's integer sum then
//! needs no horizontal reduction (with the file's row-major blocks each block of each row
//! needs one: ~2.5 extra instructions per block and row of `x`), the conversion and the scale
//! are one instruction per eight weight rows, and a group's unpacked vectors serve every row of
//! `x`. Per group and block: the eight `d` (then, Q4_1, the eight `m`) as fp16, then the
//! quants: Q4 as four vectors whose byte `4r + j` of vector `c` is byte `4c + j` of row `r`'s
//! block (low nibble: weight `4c + j`, high nibble: weight `16 + 4c + j`), Q8_0 as eight
//! vectors whose byte `4r + j` of vector `c` is weight `4c + j` of row `r` plus 128 (so that it
//! is an unsigned byte for `vpdpbusd`; the `128 · s_x` it adds is subtracted as an integer).
//!
//! Instruction sets ([`Kernel`]): AMX-INT8 from eight rows of `x` (the block's B tile, sixteen
//! weight rows x 32 weights as signed bytes, unpacked from two groups' records through an
//! aligned buffer; one `tdpbssd` against the A tile of every row's 32 quantised values leaves
//! all the rows' integer sums of the block in the C tile, which is stored and scaled per row
//! as below), else and for fewer rows AVX-512 VNNI with VL, two groups at a time in 512-bit
//! vectors (low half group `g`'s 256-bit vector, high half group `g + 1`'s: one `vpdpbusd`
//! and one f32 step per sixteen weight rows and row of `x`, the instruction count that bounds
//! the cost of each extra row; a lone last group on 256-bit vectors; a lane's operations are
//! the same either way), else AVX-VNNI (the VEX-encoded 256-bit `vpdpbusd` of CPUs without
//! AVX-512: the AVX2 kernel's passes, one group per vector and four rows of `x` per pass in
//! sixteen registers, with one `vpdpbusd` for each `maddubs` + `madd`), else AVX2 (`maddubs` +
//! `madd`; Q8_0 through `sign` / `abs`, since an unsigned byte up to 255 times 127 would
//! saturate `maddubs`' 16-bit pairs). The rows of `x`
//! are quantised once per call, in AVX2 vectors where the CPU has them. AMX needs the Linux
//! kernel's permission for the tile state, asked once per process (without it the AMX kernel
//! is not used), and runs only where [`KERNEL_ENV`] names it ([`kernel`] says why); the same
//! variable picks a slower kernel for tests and measures.

use crate::quant::{f16_to_f32, Format, BLOCK_WEIGHTS};
use crate::{OutPart, ShapeError, Team, MAX_ROWS};

/// Weight rows interleaved per group (the i32 lanes of a 256-bit vector).
pub const GROUP: usize = 8;

/// A kernel of the integer path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AMX-INT8 tiles (`tdpbssd`: a block's integer sums for every row of `x` at once) from
    /// eight rows of `x`, fewer on the VNNI kernel; with VNNI's prerequisites and AVX-512BW.
    Amx,
    /// AVX-512 VNNI + VL (`vpdpbusd` on 512-bit vectors, two groups each), with AVX2 + FMA +
    /// F16C.
    Vnni,
    /// AVX-VNNI (the VEX-encoded 256-bit `vpdpbusd`, one group per vector), with AVX2 + FMA +
    /// F16C: CPUs with the instruction but without AVX-512.
    AvxVnni,
    /// AVX2 + FMA + F16C (`maddubs` + `madd`).
    Avx2,
}

/// The environment variable that picks the integer path's kernel (read once, at first use):
/// `amx`, `vnni`, `avxvnni` or `avx2` where the CPU runs it and [`crate::isa`] allows it;
/// unset or anything else: the fastest allowed ([`kernel`]). Turns AMX on, and tests and
/// measures a slower kernel on a faster machine.
pub const KERNEL_ENV: &str = "DARTCORE_INT8_KERNEL";

impl Kernel {
    /// Every kernel, fastest first.
    pub const ALL: [Kernel; 4] = [Kernel::Amx, Kernel::Vnni, Kernel::AvxVnni, Kernel::Avx2];

    /// `"amx"`, `"vnni"`, `"avxvnni"` or `"avx2"`.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Amx => "amx",
            Kernel::Vnni => "vnni",
            Kernel::AvxVnni => "avxvnni",
            Kernel::Avx2 => "avx2",
        }
    }

    /// Whether this CPU runs it (AMX: and Linux lets this process use the tiles).
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            let vnni = avx2 && has!("avx512vnni") && has!("avx512vl");
            match self {
                Kernel::Amx => vnni && has!("avx512bw") && amx_permitted(),
                Kernel::Vnni => vnni,
                Kernel::AvxVnni => avx2 && has!("avxvnni"),
                Kernel::Avx2 => avx2,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// The kernels this CPU runs, fastest first (tests run each).
    pub fn supported_here() -> Vec<Kernel> {
        Kernel::ALL.into_iter().filter(|k| k.supported()).collect()
    }

    /// The kernels an instruction set of the f32 kernels allows: all on AVX-512, the 256-bit
    /// ones (AVX-VNNI, AVX2) on AVX2, so that forcing [`crate::ISA_ENV`] to `avx2` on an
    /// AVX-512 machine runs what a CPU without AVX-512 runs.
    pub fn allowed(isa: crate::Isa) -> &'static [Kernel] {
        match isa {
            crate::Isa::Avx512 => &Kernel::ALL,
            crate::Isa::Avx2 => &[Kernel::AvxVnni, Kernel::Avx2],
        }
    }
}

/// Whether the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25) and Linux
/// grants this process the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`: without it the first tile instruction faults). Asked once per
/// process; the permission holds for all its threads and is inherited by a forked child.
#[cfg(target_arch = "x86_64")]
fn amx_permitted() -> bool {
    static PERMITTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PERMITTED.get_or_init(|| {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        if __cpuid(0).eax < 7 || __cpuid_count(7, 0).edx & (3 << 24) != 3 << 24 {
            return false;
        }
        #[cfg(target_os = "linux")]
        {
            const SYS_ARCH_PRCTL: i64 = 158;
            const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
            const XFEATURE_XTILEDATA: i64 = 18;
            let ret: i64;
            // SAFETY: the arch_prctl system call with two integer arguments; it reads and
            // writes no memory of this process (the kernel clobbers rcx and r11).
            unsafe {
                std::arch::asm!(
                    "syscall",
                    inlateout("rax") SYS_ARCH_PRCTL => ret,
                    in("rdi") ARCH_REQ_XCOMP_PERM,
                    in("rsi") XFEATURE_XTILEDATA,
                    lateout("rcx") _,
                    lateout("r11") _,
                    options(nostack),
                )
            };
            ret == 0
        }
        #[cfg(not(target_os = "linux"))]
        {
            false
        }
    })
}

/// The kernel the integer path uses: none where the f32 kernels are off ([`crate::isa`] None);
/// else, among the kernels [`crate::isa`] allows ([`Kernel::allowed`]), the one [`KERNEL_ENV`]
/// names where the CPU runs it, else VNNI, else AVX-VNNI, else AVX2. AMX runs only when named:
/// in a whole forward it measured no faster than VNNI on the 2-vCPU Xeon it was built on
/// (`tools/bench_int8.py --int8-kernel`), and the tile permission it asks for enlarges every
/// signal frame of the process, so the default never asks for it.
pub fn kernel() -> Option<Kernel> {
    static CHOSEN: std::sync::OnceLock<Option<Kernel>> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let allowed = Kernel::allowed(crate::isa()?);
        let want = std::env::var(KERNEL_ENV).unwrap_or_default().trim().to_ascii_lowercase();
        let runs = |k: &&Kernel| k.supported();
        let named = allowed.iter().filter(|k| k.name() == want).find(runs);
        named.or_else(|| allowed.iter().filter(|&&k| k != Kernel::Amx).find(runs)).copied()
    })
}

/// Bytes of `n` rows of `k` weights in the interleaved layout ([`interleave`]): whole groups.
pub fn interleaved_bytes(format: Format, n: usize, k: usize) -> Result<usize, ShapeError> {
    let row = format.row_bytes(k)?;
    n.div_ceil(GROUP)
        .checked_mul(GROUP * row)
        .ok_or_else(|| ShapeError(format!("{}: {n} rows of {k} weights overflow", format.name())))
}

/// `n` rows of `k` weights' blocks as the file stores them (`file`) in the integer path's
/// interleaved layout (see the module docs; the last group padded with zero rows).
pub fn interleave(format: Format, file: &[u8], n: usize, k: usize) -> Result<Vec<u8>, ShapeError> {
    format.check(file.len(), n, k)?;
    let (bb, sb, nb) = (format.block_bytes(), format.scale_bytes(), k / BLOCK_WEIGHTS);
    let rec = GROUP * bb;
    let mut out = vec![0u8; interleaved_bytes(format, n, k)?];
    for (g, group) in out.chunks_exact_mut(nb * rec).enumerate() {
        for (b, r) in group.chunks_exact_mut(rec).enumerate() {
            for row in 0..GROUP.min(n - g * GROUP) {
                let src = &file[(g * GROUP + row) * nb * bb + b * bb..][..bb];
                // scales: d of the eight rows, then (Q4_1) m of the eight rows
                r[2 * row..2 * row + 2].copy_from_slice(&src[..2]);
                if sb == 4 {
                    r[16 + 2 * row..16 + 2 * row + 2].copy_from_slice(&src[2..4]);
                }
                let (quants, qs) = (&mut r[GROUP * sb..], &src[sb..]);
                for c in 0..qs.len() / 4 {
                    for j in 0..4 {
                        let byte = qs[4 * c + j];
                        quants[32 * c + 4 * row + j] = if format == Format::Q8_0 { byte ^ 0x80 } else { byte };
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The file's block rows back from the interleaved layout (`n` rows: the padding dropped).
pub fn deinterleave(format: Format, bytes: &[u8], n: usize, k: usize) -> Result<Vec<u8>, ShapeError> {
    check_interleaved(format, bytes.len(), n, k)?;
    let (bb, sb, nb) = (format.block_bytes(), format.scale_bytes(), k / BLOCK_WEIGHTS);
    let rec = GROUP * bb;
    let mut file = vec![0u8; n * nb * bb];
    for (j, row) in file.chunks_exact_mut(nb * bb).enumerate() {
        let (g, r) = (j / GROUP, j % GROUP);
        for (b, dst) in row.chunks_exact_mut(bb).enumerate() {
            let src = &bytes[(g * nb + b) * rec..][..rec];
            dst[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            if sb == 4 {
                dst[2..4].copy_from_slice(&src[16 + 2 * r..16 + 2 * r + 2]);
            }
            let quants = &src[GROUP * sb..];
            for (i, q) in dst[sb..].iter_mut().enumerate() {
                let byte = quants[32 * (i / 4) + 4 * r + i % 4];
                *q = if format == Format::Q8_0 { byte ^ 0x80 } else { byte };
            }
        }
    }
    Ok(file)
}

/// Checks that `bytes` holds `n` interleaved rows of `k` weights.
pub fn check_interleaved(format: Format, bytes: usize, n: usize, k: usize) -> Result<(), ShapeError> {
    let want = interleaved_bytes(format, n, k)?;
    if bytes != want {
        return Err(ShapeError(format!(
            "{} (interleaved): w has {bytes} bytes, expected {} groups of {GROUP} rows x {} blocks x {} bytes = {want}",
            format.name(),
            n.div_ceil(GROUP),
            k / BLOCK_WEIGHTS,
            format.block_bytes()
        )));
    }
    Ok(())
}

/// Rows of `x` quantised per 32-value block (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct QuantRows {
    /// `[rows, k]`.
    pub q: Vec<i8>,
    /// `[rows, k / 32]` each: `d_x`, `s_x`, `d_x · s_x`, and the kernels' integer
    /// corrections `−8 · s_x`, `−128 · s_x`.
    pub d: Vec<f32>,
    pub s: Vec<i32>,
    pub ds: Vec<f32>,
    pub s8: Vec<i32>,
    pub s128: Vec<i32>,
}

/// `rows` rows of `k` values (`x`, row-major) quantised per 32-value block; `k` a whole number
/// of blocks.
pub fn quantize_rows(x: &[f32], rows: usize, k: usize) -> Result<QuantRows, ShapeError> {
    if k == 0 || !k.is_multiple_of(BLOCK_WEIGHTS) || Some(x.len()) != rows.checked_mul(k) {
        return Err(ShapeError(format!(
            "quantize_rows: x has {} elements for {rows} rows of {k} (rows must be whole 32-value blocks)",
            x.len()
        )));
    }
    let nb = rows * k / BLOCK_WEIGHTS;
    let mut out = QuantRows {
        q: vec![0; x.len()],
        d: vec![0.0; nb],
        s: vec![0; nb],
        ds: vec![0.0; nb],
        s8: vec![0; nb],
        s128: vec![0; nb],
    };
    quantize_into(x, &mut out);
    Ok(out)
}

fn quantize_into(x: &[f32], out: &mut QuantRows) {
    #[cfg(target_arch = "x86_64")]
    if Kernel::Avx2.supported() {
        // SAFETY: the CPU runs AVX2 (checked); the body is the portable one, vectorised.
        unsafe { quantize_avx2(x, out) };
        return;
    }
    quantize_portable(x, out);
}

/// [`quantize_portable`] in AVX2 vectors, a block at a time: the same IEEE operations on each
/// value, so the same bits (test), where the compiler leaves the portable body's saturating
/// float-to-int conversion scalar.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_avx2(x: &[f32], out: &mut QuantRows) {
    use std::arch::x86_64::*;
    const MAGIC: f32 = 12_582_912.0;
    for (b, (xs, qs)) in x.chunks_exact(BLOCK_WEIGHTS).zip(out.q.chunks_exact_mut(BLOCK_WEIGHTS)).enumerate() {
        // SAFETY: `xs` and `qs` hold 32 values each (the loads and the store stay inside).
        let (d, sum) = unsafe {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xs.as_ptr().add(8 * i)));
            let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
            // max(|v|, acc) keeps acc where |v| is NaN, as `f32::max` skips a NaN
            let m = v.iter().fold(_mm256_setzero_ps(), |a, &x| _mm256_max_ps(_mm256_and_ps(x, abs), a));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            let (magic, lo, hi) = (_mm256_set1_ps(MAGIC), _mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
            let q: [__m256i; 4] = std::array::from_fn(|i| {
                let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[i], id), magic), magic);
                // the clamp in floats (±inf to ±127), then NaN to 0: `as i32` then `clamp`
                let c = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
                _mm256_cvttps_epi32(_mm256_and_ps(c, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r)))
            });
            let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(qs.as_mut_ptr().cast(), bytes);
            let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b00_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b00_00_00_01>(s));
            (amax / 127.0, _mm_cvtsi128_si32(s))
        };
        out.d[b] = d;
        out.s[b] = sum;
        out.ds[b] = d * sum as f32;
        out.s8[b] = -8 * sum;
        out.s128[b] = -128 * sum;
    }
}

/// Rounds to the nearest integer, ties to even, for |v| < 2^22 (the magic-number addition:
/// vectorises without SSE4.1's `round`).
#[inline(always)]
fn round_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    (v + MAGIC) - MAGIC
}

#[inline(always)]
fn quantize_portable(x: &[f32], out: &mut QuantRows) {
    for (b, (xs, qs)) in x.chunks_exact(BLOCK_WEIGHTS).zip(out.q.chunks_exact_mut(BLOCK_WEIGHTS)).enumerate() {
        let amax = xs.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qs.iter_mut().zip(xs) {
            // (NaN converts to 0; |v · id| <= 127 up to rounding, the clamp only guards
            // non-finite input)
            let r = (round_even(v * id) as i32).clamp(-127, 127);
            *q = r as i8;
            sum += r;
        }
        out.d[b] = d;
        out.s[b] = sum;
        out.ds[b] = d * sum as f32;
        out.s8[b] = -8 * sum;
        out.s128[b] = -128 * sum;
    }
}

/// The integer path's definition in plain loops ([`reference`]'s per-output computation), from
/// the file's blocks: `out[m, j]` for `rows` rows of `x` against `n` weight rows.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    format: Format,
    x: &[f32],
    rows: usize,
    k: usize,
    file: &[u8],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    format.check(file.len(), n, k)?;
    let xq = quantize_rows(x, rows, k)?;
    check_out(rows, n, bias, out)?;
    let (bb, sb, nb) = (format.block_bytes(), format.scale_bytes(), k / BLOCK_WEIGHTS);
    for m in 0..rows {
        for j in 0..n {
            let mut acc = 0f32;
            for b in 0..nb {
                let blk = &file[(j * nb + b) * bb..][..bb];
                let dw = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]]));
                let qx = &xq.q[m * k + b * 32..][..32];
                let mut p = 0i32;
                for i in 0..32 {
                    let w = match format {
                        Format::Q8_0 => blk[2 + i] as i8 as i32,
                        _ => {
                            let byte = blk[sb + i % 16];
                            let nib = if i < 16 { byte & 0x0f } else { byte >> 4 } as i32;
                            if format == Format::Q4_0 {
                                nib - 8
                            } else {
                                nib
                            }
                        }
                    };
                    p += w * qx[i] as i32;
                }
                let xb = m * nb + b;
                acc = (dw * xq.d[xb]).mul_add(p as f32, acc);
                if format == Format::Q4_1 {
                    let mw = f16_to_f32(u16::from_le_bytes([blk[2], blk[3]]));
                    acc = mw.mul_add(xq.ds[xb], acc);
                }
            }
            out[m * n + j] = acc + bias.map_or(0.0, |b| b[j]);
        }
    }
    Ok(())
}

fn check_out(rows: usize, n: usize, bias: Option<&[f32]>, out: &[f32]) -> Result<(), ShapeError> {
    if Some(out.len()) != rows.checked_mul(n) {
        return Err(ShapeError(format!("out has {} elements, expected {rows} x {n}", out.len())));
    }
    if let Some(b) = bias.filter(|b| b.len() != n) {
        return Err(ShapeError(format!("bias has {} elements, expected {n}", b.len())));
    }
    Ok(())
}

/// `out[m, n] = x[m, :] · w[n, :] (+ bias[n])` on the integer path for `rows` (1..=
/// [`MAX_ROWS`]) rows of `x` (`[rows, k]`) and `n` weight rows in the interleaved layout
/// (`w`, [`interleave`]); the weight rows' groups are split between `threads` threads.
#[allow(clippy::too_many_arguments)]
pub fn linear(
    format: Format,
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[u8],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), ShapeError> {
    let Some(kernel) = kernel() else {
        return Err(ShapeError("the integer path needs AVX2 + FMA + F16C (or DARTCORE_LINEAR_ISA turned the kernels off): use the exact path".into()));
    };
    linear_on(kernel, format, x, rows, k, w, n, bias, out, threads)
}

/// [`linear`] with a given kernel (an error where the CPU does not run it).
#[allow(clippy::too_many_arguments)]
pub fn linear_on(
    kernel: Kernel,
    format: Format,
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[u8],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), ShapeError> {
    if rows > MAX_ROWS {
        return Err(ShapeError(format!("{rows} rows: at most {MAX_ROWS} per call")));
    }
    check_interleaved(format, w.len(), n, k)?;
    let xq = quantize_rows(x, rows, k)?;
    check_out(rows, n, bias, out)?;
    if !kernel.supported() {
        return Err(ShapeError(format!(
            "this CPU does not run the {} integer kernel: use the exact path",
            kernel.name()
        )));
    }
    linear_quantized(kernel, format, &xq, rows, k, w, n, bias, out, threads);
    Ok(())
}

/// The kernel over rows already quantised (shapes checked by the caller).
#[allow(clippy::too_many_arguments)]
fn linear_quantized(
    kernel: Kernel,
    format: Format,
    xq: &QuantRows,
    rows: usize,
    k: usize,
    w: &[u8],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) {
    if rows == 0 || n == 0 {
        return;
    }
    let groups = n.div_ceil(GROUP);
    let part = OutPart::new(out);
    let run = |g0: usize, g1: usize| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU runs `kernel` (checked by `linear_on`); `w` holds `groups` groups
        // of `k / 32` records, `xq` `rows` rows of `k`, `part` rows x n floats of which this
        // call writes the columns of groups g0..g1 only.
        unsafe {
            x86::run(kernel, format, xq, rows, k, w, n, bias, part.clone(), g0, g1)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (g0, g1, &part, kernel, format, xq, w, bias, k);
    };
    if threads <= 1 || groups == 1 {
        run(0, groups);
        return;
    }
    // whole pairs of groups per thread (the VNNI kernel pairs them)
    let per = groups.div_ceil(threads).next_multiple_of(2);
    Team::get(threads).run(&|t| {
        let (g0, g1) = (t * per, ((t + 1) * per).min(groups));
        if g0 < g1 {
            run(g0, g1);
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q8_0: u8 = 2;

    /// # Safety
    /// As at the call in `linear_quantized`.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn run(
        kernel: Kernel,
        format: Format,
        xq: &QuantRows,
        rows: usize,
        k: usize,
        w: &[u8],
        n: usize,
        bias: Option<&[f32]>,
        out: OutPart,
        g0: usize,
        g1: usize,
    ) {
        macro_rules! go {
            ($f:ident) => {
                // SAFETY: as for this function.
                match format {
                    Format::Q4_0 => unsafe { $f::<Q4_0>(xq, rows, k, w, n, bias, out, g0, g1) },
                    Format::Q4_1 => unsafe { $f::<Q4_1>(xq, rows, k, w, n, bias, out, g0, g1) },
                    Format::Q8_0 => unsafe { $f::<Q8_0>(xq, rows, k, w, n, bias, out, g0, g1) },
                }
            };
        }
        match kernel {
            Kernel::Amx if rows >= AMX_MIN_ROWS => go!(entry_amx),
            Kernel::Amx | Kernel::Vnni => go!(entry_vnni),
            Kernel::AvxVnni => go!(entry_avxvnni),
            Kernel::Avx2 => go!(entry_avx2),
        }
    }

    /// Rows of `x` from which the AMX kernel runs the tiles: its fixed cost per block (the B
    /// tile's unpacking through memory, the tile loads, the product and the C tile's store)
    /// is several rows' worth of VNNI dot products, its cost per row a third of theirs
    /// (`examples/int8_tile.rs`); fewer rows run the VNNI kernel (the same bits either way).
    const AMX_MIN_ROWS: usize = 8;

    /// Rows of `x` per pass over a group: their i32 and f32 accumulators stay in registers
    /// (32 vector registers with AVX-512VL, 16 with AVX2); a group's records are in L1 for
    /// the later passes.
    const VNNI_ROWS: usize = 8;
    const AVX2_ROWS: usize = 4;

    /// How [`pass`] multiplies the bytes: `maddubs` + `madd` (AVX2), `vpdpbusd` EVEX-encoded
    /// (AVX-512 VNNI + VL; [`groups`] pairs the groups in 512-bit vectors) or VEX-encoded
    /// (AVX-VNNI). Both `vpdpbusd` give the same exact i32 sums.
    const MADD: u8 = 0;
    const DP_EVEX: u8 = 1;
    const DP_VEX: u8 = 2;

    /// One kernel's entry: [`groups`] with its byte product and rows per pass, compiled for
    /// the instruction sets it needs.
    macro_rules! entry {
        ($(#[$doc:meta])* $name:ident, $features:literal, $dp:expr, $rows:expr) => {
            $(#[$doc])*
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn $name<const F: u8>(
                xq: &QuantRows,
                rows: usize,
                k: usize,
                w: &[u8],
                n: usize,
                bias: Option<&[f32]>,
                out: OutPart,
                g0: usize,
                g1: usize,
            ) {
                // SAFETY: the caller's contract; the features are enabled here.
                unsafe { groups::<F, $dp, $rows>(xq, rows, k, w, n, bias, out, g0, g1) }
            }
        };
    }

    entry!(entry_vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", DP_EVEX, VNNI_ROWS);
    entry!(entry_avx2, "avx2,fma,f16c", MADD, AVX2_ROWS);
    entry!(
        /// The AVX2 kernel's passes with `vpdpbusd` in place of `maddubs` + `madd` (16 vector
        /// registers: AVX2's rows per pass).
        entry_avxvnni,
        "avxvnni,avx2,fma,f16c",
        DP_VEX,
        AVX2_ROWS
    );

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn entry_amx<const F: u8>(
        xq: &QuantRows,
        rows: usize,
        k: usize,
        w: &[u8],
        n: usize,
        bias: Option<&[f32]>,
        out: OutPart,
        g0: usize,
        g1: usize,
    ) {
        macro_rules! go {
            ($($m:literal),+) => {
                match rows {
                    // SAFETY: the caller's contract; the features are enabled here and the
                    // process may use the tiles (`Kernel::Amx` supported).
                    $($m => unsafe { amx::groups::<F, $m>(xq, k, w, n, bias, out, g0, g1) },)+
                    _ => unreachable!("AMX_MIN_ROWS..=MAX_ROWS rows"),
                }
            };
        }
        go!(8, 9, 10, 11, 12, 13, 14, 15, 16)
    }

    /// Records (a group's block: eight weight rows) prefetched ahead of the products, every
    /// cache line of each. With one line of a 160-byte Q4_1 record four records ahead, the
    /// hardware prefetcher was left the rest and the memory latency showed: measured over a
    /// whole SmolLM2 forward on the 2-vCPU Xeon (weights from DRAM, 150 cached positions),
    /// 1 / 3 / 6 rows took 4.0 / 5.1 / 6.8 ms that way and 3.4 / 4.2 / 5.6 ms with every line
    /// eight to twenty-four records ahead.
    const PREFETCH_RECORDS: usize = 16;

    /// Prefetches the `rec` bytes at `p` into L1 (a prefetch never faults: `p` may lie past
    /// the weights).
    #[inline(always)]
    unsafe fn prefetch_record(p: *const u8, rec: usize) {
        let mut at = 0;
        while at < rec {
            // SAFETY: a prefetch reads nothing and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at) as *const i8) };
            at += 64;
        }
    }

    const fn block_bytes(f: u8) -> usize {
        match f {
            Q4_0 => 18,
            Q4_1 => 20,
            _ => 34,
        }
    }

    /// Groups `g0..g1` for every row of `x`, `MC` rows per pass.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn groups<const F: u8, const DP: u8, const MC: usize>(
        xq: &QuantRows,
        rows: usize,
        k: usize,
        w: &[u8],
        n: usize,
        bias: Option<&[f32]>,
        out: OutPart,
        g0: usize,
        g1: usize,
    ) {
        let nb = k / BLOCK_WEIGHTS;
        let group_bytes = nb * GROUP * block_bytes(F);
        let mut g = g0;
        while g < g1 {
            // Two groups at a time in 512-bit vectors where AVX-512 VNNI runs (one vpdpbusd and
            // one f32 step per sixteen weight rows); a lane's operations are the 256-bit
            // pass's, so the pairing changes no bit.
            let groups = if DP == DP_EVEX && g + 1 < g1 { 2 } else { 1 };
            // SAFETY: group g (and g + 1 when paired) < groups of `w` (checked by the caller).
            let gp = unsafe { w.as_ptr().add(g * group_bytes) };
            let ahead = g + groups < g1;
            let mut m0 = 0;
            while m0 < rows {
                let mc = (rows - m0).min(MC);
                let mut acc = [0f32; 2 * GROUP * VNNI_ROWS];
                macro_rules! pass {
                    ($($m:literal),+) => {
                        match (groups, mc) {
                            $((1, $m) => unsafe { pass::<F, DP, $m>(xq, m0, k, gp, ahead, &mut acc) },)+
                            $((_, $m) => unsafe { pair::pass::<F, $m>(xq, m0, k, gp, group_bytes, ahead, &mut acc) },)+
                            _ => unreachable!("1..=MC rows"),
                        }
                    };
                }
                // SAFETY: rows m0..m0 + mc of `xq`, the groups' records in `w`; the paired
                // pass only where DP_EVEX (this function's features then include AVX-512F, VL,
                // VNNI).
                if MC == 8 {
                    pass!(1, 2, 3, 4, 5, 6, 7, 8)
                } else {
                    pass!(1, 2, 3, 4)
                }
                let lanes = groups * GROUP;
                let rr = lanes.min(n - g * GROUP);
                for m in 0..mc {
                    for r in 0..rr {
                        let j = g * GROUP + r;
                        let y = acc[m * lanes + r] + bias.map_or(0.0, |b| b[j]);
                        // SAFETY: row m0 + m < rows and column j < n: inside out's rows x n.
                        unsafe { *out.ptr.add((m0 + m) * n + j) = y };
                    }
                }
                m0 += mc;
            }
            g += groups;
        }
    }

    /// One group's blocks against rows `m0..m0 + M` of `x`: each row's eight outputs into
    /// `acc[m * 8..]`. `ahead`: a next group follows in `w` (prefetched).
    #[inline(always)]
    unsafe fn pass<const F: u8, const DP: u8, const M: usize>(
        xq: &QuantRows,
        m0: usize,
        k: usize,
        gp: *const u8,
        ahead: bool,
        acc: &mut [f32],
    ) {
        let nb = k / BLOCK_WEIGHTS;
        let rec = GROUP * block_bytes(F);
        let scales = if F == Q4_1 { 32 } else { 16 };
        let vnni = DP != MADD;
        unsafe {
            let mut facc = [_mm256_setzero_ps(); M];
            let low = _mm256_set1_epi8(0x0f);
            let ones = _mm256_set1_epi16(1);
            let xp = xq.q.as_ptr().add(m0 * k);
            for b in 0..nb {
                let rp = gp.add(b * rec);
                if ahead || b + PREFETCH_RECORDS < nb {
                    // the stream ahead (into the next group at the end)
                    prefetch_record(rp.wrapping_add(PREFETCH_RECORDS * rec), rec);
                }
                let qp = rp.add(scales);
                // Each row's sums start at its integer correction, −8 · s_x for Q4_0 (nibbles
                // are w + 8), −128 · s_x for Q8_0 under vpdpbusd (bytes are w + 128): a
                // broadcast load instead of a zeroing and a subtraction later.
                let isum_start = |m: usize| {
                    let xb = (m0 + m) * nb + b;
                    match F {
                        Q4_0 => _mm256_set1_epi32(*xq.s8.get_unchecked(xb)),
                        Q8_0 if vnni => _mm256_set1_epi32(*xq.s128.get_unchecked(xb)),
                        _ => _mm256_setzero_si256(),
                    }
                };
                // Independent partial sums per row of x where few rows leave the dot products'
                // latency exposed (one row: a chain of eight dependent vpdpbusd a block); the
                // integer partials add up exactly, so the split changes no bit.
                let chains = if M == 1 {
                    4
                } else if M <= 3 {
                    2
                } else {
                    1
                };
                // AVX2 on Q4: the block's eight `maddubs` products add up in i16 lanes and
                // widen once (`madd`) at the end: a lane's pairs are at most 2 · 15 · 127, so
                // eight of them stay within i16 (30480) and the sum is exact
                let wide16 = !vnni && F != Q8_0;
                let zero = _mm256_setzero_si256();
                let mut isum: [[__m256i; 4]; M] =
                    std::array::from_fn(|m| [if wide16 { zero } else { isum_start(m) }, zero, zero, zero]);
                // `u` unsigned bytes of eight rows x four weights, against the four bytes of
                // each row of x at `off` within the block, into partial sum `ch`
                macro_rules! dot {
                    ($u:expr, $signed:expr, $off:expr, $ch:expr) => {
                        let ch = $ch % chains;
                        for m in 0..M {
                            let xv = _mm256_set1_epi32(xp.add(m * k + b * 32 + $off).cast::<i32>().read_unaligned());
                            let acc = isum[m][ch];
                            isum[m][ch] = if DP == DP_EVEX {
                                _mm256_dpbusd_epi32(acc, $u, xv)
                            } else if DP == DP_VEX {
                                _mm256_dpbusd_avx_epi32(acc, $u, xv)
                            } else if F == Q8_0 {
                                // |w| (unsigned, <= 128) against sign(x, w): the pairs stay
                                // within i16 (2 · 128 · 127)
                                let prod = _mm256_maddubs_epi16($u, _mm256_sign_epi8(xv, $signed));
                                _mm256_add_epi32(acc, _mm256_madd_epi16(prod, ones))
                            } else {
                                _mm256_add_epi16(acc, _mm256_maddubs_epi16($u, xv))
                            };
                        }
                    };
                }
                if F == Q8_0 {
                    for c in 0..8 {
                        let v = _mm256_loadu_si256(qp.add(32 * c).cast());
                        if vnni {
                            dot!(v, v, 4 * c, c);
                        } else {
                            let s = _mm256_xor_si256(v, _mm256_set1_epi8(-128));
                            dot!(_mm256_abs_epi8(s), s, 4 * c, c);
                        }
                    }
                } else {
                    for c in 0..4 {
                        let v = _mm256_loadu_si256(qp.add(32 * c).cast());
                        let lo = _mm256_and_si256(v, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                        dot!(lo, lo, 4 * c, 2 * c);
                        dot!(hi, hi, 16 + 4 * c, 2 * c + 1);
                    }
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(rp.cast()));
                let mw =
                    if F == Q4_1 { _mm256_cvtph_ps(_mm_loadu_si128(rp.add(16).cast())) } else { _mm256_setzero_ps() };
                for m in 0..M {
                    let xb = (m0 + m) * nb + b;
                    let s = _mm256_mul_ps(dw, _mm256_set1_ps(*xq.d.get_unchecked(xb)));
                    let [a0, a1, a2, a3] = isum[m];
                    let add = |a, b| if wide16 { _mm256_add_epi16(a, b) } else { _mm256_add_epi32(a, b) };
                    let mut p = match chains {
                        1 => a0,
                        2 => add(a0, a1),
                        _ => add(add(a0, a1), add(a2, a3)),
                    };
                    if wide16 {
                        p = _mm256_add_epi32(isum_start(m), _mm256_madd_epi16(p, ones));
                    }
                    facc[m] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(p), facc[m]);
                    if F == Q4_1 {
                        facc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*xq.ds.get_unchecked(xb)), facc[m]);
                    }
                }
            }
            for (m, v) in facc.iter().enumerate() {
                _mm256_storeu_ps(acc.as_mut_ptr().add(m * GROUP), *v);
            }
        }
    }

    /// The VNNI kernel on two consecutive groups at once: 512-bit vectors whose low half is
    /// group `g`'s 256-bit vector and high half group `g + 1`'s.
    mod pair {
        use super::*;

        /// Groups `g` (at `gp`) and `g + 1` (`group_bytes` further) against rows `m0..m0 + M`
        /// of `x`: each row's sixteen outputs into `acc[m * 16..]`, exactly [`super::pass`]'s
        /// per group. `ahead`: a next group follows the pair in `w` (prefetched).
        ///
        /// # Safety
        /// AVX-512F + VL + VNNI, AVX2, FMA, F16C; both groups' records in `w`, rows of `xq`.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
        #[inline]
        pub(super) unsafe fn pass<const F: u8, const M: usize>(
            xq: &QuantRows,
            m0: usize,
            k: usize,
            gp: *const u8,
            group_bytes: usize,
            ahead: bool,
            acc: &mut [f32],
        ) {
            let nb = k / BLOCK_WEIGHTS;
            let rec = GROUP * block_bytes(F);
            let scales = if F == Q4_1 { 32 } else { 16 };
            // SAFETY: as for this function; every pointer below is inside the two groups'
            // records or rows m0..m0 + M of `xq`.
            unsafe {
                let gq = gp.add(group_bytes);
                let mut facc = [_mm512_setzero_ps(); M];
                let low = _mm512_set1_epi8(0x0f);
                let xp = xq.q.as_ptr().add(m0 * k);
                // vpdpbusd: latency ~4-5 cycles, one 512-bit one a cycle: independent partial
                // sums per row where few rows leave the latency exposed (measured on the
                // 3072 x 576 tile: two chains still help at four and five rows)
                let chains = if M == 1 {
                    4
                } else if M <= 5 {
                    2
                } else {
                    1
                };
                for b in 0..nb {
                    let (rp, rq) = (gp.add(b * rec), gq.add(b * rec));
                    // both streams ahead; at the end of the pair, into the next pair's groups
                    let o = b + PREFETCH_RECORDS;
                    if o < nb {
                        prefetch_record(gp.wrapping_add(o * rec), rec);
                        prefetch_record(gq.wrapping_add(o * rec), rec);
                    } else if ahead {
                        let next = gp.wrapping_add(2 * group_bytes + (o - nb) * rec);
                        prefetch_record(next, rec);
                        prefetch_record(next.wrapping_add(group_bytes), rec);
                    }
                    let (qp, qq) = (rp.add(scales), rq.add(scales));
                    let wide = |c: usize| {
                        let lo = _mm256_loadu_si256(qp.add(32 * c).cast());
                        let hi = _mm256_loadu_si256(qq.add(32 * c).cast());
                        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                    };
                    let isum_start = |m: usize| {
                        let xb = (m0 + m) * nb + b;
                        match F {
                            Q4_0 => _mm512_set1_epi32(*xq.s8.get_unchecked(xb)),
                            Q8_0 => _mm512_set1_epi32(*xq.s128.get_unchecked(xb)),
                            _ => _mm512_setzero_si512(),
                        }
                    };
                    let zero = _mm512_setzero_si512();
                    let mut isum: [[__m512i; 4]; M] = std::array::from_fn(|m| [isum_start(m), zero, zero, zero]);
                    macro_rules! dot {
                        ($u:expr, $off:expr, $ch:expr) => {
                            let ch = $ch % chains;
                            for m in 0..M {
                                let xv =
                                    _mm512_set1_epi32(xp.add(m * k + b * 32 + $off).cast::<i32>().read_unaligned());
                                isum[m][ch] = _mm512_dpbusd_epi32(isum[m][ch], $u, xv);
                            }
                        };
                    }
                    if F == Q8_0 {
                        for c in 0..8 {
                            let v = wide(c);
                            dot!(v, 4 * c, c);
                        }
                    } else {
                        for c in 0..4 {
                            let v = wide(c);
                            let lo = _mm512_and_si512(v, low);
                            // (32-bit shifts: the bits crossing into a byte's high half are
                            // masked off)
                            let hi = _mm512_and_si512(_mm512_srli_epi32::<4>(v), low);
                            dot!(lo, 4 * c, 2 * c);
                            dot!(hi, 16 + 4 * c, 2 * c + 1);
                        }
                    }
                    let halves = |off: usize| {
                        let lo = _mm_loadu_si128(rp.add(off).cast());
                        let hi = _mm_loadu_si128(rq.add(off).cast());
                        _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi))
                    };
                    let dw = halves(0);
                    let mw = if F == Q4_1 { halves(16) } else { _mm512_setzero_ps() };
                    for m in 0..M {
                        let xb = (m0 + m) * nb + b;
                        let s = _mm512_mul_ps(dw, _mm512_set1_ps(*xq.d.get_unchecked(xb)));
                        let [a0, a1, a2, a3] = isum[m];
                        let p = match chains {
                            1 => a0,
                            2 => _mm512_add_epi32(a0, a1),
                            _ => _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                        };
                        facc[m] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(p), facc[m]);
                        if F == Q4_1 {
                            facc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*xq.ds.get_unchecked(xb)), facc[m]);
                        }
                    }
                }
                for (m, v) in facc.iter().enumerate() {
                    _mm512_storeu_ps(acc.as_mut_ptr().add(m * 2 * GROUP), *v);
                }
            }
        }
    }

    /// The AMX kernel: per pair of groups (sixteen weight rows) and block, the block's B tile
    /// (the weights as signed bytes: 8 tile rows of four weights x sixteen weight rows, as the
    /// interleaved layout already orders them) is unpacked to a buffer, and one `tdpbssd`
    /// against the A tile (the block's 32 quantised values of each row of `x`, read in place)
    /// leaves every row's sixteen integer sums in the C tile; the f32 step is the VNNI
    /// kernel's, per row. Four C tiles (and two A and B tiles) rotate between blocks so that
    /// a block's product runs while the sums of the one three blocks earlier are scaled. Each
    /// thread loads its own tile configuration per call (the configuration is per thread) and
    /// releases the tiles at the end.
    mod amx {
        use super::*;
        use std::arch::asm;

        /// `ldtilecfg`'s 64 bytes (palette 1): C tiles tmm0, tmm1, tmm6, tmm7 (`M` rows x 16
        /// i32), A tiles tmm2, tmm3 (`M` rows x 32 bytes), B tiles tmm4, tmm5 (8 rows x 64
        /// bytes).
        #[repr(C, align(64))]
        struct Config([u8; 64]);

        impl Config {
            fn new(m: usize) -> Config {
                let mut c = [0u8; 64];
                c[0] = 1;
                for (t, rows, colsb) in
                    [(0, m, 64u16), (1, m, 64), (6, m, 64), (7, m, 64), (2, m, 32), (3, m, 32), (4, 8, 64), (5, 8, 64)]
                {
                    c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
                    c[48 + t] = rows as u8;
                }
                Config(c)
            }
        }

        /// Tile-sized scratch: a B tile's 512 bytes, or a C tile's up to 16 x 64.
        #[repr(C, align(64))]
        struct Tile<const N: usize>([u8; N]);

        /// Block product into C tile `C` (tmm0, tmm1, tmm6 or tmm7) with A and B tiles `S`
        /// (tmm2 + `S`, tmm4 + `S`): B from `b` (64-byte rows), A from `a` (`M` rows, `stride`
        /// apart), C zeroed then `C += A · B`.
        #[inline(always)]
        unsafe fn product<const C: usize, const S: usize>(a: *const i8, stride: usize, b: *const u8) {
            macro_rules! tiles {
                ($c:literal, $a:literal, $b:literal) => {
                    asm!(
                        concat!("tileloadd tmm", $b, ", [{b} + {sixty_four}*1]"),
                        concat!("tileloadd tmm", $a, ", [{a} + {stride}*1]"),
                        concat!("tilezero tmm", $c),
                        concat!("tdpbssd tmm", $c, ", tmm", $a, ", tmm", $b),
                        a = in(reg) a, b = in(reg) b, stride = in(reg) stride, sixty_four = in(reg) 64usize,
                        options(nostack, preserves_flags, readonly),
                    )
                };
            }
            // SAFETY (caller): the tile configuration is loaded; `a` has the config's rows of
            // 32 bytes `stride` apart, `b` 8 rows of 64 bytes.
            unsafe {
                match (C, S) {
                    (0, 0) => tiles!("0", "2", "4"),
                    (1, 0) => tiles!("1", "2", "4"),
                    (6, 0) => tiles!("6", "2", "4"),
                    (7, 0) => tiles!("7", "2", "4"),
                    (0, _) => tiles!("0", "3", "5"),
                    (1, _) => tiles!("1", "3", "5"),
                    (6, _) => tiles!("6", "3", "5"),
                    _ => tiles!("7", "3", "5"),
                }
            }
        }

        /// C tile `C`'s rows to `c` (64 bytes apart).
        #[inline(always)]
        unsafe fn store<const C: usize>(c: *mut u8) {
            macro_rules! tile {
                ($c:literal) => {
                    asm!(
                        concat!("tilestored [{c} + {sixty_four}*1], tmm", $c),
                        c = in(reg) c, sixty_four = in(reg) 64usize,
                        options(nostack, preserves_flags),
                    )
                };
            }
            // SAFETY (caller): `c` holds the config's rows of 64 bytes.
            unsafe {
                match C {
                    0 => tile!("0"),
                    1 => tile!("1"),
                    6 => tile!("6"),
                    _ => tile!("7"),
                }
            }
        }

        /// B tiles unpacked ahead of their product: a tile load of bytes that vector stores
        /// wrote shortly before waits for them, a few blocks later it does not.
        const AHEAD: usize = 8;

        /// C tiles in rotation: a block's sums are stored and scaled `LAG - 1` steps after its
        /// product is issued (the product's latency is several steps' work).
        const LAG: usize = 4;

        /// Records prefetched ahead of the unpacking, per group (the stream from memory: each
        /// step is a few tens of nanoseconds).
        const PREFETCH: usize = 16;

        /// A call's weights as one thread streams them: groups up to `g1`, `nb` blocks of
        /// `rec` bytes per group.
        #[derive(Clone, Copy)]
        struct Stream {
            w: *const u8,
            nb: usize,
            rec: usize,
            g1: usize,
        }

        impl Stream {
            /// The step after (`g`, `b`): the next block of the pair, else the next pair's
            /// first (a cursor instead of dividing step numbers).
            #[inline(always)]
            fn next(self, (g, b): (usize, usize)) -> (usize, usize) {
                if b + 1 < self.nb {
                    (g, b + 1)
                } else {
                    (g + 2, 0)
                }
            }

            /// Group `g`'s block `b` record.
            #[inline(always)]
            unsafe fn records(self, g: usize, b: usize) -> *const u8 {
                // SAFETY (caller): g < the call's groups.
                unsafe { self.w.add((g * self.nb + b) * self.rec) }
            }

            /// Two groups' 256-bit vectors at byte `off` of block `b`'s records as one; a
            /// lone group's high half zero.
            #[inline(always)]
            unsafe fn wide(self, g: usize, pair: bool, b: usize, off: usize) -> __m512i {
                // SAFETY (caller): g (and g + 1 where `pair`) < the call's groups.
                unsafe {
                    let lo = _mm256_loadu_si256(self.records(g, b).add(off).cast());
                    if pair {
                        let hi = _mm256_loadu_si256(self.records(g + 1, b).add(off).cast());
                        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                    } else {
                        _mm512_zextsi256_si512(lo)
                    }
                }
            }

            /// The sixteen fp16 scales at byte `off` of block `b`'s records as f32 (a lone
            /// group's high half zero).
            #[inline(always)]
            unsafe fn halves(self, g: usize, pair: bool, b: usize, off: usize) -> __m512 {
                // SAFETY (caller): as for `wide`.
                unsafe {
                    let lo = _mm_loadu_si128(self.records(g, b).add(off).cast());
                    let hi = if pair {
                        _mm_loadu_si128(self.records(g + 1, b).add(off).cast())
                    } else {
                        _mm_setzero_si128()
                    };
                    _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi))
                }
            }

            /// Step (`g`, `b`)'s B tile into `buf`: tile row `c` holds weights `4c..4c + 3` of the
            /// sixteen weight rows as signed bytes (Q4_0 `nibble − 8`, Q4_1 the nibble, Q8_0
            /// the stored byte back from `+ 128`).
            #[inline(always)]
            unsafe fn unpack<const F: u8>(self, (g, b): (usize, usize), buf: *mut u8) {
                let pair = g + 1 < self.g1;
                let scales = if F == Q4_1 { 32 } else { 16 };
                // SAFETY (caller): step u's groups are the call's; `buf` holds 512 bytes,
                // 64-aligned.
                unsafe {
                    if F == Q8_0 {
                        for c in 0..8 {
                            let v = _mm512_xor_si512(self.wide(g, pair, b, scales + 32 * c), _mm512_set1_epi8(-128));
                            _mm512_store_si512(buf.add(64 * c).cast(), v);
                        }
                    } else {
                        let low = _mm512_set1_epi8(0x0f);
                        for c in 0..4 {
                            let v = self.wide(g, pair, b, scales + 32 * c);
                            let mut lo = _mm512_and_si512(v, low);
                            // (32-bit shifts: the bits crossing into a byte's high half are
                            // masked off)
                            let mut hi = _mm512_and_si512(_mm512_srli_epi32::<4>(v), low);
                            if F == Q4_0 {
                                lo = _mm512_sub_epi8(lo, _mm512_set1_epi8(8));
                                hi = _mm512_sub_epi8(hi, _mm512_set1_epi8(8));
                            }
                            _mm512_store_si512(buf.add(64 * c).cast(), lo);
                            _mm512_store_si512(buf.add(64 * (4 + c)).cast(), hi);
                        }
                    }
                }
            }
        }

        /// Step (`g`, `b`)'s f32 step from its integer sums in `c` (the VNNI pair kernel's
        /// operations, row by row into `facc`); after a pair's last block its outputs (+ bias)
        /// to `out` and `facc` back to zero.
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn scale<const F: u8, const M: usize>(
            st: Stream,
            (g, b): (usize, usize),
            c: *const u8,
            xq: &QuantRows,
            n: usize,
            bias: Option<&[f32]>,
            out: &OutPart,
            facc: &mut [__m512; M],
        ) {
            let (pair, nb) = (g + 1 < st.g1, st.nb);
            // SAFETY (caller): step u's groups are the call's, `c` holds M rows of 16 i32,
            // rows 0..M of `xq` and of `out`.
            unsafe {
                let dw = st.halves(g, pair, b, 0);
                let mw = if F == Q4_1 { st.halves(g, pair, b, 16) } else { _mm512_setzero_ps() };
                for (m, f) in facc.iter_mut().enumerate() {
                    let xb = m * nb + b;
                    let s = _mm512_mul_ps(dw, _mm512_set1_ps(*xq.d.get_unchecked(xb)));
                    let p = _mm512_load_si512(c.add(64 * m).cast());
                    *f = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(p), *f);
                    if F == Q4_1 {
                        *f = _mm512_fmadd_ps(mw, _mm512_set1_ps(*xq.ds.get_unchecked(xb)), *f);
                    }
                }
                if b + 1 == nb {
                    let rr = (2 * GROUP).min(n - g * GROUP);
                    let mut row = [0f32; 2 * GROUP];
                    for (m, f) in facc.iter_mut().enumerate() {
                        _mm512_storeu_ps(row.as_mut_ptr(), *f);
                        *f = _mm512_setzero_ps();
                        for (r, &v) in row[..rr].iter().enumerate() {
                            let j = g * GROUP + r;
                            // row m < rows and column j < n: inside out's rows x n
                            *out.ptr.add(m * n + j) = v + bias.map_or(0.0, |b| b[j]);
                        }
                    }
                }
            }
        }

        /// Groups `g0..g1` against all `M` rows of `x`, pairs of groups at a time, as one
        /// stream of (pair, block) steps: step `u`'s B tile is unpacked at step `u - AHEAD`,
        /// its product issued at step `u` and its sums scaled at step `u + LAG - 1`, each row's
        /// sixteen accumulators flushed to `out` after a pair's last block.
        ///
        /// # Safety
        /// AVX-512F + BW + VL, F16C, FMA; tile use permitted; as at the call in
        /// `linear_quantized`.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe fn groups<const F: u8, const M: usize>(
            xq: &QuantRows,
            k: usize,
            w: &[u8],
            n: usize,
            bias: Option<&[f32]>,
            out: OutPart,
            g0: usize,
            g1: usize,
        ) {
            let nb = k / BLOCK_WEIGHTS;
            let st = Stream { w: w.as_ptr(), nb, rec: GROUP * block_bytes(F), g1 };
            let steps = (g1 - g0).div_ceil(2) * nb;
            let config = Config::new(M);
            // B tiles: slot u % (2 · AHEAD) (step u + AHEAD's unpacking never writes the slot
            // step u's product reads); C tiles: one slot per C tile
            let mut ring = [const { Tile([0; 512]) }; 2 * AHEAD];
            let mut cbuf = [const { Tile([0; 1024]) }; LAG];
            let ring = ring.as_mut_ptr().cast::<u8>();
            let cs = cbuf.each_mut().map(|c| c.0.as_mut_ptr());
            let slot = |u: usize| ring.wrapping_add(512 * (u % (2 * AHEAD)));
            let mut facc = [_mm512_setzero_ps(); M];
            // SAFETY: every pointer below is inside groups g0..g1's records of `w` (a group
            // g + 1 only read where it is < g1), rows 0..M of `xq` and `out`, or the buffers
            // above.
            unsafe {
                // the tiles are this thread's until the `tilerelease` below
                asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, preserves_flags, readonly));
                // the cursors of steps u + AHEAD, u and u + 1 - LAG
                let (mut ahead, mut now, mut done) = ((g0, 0), (g0, 0), (g0, 0));
                for u in 0..AHEAD.min(steps) {
                    st.unpack::<F>(ahead, slot(u));
                    ahead = st.next(ahead);
                }
                let xp = xq.q.as_ptr();
                // step u's sums out of C tile u % LAG and scaled
                macro_rules! finish {
                    ($u:expr, $at:expr) => {
                        let c = cs[$u % LAG];
                        match $u % LAG {
                            0 => store::<0>(c),
                            1 => store::<1>(c),
                            2 => store::<6>(c),
                            _ => store::<7>(c),
                        }
                        scale::<F, M>(st, $at, c, xq, n, bias, &out, &mut facc);
                    };
                }
                for u in 0..steps {
                    let b = now.1;
                    // the records a few steps past the unpacking (a prefetch never faults)
                    let (ga, ba) = ahead;
                    let p = (ga * nb + ba + PREFETCH) * st.rec;
                    _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add(p) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add(p + nb * st.rec) as *const i8);
                    // C tile u % LAG (as `finish!` reads it), A and B tiles u % 2
                    match u % LAG {
                        0 => product::<0, 0>(xp.add(b * 32), k, slot(u)),
                        1 => product::<1, 1>(xp.add(b * 32), k, slot(u)),
                        2 => product::<6, 0>(xp.add(b * 32), k, slot(u)),
                        _ => product::<7, 1>(xp.add(b * 32), k, slot(u)),
                    }
                    if u + AHEAD < steps {
                        st.unpack::<F>(ahead, slot(u + AHEAD));
                        ahead = st.next(ahead);
                    }
                    if u >= LAG - 1 {
                        finish!(u + 1 - LAG, done);
                        done = st.next(done);
                    }
                    now = st.next(now);
                }
                for u in steps.saturating_sub(LAG - 1)..steps {
                    finish!(u, done);
                    done = st.next(done);
                }
                // back to the tiles' initial state (cheaper context switches)
                asm!("tilerelease", options(nostack, preserves_flags));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::data;

    /// `n` rows of `k` weights in `format`: random bytes; fp16 scales drawn from all finite
    /// magnitudes (subnormal to 65504, both signs) and a few zero.
    fn random_blocks(format: Format, n: usize, k: usize, seed: u64) -> Vec<u8> {
        let bytes = format.row_bytes(k).unwrap() * n;
        let raw = data(bytes, seed);
        let mut w: Vec<u8> = raw.iter().map(|v| (v.to_bits() >> 9) as u8).collect();
        let scales = data(bytes, seed + 1);
        for (b, block) in w.chunks_exact_mut(format.block_bytes()).enumerate() {
            for h in 0..format.scale_bytes() / 2 {
                let s = scales[b * 2 + h].to_bits();
                let bits = match b % 11 {
                    0 => (s >> 9) as u16 & 0x83ff,             // subnormal
                    1 => 0x7bff | ((s >> 16) as u16 & 0x8000), // ±65504
                    2 => 0,                                    // zero
                    _ => ((s >> 9) as u16 & 0x8fff) | 0x3000,  // ordinary: 2^-3 .. 2^3 scale range
                };
                block[2 * h..2 * h + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        w
    }

    /// Rows of x with the awkward cases: a zero row, an all-equal row, huge and tiny values.
    fn awkward_x(rows: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut x = data(rows * k, seed);
        for m in 0..rows {
            let row = &mut x[m * k..(m + 1) * k];
            match m % 6 {
                1 => row.fill(0.0),
                2 => row.fill(-0.375),
                3 => row.iter_mut().for_each(|v| *v *= 3.0e4),
                4 => row.iter_mut().for_each(|v| *v *= 1.0e-30),
                _ => {}
            }
        }
        // a block of one row with a single nonzero value, exact ties
        if rows > 5 {
            x[5 * k..5 * k + 32].fill(0.0);
            x[5 * k + 3] = 2.5;
            x[5 * k + 4] = 127.0 * 0.5 / 127.0;
        }
        x
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn the_kernels_equal_the_scalar_reference_bit_for_bit_at_any_rows_and_threads() {
        // k whole blocks but not whole 256s; n not whole groups
        // groups: odd and even counts, pairs split between threads, a lone last group
        let shapes = [(576, 37), (32, 1), (64, 7), (96, 13), (1536, 9), (160, 16), (224, 3), (128, 61), (64, 24)];
        for kernel in Kernel::supported_here() {
            for format in [Format::Q4_0, Format::Q4_1, Format::Q8_0] {
                for (i, &(k, n)) in shapes.iter().enumerate() {
                    let file = random_blocks(format, n, k, 31 + i as u64);
                    let w = interleave(format, &file, n, k).unwrap();
                    assert_eq!(deinterleave(format, &w, n, k).unwrap(), file);
                    let x = awkward_x(MAX_ROWS, k, 17 + i as u64);
                    let bias = data(n, 5);
                    let mut want = vec![0f32; MAX_ROWS * n];
                    reference(format, &x, MAX_ROWS, k, &file, n, Some(&bias), &mut want).unwrap();
                    for rows in 1..=MAX_ROWS {
                        for threads in 1..=3 {
                            let mut got = vec![0f32; rows * n];
                            linear_on(kernel, format, &x[..rows * k], rows, k, &w, n, Some(&bias), &mut got, threads)
                                .unwrap();
                            let same = bits(&got) == bits(&want[..rows * n]);
                            assert!(
                                same,
                                "{kernel:?} {format:?} k {k} n {n} rows {rows} threads {threads}: {:?} vs {:?}",
                                &got[..n.min(8)],
                                &want[..n.min(8)]
                            );
                        }
                    }
                    // without a bias: the same sums
                    let mut got = vec![0f32; n];
                    let mut want1 = vec![0f32; n];
                    linear_on(kernel, format, &x[..k], 1, k, &w, n, None, &mut got, 2).unwrap();
                    reference(format, &x[..k], 1, k, &file, n, None, &mut want1).unwrap();
                    assert_eq!(bits(&got), bits(&want1));
                }
            }
        }
    }

    #[test]
    fn the_fastest_kernel_but_amx_runs_unless_the_environment_names_one() {
        let here = Kernel::supported_here();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if Kernel::Amx.supported() {
                // AMX-TILE and AMX-INT8 in CPUID, the VNNI kernel's prerequisites too
                assert_eq!(std::arch::x86_64::__cpuid_count(7, 0).edx >> 24 & 3, 3);
                assert!(Kernel::Vnni.supported());
            }
            // AVX-VNNI wherever the CPU has it, AVX-512 or not (the tests run it here)
            assert_eq!(Kernel::AvxVnni.supported(), Kernel::Avx2.supported() && has!("avxvnni"));
        }
        let order = Kernel::ALL;
        assert!(here.windows(2).all(|p| order.iter().position(|&k| k == p[0]) < order.iter().position(|&k| k == p[1])));
        assert!(Kernel::allowed(crate::Isa::Avx2).iter().all(|k| matches!(k, Kernel::AvxVnni | Kernel::Avx2)));
        if std::env::var(KERNEL_ENV).is_err() && std::env::var(crate::ISA_ENV).is_err() {
            // AMX only when named; the widest instruction set's fastest else
            let allowed = crate::isa().map_or(&[][..], Kernel::allowed);
            assert_eq!(kernel(), allowed.iter().copied().find(|&k| k != Kernel::Amx && k.supported()));
            assert_eq!(kernel(), here.iter().copied().find(|&k| k != Kernel::Amx));
        }
        for name in ["amx", "vnni", "avxvnni", "avx2"] {
            assert!(Kernel::ALL.iter().any(|k| k.name() == name));
        }
        // a kernel the CPU lacks is an error that names it
        let (f, k, n) = (Format::Q4_0, 32, 8);
        let w = interleave(f, &vec![0u8; n * f.row_bytes(k).unwrap()], n, k).unwrap();
        for lacking in Kernel::ALL.into_iter().filter(|k| !k.supported()) {
            let err = linear_on(lacking, f, &[0.0; 32], 1, k, &w, n, None, &mut [0.0; 8], 1).unwrap_err();
            assert!(err.0.contains(lacking.name()), "{err:?}");
        }
    }

    #[test]
    fn the_linear_entry_runs_the_integer_path_for_each_instruction_set() {
        let (k, n, f) = (160, 19, Format::Q4_1);
        let file = random_blocks(f, n, k, 7);
        let w = interleave(f, &file, n, k).unwrap();
        let x = awkward_x(7, k, 8);
        let mut want = vec![0f32; 7 * n];
        reference(f, &x, 7, k, &file, n, None, &mut want).unwrap();
        for isa in crate::Isa::supported_here() {
            let mut got = vec![0f32; 7 * n];
            crate::linear_on(isa, &x, 7, k, crate::Weights::Int8(f, &w), n, None, &mut got, 2).unwrap();
            assert_eq!(bits(&got), bits(&want), "{isa:?}");
        }
        let mut y = vec![0f32; 7 * n];
        assert!(crate::linear(&x, 7, k, crate::Weights::Int8(f, &w[32..]), n, None, &mut y, 1).is_err());
    }

    #[test]
    fn the_integer_path_is_near_the_exact_products() {
        // ordinary scales and activations: the relative error of int8 activations is ~1%
        let (k, n, rows) = (576, 40, 3);
        for format in [Format::Q4_0, Format::Q4_1, Format::Q8_0] {
            let mut file = random_blocks(format, n, k, 3);
            for block in file.chunks_exact_mut(format.block_bytes()) {
                block[..2].copy_from_slice(&0x2000u16.to_le_bytes()); // d = 2^-7
                if format == Format::Q4_1 {
                    block[2..4].copy_from_slice(&0xa400u16.to_le_bytes()); // m = -2^-6
                }
            }
            let x = data(rows * k, 9);
            let mut wide = vec![0f32; n * k];
            crate::quant::dequantize(format, &file, n, k, &mut wide).unwrap();
            let mut got = vec![0f32; rows * n];
            reference(format, &x, rows, k, &file, n, None, &mut got).unwrap();
            let exact: Vec<f64> = (0..rows * n)
                .map(|i| (0..k).map(|t| x[i / n * k + t] as f64 * wide[i % n * k + t] as f64).sum())
                .collect();
            let scale = exact.iter().map(|v| v.abs()).fold(0.0, f64::max);
            let err = got.iter().zip(&exact).map(|(&a, &e)| (a as f64 - e).abs()).fold(0.0, f64::max);
            assert!(err <= 0.03 * scale, "{format:?}: error {err} against {scale}");
        }
    }

    #[test]
    fn quantised_rows_round_each_block_to_its_scale() {
        let k = 96;
        let x = awkward_x(6, k, 3);
        let q = quantize_rows(&x, 6, k).unwrap();
        for (b, xs) in x.chunks_exact(32).enumerate() {
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert_eq!(q.d[b], amax / 127.0);
            let qs = &q.q[b * 32..(b + 1) * 32];
            assert_eq!(q.s[b], qs.iter().map(|&v| v as i32).sum::<i32>());
            assert_eq!(q.ds[b], q.d[b] * q.s[b] as f32);
            for (&v, &qv) in xs.iter().zip(qs) {
                if amax == 0.0 {
                    assert_eq!(qv, 0);
                } else {
                    let exact = v as f64 * 127.0 / amax as f64;
                    assert!((qv as f64 - exact).abs() <= 0.5 + 1e-4, "{v} -> {qv} (scale {amax})");
                }
            }
        }
        // ties go to even; non-finite input never panics
        assert_eq!(round_even(2.5), 2.0);
        assert_eq!(round_even(-3.5), -4.0);
        let odd = [f32::NAN, f32::INFINITY, 1.0, -1.0].repeat(8);
        assert!(quantize_rows(&odd, 1, 32).is_ok());
    }

    #[test]
    fn the_vector_quantisation_equals_the_portable_one_bit_for_bit() {
        // the awkward rows, and blocks of NaN, ±inf, subnormals (whose 127 / amax overflows),
        // the largest finite values and exact ties
        let k = 32 * 12;
        let mut x = awkward_x(6, k, 11);
        let special = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.0e-45, -3.0e-42, f32::MAX, f32::MIN, 0.5];
        for (i, v) in x.iter_mut().enumerate().filter(|(i, _)| i % 7 == 3 || (i / 32) % 5 == 2) {
            *v = if (i / 32) % 5 == 2 { special[i % 3 + 3] * (1 + i % 5) as f32 } else { special[i % special.len()] };
        }
        x[64..96].iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 15.5) * 0.5);
        x[96..128].iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 15.0) * 1.0e-45);
        assert!((127.0 / 15.0e-45f32).is_infinite());
        let got = quantize_rows(&x, 6, k).unwrap();
        let mut want = QuantRows {
            q: vec![0; x.len()],
            d: vec![0.0; x.len() / 32],
            s: vec![0; x.len() / 32],
            ds: vec![0.0; x.len() / 32],
            s8: vec![0; x.len() / 32],
            s128: vec![0; x.len() / 32],
        };
        quantize_portable(&x, &mut want);
        assert_eq!(got.q, want.q);
        assert_eq!(bits(&got.d), bits(&want.d));
        assert_eq!(bits(&got.ds), bits(&want.ds));
        assert_eq!((&got.s, &got.s8, &got.s128), (&want.s, &want.s8, &want.s128));
        assert!(want.q.contains(&127) && want.q.contains(&-127));
    }

    #[test]
    fn bad_shapes_are_errors() {
        let f = Format::Q4_1;
        let file = vec![0u8; 3 * 2 * 20];
        let w = interleave(f, &file, 3, 64).unwrap();
        assert_eq!(w.len(), GROUP * 2 * 20);
        let (x, mut y) = (vec![0f32; 2 * 64], vec![0f32; 2 * 3]);
        if kernel().is_some() {
            assert!(linear(f, &x, 2, 64, &w, 3, None, &mut y, 1).is_ok());
        }
        assert!(linear_on(Kernel::Avx2, f, &x, 2, 64, &w[1..], 3, None, &mut y, 1).unwrap_err().0.contains("bytes"));
        assert!(linear_on(Kernel::Avx2, f, &x, 2, 64, &w, 3, Some(&[0.0; 2]), &mut y, 1)
            .unwrap_err()
            .0
            .contains("bias"));
        assert!(linear_on(Kernel::Avx2, f, &x, 2, 64, &w, 3, None, &mut y[1..], 1).unwrap_err().0.contains("out"));
        assert!(linear_on(Kernel::Avx2, f, &x[1..], 2, 64, &w, 3, None, &mut y, 1).is_err());
        let big = vec![0f32; 17 * 64];
        assert!(linear_on(Kernel::Avx2, f, &big, 17, 64, &w, 3, None, &mut vec![0f32; 17 * 3], 1)
            .unwrap_err()
            .0
            .contains("at most"));
        assert!(interleave(f, &file, 3, 40).unwrap_err().0.contains("whole number"));
        assert!(interleave(f, &file[1..], 3, 64).is_err());
        assert!(deinterleave(f, &w[..w.len() - 1], 3, 64).is_err());
        assert!(quantize_rows(&x, 2, 40).is_err());
        assert!(reference(Format::Q8_0, &x, 2, 64, &file, 3, None, &mut y).is_err());
    }
}

//! Small-batch fp32 linear layers: `y[m, n] = sum_k x[m, k] · w[n, k] (+ b[n])` for a few
//! rows of `x` (1..=[`MAX_ROWS`]) and a weight in the `nn.Linear` layout (`[out, in]`,
//! row-major). This is what the target forwards while decoding: one row per plain step, the
//! tree's rows (root + a few nodes) per verification.
//!
//! Why not the BLAS the framework ships: on the 2-vCPU dev box (Xeon, AVX-512), MKL's fp32
//! GEMM over SmolLM2's 30 layers (106 M weights, streamed from memory) costs 1.45–1.6× as much
//! for 5 rows as for 1 (one thread: 46 vs 30 ms), although 5 rows need only five FMAs per
//! weight loaded — far below what a core can do while the weights stream in. Here each
//! weight is loaded once into a register and used for every row, four weight rows at a time
//! (20 accumulators for 5 rows); the next weight rows are prefetched into L2 two blocks ahead
//! and into L1 one block ahead (the four rows are four interleaved short streams, too short
//! for the hardware prefetcher to run ahead), and the sums of sixteen accumulators at a time
//! are reduced together (transposed, 45 instructions instead of 128). The 30 layers' products
//! from Python, one thread, with a decoding job on the other core: MKL 33.2 ms for 1 row;
//! here 31.5 / 31.9 / 35.7 / 40.1 ms for 1 / 2 / 5 / 8 rows (before the L1 prefetch and the
//! transposed reduction: 5 rows 36.8 ms, 1 row about MKL's; without any prefetch 5 rows took
//! 47 ms).
//!
//! Weights may also be stored as fp16 or bf16 ([`Weights`]) and are converted exactly on the
//! fly: a weight whose values are exactly representable there (the DART drafter ships fp16)
//! gives bit for bit its f32 results while half the bytes stream. Or as the GGML blocks of a
//! GGUF file (Q4_0, Q4_1, Q8_0: [`quant`], [`Weights::Packed`]), their bytes reordered once
//! per row into scales, then quantised bytes ([`quant::pack`]): a block format's step is one
//! block per weight row, its scales widened beforehand (sixteen per instruction) and its 32
//! weights formed in registers with the reference dequantiser's values; the FMA chains that
//! follow are the f32 kernel's, so the results are bit for bit those of the dequantised f32
//! weight, from 4.5 (Q4_1: 20 bytes per 32 weights) or 8.5 bits per weight.
//!
//! The same blocks run on a second numerics, the integer path ([`int8`], [`Weights::Int8`]):
//! the rows of `x` quantised to int8 per 32-value block and integer block dot products
//! (AVX-512 VNNI, else AVX2) over the weights interleaved eight rows at a time -- not the
//! dequantised weight's products, but as fixed a computation, at a fraction of the exact
//! path's cost per extra row (each row's FMAs over formed weights become one `vpdpbusd` per
//! four weights of eight output rows).
//!
//! Every output element is computed by the same instructions whatever the number of rows and
//! however the weight rows are split between threads: L lane-wise fused multiply-add chains
//! over `k` in order, a fixed reduction tree, then the bias. So a row's result does not
//! depend on the other rows of the call (bit for bit).
//!
//! Two instruction sets ([`Isa`]), chosen at run time: AVX-512F (16 lanes), else AVX2 + FMA +
//! F16C (8 lanes; AMD Zen 1-3, most Intel client chips), the same kernel over a lane-width
//! trait (`simd`). Their results differ within float32 rounding (different chains); each is
//! deterministic. Elsewhere ([`available`] false) callers use their framework's GEMM. With
//! AVX2 on the 2-vCPU AMD EPYC (Zen 3) box, shared and loaded, SmolLM2's 30 layers + LM head
//! (134 M weights) from Python, one thread, median of 7: here 72.9 / 77.0 / 113 / 123 / 272 ms
//! for 1 / 2 / 5 / 8 / 16 rows; MKL on the same row-major weights 78.9 / 158 / 232 / 254 /
//! 306, on column-major ones (its best layout) 60.9 / 98.3 / 223 / 248 / 287.

pub mod int8;
pub mod ops;
pub mod quant;
pub mod rows;
pub mod screen;
#[cfg(target_arch = "x86_64")]
mod simd;
pub mod stack;
mod team;

pub use team::Team;

/// Most rows per call.
pub const MAX_ROWS: usize = 16;

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ShapeError {}

/// An instruction set the kernels run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F with FMA: 16 f32 lanes, 32 registers.
    Avx512,
    /// AVX2 with FMA and F16C: 8 f32 lanes, 16 registers.
    Avx2,
}

impl Isa {
    /// `"avx512"` or `"avx2"`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
        }
    }

    /// Whether this CPU runs it.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Isa::Avx512 => has!("avx512f") && has!("fma"),
                Isa::Avx2 => has!("avx2") && has!("fma") && has!("f16c"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// The instruction sets this CPU runs, widest first (tests run each).
    pub fn supported_here() -> Vec<Isa> {
        [Isa::Avx512, Isa::Avx2].into_iter().filter(|i| i.supported()).collect()
    }
}

/// The environment variable that picks the instruction set (read once, at first use):
/// `avx512` or `avx2` (where the CPU runs it; else none), `none`; unset or anything else: the
/// widest this CPU runs. Forcing `avx2` on an AVX-512 machine tests and measures that path.
pub const ISA_ENV: &str = "DARTCORE_LINEAR_ISA";

/// The instruction set the kernels use: [`ISA_ENV`] if set, else AVX-512F, else AVX2 + FMA +
/// F16C, else None (the kernels do not run here).
pub fn isa() -> Option<Isa> {
    static CHOSEN: std::sync::OnceLock<Option<Isa>> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let want = std::env::var(ISA_ENV).unwrap_or_default();
        match want.trim().to_ascii_lowercase().as_str() {
            "avx512" => Some(Isa::Avx512).filter(|i| i.supported()),
            "avx2" => Some(Isa::Avx2).filter(|i| i.supported()),
            "none" => None,
            _ => Isa::supported_here().first().copied(),
        }
    })
}

/// Whether this CPU runs the kernels ([`isa`] is not None).
pub fn available() -> bool {
    isa().is_some()
}

/// A weight matrix `[n, k]` (row-major) in one of the storage formats the kernel reads. Each
/// element converts to f32 exactly, so a weight stored narrower than f32 whose values are
/// exactly representable there (fp16 exports, bf16-trained embeddings) gives bit for bit the
/// results of its f32 copy while streaming half the bytes.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    /// IEEE 754 binary16, as bit patterns.
    F16(&'a [u16]),
    /// bfloat16 (the upper 16 bits of an f32), as bit patterns.
    Bf16(&'a [u16]),
    /// A GGML block format ([`quant`]): `n` rows of `k / 32` blocks, as the GGUF file stores
    /// them. A call packs them into a temporary ([`quant::pack`]) and runs as
    /// [`Weights::Packed`]: for one-off products; a weight used again is packed once.
    Blocks(quant::Format, &'a [u8]),
    /// The same blocks in the packed layout ([`quant::pack`]), which the kernel streams: each
    /// block is read once and its weights formed in registers as the reference dequantiser
    /// rounds them ([`quant::dequantize`]), so the results are bit for bit those of the f32
    /// weights it dequantises to.
    Packed(quant::Format, &'a [u8]),
    /// The same blocks in the integer path's interleaved layout ([`int8::interleave`]): the
    /// rows of `x` are quantised to int8 per 32-value block and each block product is an
    /// integer dot product ([`int8`]) -- another numerics than the dequantised f32 weight's,
    /// as fixed (each output row is the same bits whatever the other rows and the threads).
    Int8(quant::Format, &'a [u8]),
}

impl Weights<'_> {
    /// Checks that the weight holds `n` rows of `k` elements.
    pub(crate) fn check(&self, n: usize, k: usize) -> Result<(), ShapeError> {
        let len = match self {
            Weights::F32(w) => w.len(),
            Weights::F16(w) | Weights::Bf16(w) => w.len(),
            Weights::Blocks(f, w) | Weights::Packed(f, w) => return f.check(w.len(), n, k),
            Weights::Int8(f, w) => return int8::check_interleaved(*f, w.len(), n, k),
        };
        if Some(len) == n.checked_mul(k) {
            Ok(())
        } else {
            Err(ShapeError(format!("w has {len} elements, expected {n} x {k}")))
        }
    }

    fn ptr(&self) -> *const u8 {
        match self {
            Weights::F32(w) => w.as_ptr().cast(),
            Weights::F16(w) | Weights::Bf16(w) => w.as_ptr().cast(),
            Weights::Blocks(_, w) | Weights::Packed(_, w) | Weights::Int8(_, w) => w.as_ptr(),
        }
    }
}

impl<'a> From<&'a [f32]> for Weights<'a> {
    fn from(w: &'a [f32]) -> Self {
        Weights::F32(w)
    }
}

/// `out[m, n] = x[m, :] · w[n, :] (+ bias[n])` for `m < rows`; `x` is `[rows, k]`, `w` is
/// `[n, k]` (f32, or a narrower format, see [`Weights`]), `out` is `[rows, n]`, all
/// row-major. The weight rows are split between `threads` threads: the calling thread and the
/// spinning helpers of a [`Team`].
#[allow(clippy::too_many_arguments)]
pub fn linear<'w>(
    x: &[f32],
    rows: usize,
    k: usize,
    w: impl Into<Weights<'w>>,
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), ShapeError> {
    let Some(isa) = isa() else {
        return Err(ShapeError("this CPU has neither AVX-512F nor AVX2 + FMA + F16C (or DARTCORE_LINEAR_ISA turned them off): use the framework's GEMM".into()));
    };
    linear_on(isa, x, rows, k, w, n, bias, out, threads)
}

/// [`linear`] with a given instruction set (an error where the CPU does not run it): tests and
/// benchmarks of each path on one machine.
#[allow(clippy::too_many_arguments)]
pub fn linear_on<'w>(
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    w: impl Into<Weights<'w>>,
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), ShapeError> {
    let w = w.into();
    check(x, rows, k, &w, n, bias, out)?;
    if !isa.supported() {
        return Err(ShapeError(format!("this CPU does not run {}: use the framework's GEMM", isa.name())));
    }
    if rows == 0 || n == 0 {
        return Ok(());
    }
    if let Weights::Int8(f, bytes) = w {
        // The fastest kernel the instruction set allows where the CPU runs it: AVX-512 the VNNI
        // kernel, AVX2 (forced or not) the AVX-VNNI one, else the AVX2 one.
        let kernel = int8::Kernel::allowed(isa).iter().copied().find(|k| k.supported());
        let kernel = kernel.ok_or_else(|| {
            ShapeError(format!("the integer path does not run with {} here: use the exact path", isa.name()))
        })?;
        return int8::linear_on(kernel, f, x, rows, k, bytes, n, bias, out, threads);
    }
    if let Weights::Blocks(f, file) = w {
        let packed = quant::pack_vec(f, file, n, k)?;
        return linear_on(isa, x, rows, k, Weights::Packed(f, &packed), n, bias, out, threads);
    }
    let most = pass_rows(isa);
    if matches!(w, Weights::Packed(..)) && rows > most {
        // Near-equal passes of at most `most` rows, each streaming the weight once more: the
        // same values, since an output row's instructions never depend on the other rows.
        let per = rows.div_ceil(rows.div_ceil(most));
        for r0 in (0..rows).step_by(per) {
            let r1 = (r0 + per).min(rows);
            linear_on(isa, &x[r0 * k..r1 * k], r1 - r0, k, w, n, bias, &mut out[r0 * n..r1 * n], threads)?;
        }
        return Ok(());
    }
    if threads <= 1 || n <= BLOCK {
        run_part(isa, x, rows, k, w, n, bias, OutPart::new(out), 0, n);
        return Ok(());
    }
    // Whole blocks of weight rows per thread, so that each thread's prefetches stay in its
    // part; a small product leaves the last threads without a part (one team per size).
    let per = n.div_ceil(BLOCK).div_ceil(threads) * BLOCK;
    let part = OutPart::new(out);
    let team = Team::get(threads);
    team.run(&|t| {
        let (n0, n1) = (t * per, ((t + 1) * per).min(n));
        if n0 < n1 {
            run_part(isa, x, rows, k, w, n, bias, part.clone(), n0, n1);
        }
    });
    Ok(())
}

fn check(
    x: &[f32],
    rows: usize,
    k: usize,
    w: &Weights<'_>,
    n: usize,
    bias: Option<&[f32]>,
    out: &[f32],
) -> Result<(), ShapeError> {
    if rows > MAX_ROWS {
        return Err(ShapeError(format!("{rows} rows: at most {MAX_ROWS} per call")));
    }
    let want = |what: &str, got: usize, a: usize, b: usize| {
        if Some(got) == a.checked_mul(b) {
            Ok(())
        } else {
            Err(ShapeError(format!("{what} has {got} elements, expected {a} x {b}")))
        }
    };
    want("x", x.len(), rows, k)?;
    w.check(n, k)?;
    want("out", out.len(), rows, n)?;
    if let Some(b) = bias {
        want("bias", b.len(), n, 1)?;
    }
    Ok(())
}

/// Weight rows per block: the kernel's register tile for up to 4 rows of `x`.
const BLOCK: usize = 4;

/// Rows of `x` per pass over a block-format weight. With AVX-512, past 8 the rows of `x` a tile
/// reads overflow L1 next to the formed weights (SmolLM2's down projection, k = 1536: 16 rows
/// are 96 KB) and the tile narrows to one weight row; with AVX2, 15 and 16 rows spill
/// accumulators. SmolLM2's products at 2 threads, Q4_1, one pass against near-equal passes
/// (interleaved runs): AVX-512 9 / 12 / 13 / 16 rows 19.0 / 26.1 / 33.2 / 39.5 ms against 17.7 /
/// 22.5 / 24.1 / 28.7 in passes of at most 8; AVX2 9 / 12 / 13 rows 20.4 / 30.8 / 34.0 ms in
/// one pass against 25.7 / 36.9 / 35.9 in passes of 8, 14 / 16 rows 49.2 / 52.7 against 37.4 /
/// 38.8 in two passes.
const fn pass_rows(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 8,
        Isa::Avx2 => 13,
    }
}

/// An output buffer shared by threads that write disjoint parts of it (columns of a product,
/// heads of an attention).
#[derive(Clone)]
pub(crate) struct OutPart {
    pub(crate) ptr: *mut f32,
    pub(crate) len: usize,
}

// SAFETY: threads write disjoint ranges (columns `n0..n1` of the rows in `linear`, heads in
// `ops::block_attention`), and `Team::run` returns (every part done) before the `&mut` borrow
// it came from ends.
unsafe impl Send for OutPart {}
unsafe impl Sync for OutPart {}

impl OutPart {
    pub(crate) fn new(out: &mut [f32]) -> Self {
        OutPart { ptr: out.as_mut_ptr(), len: out.len() }
    }
}

/// One instruction set's tile: rows of `x` (M) and weight rows per block (R).
macro_rules! tiles {
    ($rows:expr, $go:ident, $($m:literal => $r:literal),+ $(,)?) => {
        match $rows {
            $($m => $go!($m, $r),)+
            _ => unreachable!("checked: 1..=MAX_ROWS"),
        }
    };
}

#[allow(clippy::too_many_arguments)]
fn run_part(
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    w: Weights<'_>,
    n: usize,
    bias: Option<&[f32]>,
    out: OutPart,
    n0: usize,
    n1: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use simd::{BF16, F16, F32, Q4_0, Q4_1, Q8_0};
        let fmt = match w {
            Weights::F32(_) => F32,
            Weights::F16(_) => F16,
            Weights::Bf16(_) => BF16,
            Weights::Packed(quant::Format::Q4_0, _) => Q4_0,
            Weights::Packed(quant::Format::Q4_1, _) => Q4_1,
            Weights::Packed(quant::Format::Q8_0, _) => Q8_0,
            Weights::Blocks(..) | Weights::Int8(..) => unreachable!("packed by linear_on, or the integer path's"),
        };
        let wp = w.ptr();
        macro_rules! go {
            ($entry:ident, $m:literal, $r:literal) => {
                // SAFETY: the CPU runs `isa` (checked by `linear_on`); shapes by `check` (`wp`
                // holds n x k elements of the format); `out` covers rows x n and this call
                // writes columns n0..n1 only.
                match fmt {
                    F32 => unsafe { $entry::<$m, $r, F32>(x, k, wp, n, bias, out.ptr, out.len, n0, n1) },
                    F16 => unsafe { $entry::<$m, $r, F16>(x, k, wp, n, bias, out.ptr, out.len, n0, n1) },
                    BF16 => unsafe { $entry::<$m, $r, BF16>(x, k, wp, n, bias, out.ptr, out.len, n0, n1) },
                    Q4_0 => unsafe { $entry::<$m, $r, Q4_0>(x, k, wp, n, bias, out.ptr, out.len, n0, n1) },
                    Q4_1 => unsafe { $entry::<$m, $r, Q4_1>(x, k, wp, n, bias, out.ptr, out.len, n0, n1) },
                    _ => unsafe { $entry::<$m, $r, Q8_0>(x, k, wp, n, bias, out.ptr, out.len, n0, n1) },
                }
            };
        }
        macro_rules! go512 {
            ($m:literal, $r:literal) => {
                go!(kernel512, $m, $r)
            };
        }
        macro_rules! go256 {
            ($m:literal, $r:literal) => {
                go!(kernel256, $m, $r)
            };
        }
        match isa {
            // 32 registers: M x R accumulators + R weights + x.
            // A block format holds R tables and R index vectors besides: 5 rows x 4 weight
            // rows spilled accumulators (SmolLM2's products, 1 thread: 26-27 ms against 17
            // with 5 x 2).
            Isa::Avx512 if simd::blocked(fmt) => tiles!(rows, go512,
                1 => 4, 2 => 4, 3 => 4, 4 => 4, 5 => 2, 6 => 2, 7 => 2, 8 => 2,
                9 => 2, 10 => 2, 11 => 2, 12 => 2, 13 => 1, 14 => 1, 15 => 1, 16 => 1),
            Isa::Avx512 => tiles!(rows, go512,
                1 => 4, 2 => 4, 3 => 4, 4 => 4, 5 => 4, 6 => 2, 7 => 2, 8 => 2,
                9 => 2, 10 => 2, 11 => 2, 12 => 2, 13 => 1, 14 => 1, 15 => 1, 16 => 1),
            // 16 registers: the same count within 16 (x is an FMA memory operand where
            // registers run out; 15 and 16 rows spill an accumulator or two).
            Isa::Avx2 => tiles!(rows, go256,
                1 => 4, 2 => 4, 3 => 3, 4 => 2, 5 => 2, 6 => 2, 7 => 1, 8 => 1,
                9 => 1, 10 => 1, 11 => 1, 12 => 1, 13 => 1, 14 => 1, 15 => 1, 16 => 1),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, x, rows, k, w, n, bias, out, n0, n1);
        unreachable!("no instruction set is supported off x86_64");
    }
}

/// The kernel with AVX-512F (see [`kernel`]).
///
/// # Safety
/// As [`kernel`], on a CPU with AVX-512F and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel512<const M: usize, const R: usize, const FMT: u8>(
    x: &[f32],
    k: usize,
    w: *const u8,
    n: usize,
    bias: Option<&[f32]>,
    out: *mut f32,
    len: usize,
    n0: usize,
    n1: usize,
) {
    // SAFETY: as for this function.
    unsafe { kernel::<simd::Avx512, M, R, FMT>(x, k, w, n, bias, out, len, n0, n1) }
}

/// The kernel with AVX2 (see [`kernel`]).
///
/// # Safety
/// As [`kernel`], on a CPU with AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel256<const M: usize, const R: usize, const FMT: u8>(
    x: &[f32],
    k: usize,
    w: *const u8,
    n: usize,
    bias: Option<&[f32]>,
    out: *mut f32,
    len: usize,
    n0: usize,
    n1: usize,
) {
    // SAFETY: as for this function.
    unsafe { kernel::<simd::Avx2, M, R, FMT>(x, k, w, n, bias, out, len, n0, n1) }
}

/// Blocks of weight rows prefetched ahead into L2 (`_MM_HINT_T1`), and the next block from
/// L2 into L1 (`T0`). Measured with AVX-512 on SmolLM2's 30 layers + LM head, one thread, 1 /
/// 5 rows: two blocks ahead into L1 alone 34.9 / 41.0 ms (a wide matrix's two blocks, 8 x 6
/// KB for the MLP's down projection, plus the rows of x overflow L1's 48 KB); into L2 alone
/// 34.0 / 38.8; both 34.5 / 37.8 (4 or 6 blocks ahead alike; `NTA`: 2.4x slower).
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 2;

/// `count` fp16 scales at `p` widened to f32 at `out`, L at a time (the last few through a
/// zeroed buffer, so that nothing past the `count` halves is read).
///
/// # Safety
/// The CPU runs `S`; `p` holds `count` halves, `out` room for `count.next_multiple_of(L)` floats.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn widen<S: simd::Lanes>(p: *const u8, count: usize, out: *mut f32) {
    let mut i = 0;
    while i + S::L <= count {
        // SAFETY: halves i..i + L < count at p, floats i..i + L in out (caller).
        unsafe { S::widen(p.add(2 * i), out.add(i)) };
        i += S::L;
    }
    if i < count {
        let mut buf = [0u8; 32];
        // SAFETY: the count - i < L halves left into a 32-byte buffer; L floats at out + i.
        unsafe {
            std::ptr::copy_nonoverlapping(p.add(2 * i), buf.as_mut_ptr(), 2 * (count - i));
            S::widen(buf.as_ptr(), out.add(i));
        }
    }
}

/// The last `lanes` (< L) weights of a row at `p`, zeros in the other lanes.
///
/// # Safety
/// The CPU runs `S`; `p` points to `lanes` elements of the format.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load_w_tail<S: simd::Lanes, const FMT: u8>(p: *const u8, lanes: usize) -> S::V {
    let mut buf = [0u8; 64];
    // SAFETY: `lanes` elements at p (caller), into a 64-byte buffer (lanes < 16, <= 4 bytes).
    unsafe {
        std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), lanes * simd::width(FMT));
        S::load_w::<FMT>(buf.as_ptr())
    }
}

/// Columns `n0..n1` of `out` (`[M, n]` at `out`), `R` weight rows at a time, weights in
/// format `FMT` at `w`, with the vectors of `S` (inlined into [`kernel512`] / [`kernel256`]).
/// Each output is L lane-wise FMA chains over `k` in order (a full block's loop takes
/// [`simd::Lanes::unroll`] vectors a step, in the same order), one reduction tree, the bias.
///
/// # Safety
/// The CPU runs `S`; `x` is `[M, k]`, `w` points to `[n, k]` elements of format `FMT`, `bias`
/// `[n]`, `out` points to `len >= M * n` floats, `n0 <= n1 <= n`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // register tiles by index
unsafe fn kernel<S: simd::Lanes, const M: usize, const R: usize, const FMT: u8>(
    x: &[f32],
    k: usize,
    w: *const u8,
    n: usize,
    bias: Option<&[f32]>,
    out: *mut f32,
    len: usize,
    n0: usize,
    n1: usize,
) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    assert!(x.len() >= M * k && len >= M * n && n0 <= n1 && n1 <= n);
    let xp = x.as_ptr();
    let width = simd::width(FMT);
    let row_bytes = simd::offset(FMT, k);
    let lanes = S::L;
    let unroll = S::unroll(FMT);
    let step = lanes * unroll;
    // Whole vectors; the last partial one (k % L lanes) is loaded with zeros elsewhere, so the
    // tail joins the same L chains.
    let vectors = k / lanes * lanes;
    let full = k / step * step;
    // A packed block row (`quant::pack`): the blocks' scales, then their quantised bytes.
    let (sb, nb) = (simd::scale_bytes(FMT), k / 32);
    let quants = |b: usize| nb * sb + b * (simd::block_bytes(FMT) - sb);
    let per = sb / 2; // f32 scales per block
                      // A whole block of R rows first widens its scales into `widened` (row r's from r * stride),
                      // before the accumulators are live: widening inside the loop over the blocks (every
                      // few blocks) made the compiler spill accumulators there (4 rows of x: 2-4x slower).
    let stride = (nb * per).next_multiple_of(16);
    let mut widened = if simd::blocked(FMT) { vec![0f32; R * stride] } else { Vec::new() };
    let mut r0 = n0;
    while r0 < n1 {
        let rr = (n1 - r0).min(R);
        // SAFETY (the whole block): the CPU runs S (caller).
        let mut acc = [[unsafe { S::zero() }; M]; R];
        let mut kb = 0;
        if rr == R {
            // A whole block of R rows: the full steps without a branch (the generic loop
            // below then does only the row's last vectors, if any).
            // SAFETY: rows r0..r0 + R < n1 <= n of w; prefetch addresses are computed with
            // wrapping arithmetic and only used by prefetches, which never fault.
            let rows: [*const u8; R] = std::array::from_fn(|r| unsafe { w.add((r0 + r) * row_bytes) });
            let far_on = r0 + AHEAD * R + R <= n1;
            let near_on = r0 + 2 * R <= n1;
            if simd::blocked(FMT) {
                for (r, row) in rows.iter().enumerate() {
                    // SAFETY: the row's nb * per scales into `stride` floats from r * stride
                    // (stride: rounded up to a whole vector).
                    unsafe { widen::<S>(*row, nb * per, widened.as_mut_ptr().add(r * stride)) };
                }
            }
            let widened = widened.as_ptr();
            while kb < full {
                let off = simd::offset(FMT, kb);
                if simd::blocked(FMT) {
                    // The R rows are one contiguous span and so are the next groups': this
                    // step's share of theirs, a line at a time (a block is not a whole
                    // line, so per-row prefetches would ask for most lines two or three
                    // times).
                    let share = R * simd::offset(FMT, step);
                    for j in 0..share.div_ceil(64) {
                        let at = R * off + 64 * j;
                        if far_on {
                            unsafe {
                                _mm_prefetch::<_MM_HINT_T1>(
                                    rows[0].wrapping_add(AHEAD * R * row_bytes + at) as *const i8
                                )
                            };
                        }
                        if near_on {
                            unsafe {
                                _mm_prefetch::<_MM_HINT_T0>(rows[0].wrapping_add(R * row_bytes + at) as *const i8)
                            };
                        }
                    }
                } else {
                    for r in 0..R {
                        if far_on {
                            unsafe {
                                _mm_prefetch::<_MM_HINT_T1>(
                                    rows[r].wrapping_add(AHEAD * R * row_bytes + off) as *const i8
                                )
                            };
                        }
                        if near_on {
                            unsafe {
                                _mm_prefetch::<_MM_HINT_T0>(rows[r].wrapping_add(R * row_bytes + off) as *const i8)
                            };
                        }
                    }
                }
                // A block format's step is one block per row: its scales read once.
                // (a loop: as `array::from_fn` its closure can stay a call in the hot loop)
                let mut sc: [(S::V, S::V); R] = [unsafe { (S::zero(), S::zero()) }; R];
                let b = kb / 32;
                if simd::blocked(FMT) {
                    for (r, v) in sc.iter_mut().enumerate() {
                        *v = unsafe { S::scales::<FMT>(widened.add(r * stride + b * per)) };
                    }
                }
                for u in 0..unroll {
                    let ku = kb + u * lanes;
                    let wv: [S::V; R] = std::array::from_fn(|r| unsafe {
                        if simd::blocked(FMT) {
                            S::load_q::<FMT>(rows[r].add(quants(b)), sc[r], u)
                        } else {
                            S::load_w::<FMT>(rows[r].add(ku * width))
                        }
                    });
                    for m in 0..M {
                        // SAFETY: row m < M of x, columns ku..ku + L <= full <= k.
                        let xv = unsafe { S::load(xp.add(m * k + ku)) };
                        for r in 0..R {
                            acc[r][m] = unsafe { S::fmadd(xv, wv[r], acc[r][m]) };
                        }
                    }
                }
                kb += step;
            }
        }
        while kb < k {
            let mut wv = [unsafe { S::zero() }; R];
            for (r, v) in wv.iter_mut().enumerate() {
                if r < rr {
                    // SAFETY: row r0 + r < n1 <= n and kb < k: inside w (the tail reads
                    // only the k - kb elements left).
                    let p = unsafe { w.add((r0 + r) * row_bytes + simd::offset(FMT, kb)) };
                    *v = if simd::blocked(FMT) {
                        // (k is whole blocks, so whole vectors: no tail)
                        let row = unsafe { w.add((r0 + r) * row_bytes) };
                        let b = kb / 32;
                        let mut scales = [0f32; 2];
                        for (i, s) in scales.iter_mut().enumerate().take(per) {
                            // SAFETY: scale i of block b < nb, inside the row's scales.
                            *s = quant::f16_to_f32(unsafe { row.add(b * sb + 2 * i).cast::<u16>().read_unaligned() });
                        }
                        unsafe {
                            S::load_q::<FMT>(row.add(quants(b)), S::scales::<FMT>(scales.as_ptr()), kb % 32 / lanes)
                        }
                    } else if kb < vectors {
                        unsafe { S::load_w::<FMT>(p) }
                    } else {
                        unsafe { load_w_tail::<S, FMT>(p, k - kb) }
                    };
                    // SAFETY (both): prefetches of addresses inside w; they never fault.
                    let ahead = r0 + AHEAD * R + r;
                    if ahead < n1 {
                        unsafe {
                            _mm_prefetch::<_MM_HINT_T1>(w.add(ahead * row_bytes + simd::offset(FMT, kb)) as *const i8)
                        };
                    }
                    let near = r0 + R + r;
                    if near < n1 {
                        unsafe {
                            _mm_prefetch::<_MM_HINT_T0>(w.add(near * row_bytes + simd::offset(FMT, kb)) as *const i8)
                        };
                    }
                }
            }
            for m in 0..M {
                // SAFETY: row m < M of x, columns kb.. < k (zeros past k).
                let p = unsafe { xp.add(m * k + kb) };
                let xv = if kb < vectors { unsafe { S::load(p) } } else { unsafe { S::load_tail(p, k - kb) } };
                for r in 0..R {
                    acc[r][m] = unsafe { S::fmadd(xv, wv[r], acc[r][m]) };
                }
            }
            kb += lanes;
        }
        // The M x R sums, L at a time (accumulator i = m * R + r).
        let mut g0 = 0;
        while g0 < M * R {
            let v: [S::V; 16] = std::array::from_fn(|j| {
                let i = g0 + j;
                if j < lanes && i < M * R {
                    acc[i % R][i / R]
                } else {
                    unsafe { S::zero() }
                }
            });
            let mut sums = [0f32; 16];
            // SAFETY: L <= 16 floats into a 16-float array.
            unsafe { S::store(sums.as_mut_ptr(), S::reduce(&v)) };
            for (j, &y) in sums.iter().enumerate().take((M * R - g0).min(lanes)) {
                let (m, r) = ((g0 + j) / R, (g0 + j) % R);
                if r < rr {
                    let b = bias.map_or(0.0, |b| b[r0 + r]);
                    // SAFETY: m < M and r0 + r < n: inside out's M x n floats.
                    unsafe { *out.add(m * n + r0 + r) = y + b };
                }
            }
            g0 += lanes;
        }
        r0 += rr;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize, bias: Option<&[f32]>) -> Vec<f64> {
        let mut y = vec![0f64; rows * n];
        for m in 0..rows {
            for j in 0..n {
                let mut s = bias.map_or(0.0, |b| b[j] as f64);
                for i in 0..k {
                    s += x[m * k + i] as f64 * w[j * k + i] as f64;
                }
                y[m * n + j] = s;
            }
        }
        y
    }

    /// Deterministic test values in [-0.5, 0.5) (xorshift).
    pub(crate) fn data(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn equals_a_float64_reference_and_each_row_is_independent_of_the_others() {
        for isa in Isa::supported_here() {
            for &(k, n) in &[(576, 960), (33, 7), (16, 4), (1, 1), (100, 13), (1536, 576), (24, 9), (7, 5)] {
                let w = data(n * k, 1);
                let b = data(n, 2);
                let x = data(MAX_ROWS * k, 3);
                let mut single = vec![vec![0f32; n]; MAX_ROWS];
                for (m, row) in single.iter_mut().enumerate() {
                    linear_on(isa, &x[m * k..(m + 1) * k], 1, k, &w[..], n, Some(&b), row, 1).unwrap();
                }
                for rows in 1..=MAX_ROWS {
                    for p in [1, 2, 3] {
                        let mut y = vec![0f32; rows * n];
                        linear_on(isa, &x[..rows * k], rows, k, &w[..], n, Some(&b), &mut y, p).unwrap();
                        let r = reference(&x[..rows * k], rows, k, &w, n, Some(&b));
                        for (i, (&a, &e)) in y.iter().zip(&r).enumerate() {
                            assert!(
                                (a as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()),
                                "{isa:?} k {k} n {n} rows {rows} [{i}]: {a} vs {e}"
                            );
                            assert_eq!(
                                a.to_bits(),
                                single[i / n][i % n].to_bits(),
                                "{isa:?}: row {} differs from its 1-row call",
                                i / n
                            );
                        }
                    }
                }
                let mut y = vec![0f32; n];
                linear_on(isa, &x[..k], 1, k, &w[..], n, None, &mut y, 1).unwrap();
                let r = reference(&x[..k], 1, k, &w, n, None);
                assert!(y.iter().zip(&r).all(|(&a, &e)| (a as f64 - e).abs() <= 1e-5 * (1.0 + e.abs())));
            }
        }
    }

    #[test]
    fn the_widest_instruction_set_the_cpu_runs_is_chosen() {
        let here = Isa::supported_here();
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(
                here.contains(&Isa::Avx2),
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            );
            assert_eq!(here.contains(&Isa::Avx512), std::arch::is_x86_feature_detected!("avx512f"));
        }
        if std::env::var(ISA_ENV).is_err() {
            assert_eq!(isa(), here.first().copied());
            assert_eq!(available(), !here.is_empty());
        }
        for unsupported in [Isa::Avx512, Isa::Avx2].into_iter().filter(|i| !i.supported()) {
            let (x, w, mut y) = (vec![0f32; 4], vec![0f32; 4], vec![0f32; 1]);
            assert!(linear_on(unsupported, &x, 1, 4, &w[..], 1, None, &mut y, 1)
                .unwrap_err()
                .0
                .contains(unsupported.name()));
        }
    }

    /// IEEE binary16 bits to f32 (finite values), independently of the kernel's conversion.
    fn f16_value(h: u16) -> f32 {
        let sign = if h >> 15 == 1 { -1.0 } else { 1.0 };
        let (e, m) = (((h >> 10) & 0x1f) as i32, (h & 0x3ff) as f32);
        sign * if e == 0 { m * 2f32.powi(-24) } else { (1.0 + m / 1024.0) * 2f32.powi(e - 15) }
    }

    #[test]
    fn narrow_weights_give_the_results_of_their_f32_values_bit_for_bit() {
        for (isa, &(k, n)) in Isa::supported_here()
            .into_iter()
            .flat_map(|i| [(576, 37), (33, 7), (1, 1), (100, 13), (40, 3)].iter().map(move |s| (i, s)))
        {
            let bits: Vec<u16> = data(n * k, 5)
                .iter()
                .map(|v| {
                    let b = (v.to_bits() >> 8) as u16; // arbitrary patterns ...
                    if (b >> 10) & 0x1f == 0x1f {
                        b & !0x4000
                    } else {
                        b
                    } // ... but finite
                })
                .collect();
            let x = data(MAX_ROWS * k, 6);
            let b = data(n, 7);
            let cases: [(Weights, Vec<f32>); 2] = [
                (Weights::F16(&bits), bits.iter().map(|&h| f16_value(h)).collect()),
                (Weights::Bf16(&bits), bits.iter().map(|&h| f32::from_bits((h as u32) << 16)).collect()),
            ];
            for (narrow, wide) in cases {
                assert!(wide.iter().all(|v| v.is_finite()));
                for rows in 1..=MAX_ROWS {
                    for threads in [1, 2] {
                        let (mut a, mut e) = (vec![0f32; rows * n], vec![0f32; rows * n]);
                        linear_on(isa, &x[..rows * k], rows, k, narrow, n, Some(&b), &mut a, threads).unwrap();
                        linear_on(isa, &x[..rows * k], rows, k, &wide[..], n, Some(&b), &mut e, threads).unwrap();
                        let same = a.iter().zip(&e).all(|(p, q)| p.to_bits() == q.to_bits());
                        assert!(same, "{isa:?} {narrow:?} k {k} n {n} rows {rows}: differs from its f32 values");
                    }
                }
            }
        }
    }

    /// `n` rows of `k` weights in `format`: random bytes, scales drawn from the fp16 range
    /// the files use (finite, both signs, subnormals included).
    fn random_blocks(format: quant::Format, n: usize, k: usize, seed: u64) -> Vec<u8> {
        let bytes = format.row_bytes(k).unwrap() * n;
        let raw = data(bytes, seed);
        let mut w: Vec<u8> = raw.iter().map(|v| (v.to_bits() >> 9) as u8).collect();
        let scales = data(bytes, seed + 1);
        for (b, block) in w.chunks_exact_mut(format.block_bytes()).enumerate() {
            let halves = if format == quant::Format::Q4_1 { 2 } else { 1 };
            for h in 0..halves {
                // magnitudes 2^-20 .. 2^-2, and an occasional subnormal
                let bits = (scales[b * 2 + h].to_bits() >> 7) as u16 & 0x8fff | 0x1000;
                let bits = if b % 17 == 3 { bits & 0x83ff } else { bits };
                block[2 * h..2 * h + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        w
    }

    #[test]
    fn block_weights_give_the_results_of_their_dequantised_f32_values_bit_for_bit() {
        use quant::Format;
        // (4128: 129 blocks, an odd number of scales past a whole number of vectors)
        let shapes = [(576, 37), (32, 1), (64, 7), (1536, 9), (96, 13), (576, 4), (160, 5), (4128, 6)];
        for isa in Isa::supported_here() {
            for format in [Format::Q4_0, Format::Q4_1, Format::Q8_0] {
                for (i, &(k, n)) in shapes.iter().enumerate() {
                    let blocks = random_blocks(format, n, k, 11 + i as u64);
                    let mut wide = vec![0f32; n * k];
                    quant::dequantize(format, &blocks, n, k, &mut wide).unwrap();
                    assert!(wide.iter().all(|v| v.is_finite()));
                    let x = data(MAX_ROWS * k, 12);
                    let b = data(n, 13);
                    let packed = quant::pack_vec(format, &blocks, n, k).unwrap();
                    let mut unpacked = vec![0f32; n * k];
                    quant::dequantize_packed(format, &packed, n, k, &mut unpacked).unwrap();
                    assert!(unpacked.iter().zip(&wide).all(|(p, q)| p.to_bits() == q.to_bits()));
                    for rows in 1..=MAX_ROWS {
                        for threads in [1, 2, 3] {
                            let bias = if rows % 2 == 0 { Some(&b[..]) } else { None };
                            let (mut a, mut p, mut e) =
                                (vec![0f32; rows * n], vec![0f32; rows * n], vec![0f32; rows * n]);
                            linear_on(
                                isa,
                                &x[..rows * k],
                                rows,
                                k,
                                Weights::Blocks(format, &blocks),
                                n,
                                bias,
                                &mut a,
                                threads,
                            )
                            .unwrap();
                            linear_on(
                                isa,
                                &x[..rows * k],
                                rows,
                                k,
                                Weights::Packed(format, &packed),
                                n,
                                bias,
                                &mut p,
                                threads,
                            )
                            .unwrap();
                            linear_on(isa, &x[..rows * k], rows, k, &wide[..], n, bias, &mut e, 1).unwrap();
                            let same = a.iter().zip(&e).all(|(p, q)| p.to_bits() == q.to_bits()) && a == p;
                            assert!(same, "{isa:?} {format:?} k {k} n {n} rows {rows} threads {threads}: differs from its f32 values");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn block_weights_of_the_wrong_size_are_errors() {
        use quant::Format;
        let (x, mut y) = (vec![0f32; 2 * 64], vec![0f32; 2 * 3]);
        let ok = vec![0u8; 3 * 2 * 20];
        assert!(linear(&x, 2, 64, Weights::Blocks(Format::Q4_1, &ok), 3, None, &mut y, 1).is_ok() || !available());
        let e = linear(&x, 2, 64, Weights::Blocks(Format::Q4_1, &ok[1..]), 3, None, &mut y, 1).unwrap_err();
        assert!(e.0.contains("bytes"), "{e}");
        let e = linear(&x, 2, 64, Weights::Blocks(Format::Q8_0, &ok), 3, None, &mut y, 1).unwrap_err();
        assert!(e.0.contains("q8_0"), "{e}");
        let e = linear(&x, 2, 64, Weights::Packed(Format::Q4_1, &ok[2..]), 3, None, &mut y, 1).unwrap_err();
        assert!(e.0.contains("bytes"), "{e}");
        // rows that are not whole blocks
        let (x, mut y) = (vec![0f32; 2 * 40], vec![0f32; 2]);
        let e = linear(&x, 2, 40, Weights::Blocks(Format::Q4_0, &[0u8; 18]), 1, None, &mut y, 1).unwrap_err();
        assert!(e.0.contains("whole number"), "{e}");
    }

    #[test]
    fn bad_shapes_are_errors() {
        let (x, w, mut y) = (vec![0f32; 8], vec![0f32; 12], vec![0f32; 6]);
        assert!(linear(&x, 2, 4, &w[..], 3, None, &mut y, 1).is_ok() || !available());
        assert!(linear(&x, 2, 4, &w[..], 4, None, &mut y, 1).is_err());
        assert!(linear(&x, 2, 3, &w[..], 3, None, &mut y, 1).is_err());
        assert!(linear(&x, 2, 4, &w[..], 3, Some(&[0.0; 2]), &mut y, 1).is_err());
        assert!(linear(&x, 2, 4, Weights::F16(&[0u16; 12]), 3, None, &mut y, 1).is_ok() || !available());
        assert!(linear(&x, 2, 4, Weights::Bf16(&[0u16; 11]), 3, None, &mut y, 1).is_err());
        let big = vec![0f32; (MAX_ROWS + 1) * 4];
        let mut out = vec![0f32; (MAX_ROWS + 1) * 3];
        assert!(linear(&big, MAX_ROWS + 1, 4, &w[..], 3, None, &mut out, 1).unwrap_err().0.contains("at most"));
    }
}

"""Small-batch fp32 linear layers on the CPU through dartcore's native kernel.

``small_linear(x, weight, bias)`` = ``F.linear(x, weight, bias)``, natively for the few rows
a tree verification forwards (up to :data:`MAX_ROWS`): the weight (``[out, in]``, the
``nn.Linear`` layout) is streamed once and every row uses each weight from a register, so a
tree of 5 rows costs little more than a plain step of 1 (MKL's small-M GEMM: ~1.5x on one
thread), and one row is a little faster than MKL's matrix-vector product (SmolLM2's 30
layers on one thread: 31.5 against 33.2 ms; 5 rows 35.7 ms). Each output row is computed by
the same instructions whatever the other rows (bit for bit, see crates/dart-linear).
:class:`dartcore.models.transformer.TargetModel` says when the decoder uses it. Weights
exactly representable in float16 / bfloat16 can stream in that format (``narrow``, same
results).

Threads: the calling thread plus helpers that spin between calls (a forward runs ~120
products and 30 attentions; waking a parked thread for each cost more than the second thread
gained), as many as torch's intra-op threads when a weight is adopted, or
``DARTCORE_LINEAR_THREADS`` (read at import). Keep torch's own ops on one thread while the helpers spin (:func:`torch_threads`,
which the decoder does): torch's spinning OpenMP workers and the helpers fight over the cores
(2-16-row forwards took 170-210 ms instead of ~40). Measured on the 2-vCPU dev box (6 eval
prompts x 64 tokens, tok/s AR / dart, with the native layer ops): torch 2 threads + MKL 24-31 /
26-34, the kernel on two threads 31-35 / 38-42.

The kernel runs with AVX-512F, else AVX2 + FMA + F16C (:func:`native_linear_isa` names
which; ``DARTCORE_LINEAR_ISA=avx2`` in the environment at import forces the AVX2 path on an
AVX-512 machine, ``none`` turns the kernel off). Elsewhere -- more than MAX_ROWS rows, a
non-float32 or non-CPU tensor, autograd, a CPU with neither, ``DARTCORE_NATIVE_LINEAR=0`` in
the environment at import -- it is ``F.linear``.

:class:`BlockWeight` is a weight kept as the GGML blocks of a GGUF file (Q4_0, Q4_1, Q8_0:
4.5-8.5 bits per weight), their bytes reordered once into the kernel's packed layout (each
row's scales, then its quantised bytes: the same bytes, crates/dart-linear/src/quant.rs): the
kernel reads each block once and forms its f32 weights in registers exactly as the ``gguf``
package's dequantiser does, so the products are bit for bit those of the dequantised float32
weight (:func:`dequantize_blocks`), from 4-7x fewer bytes.
Elsewhere (more rows, no kernel) it dequantises into a temporary float32 matrix for
``F.linear``.

Two numerics for block weights (:data:`NUMERICS`): ``"exact"`` is the above (the products of
the dequantised float32 weight, = Hugging Face on the float32 conversion); ``"int8"`` runs
the integer path (crates/dart-linear/src/int8.rs): each row of ``x`` quantised to int8 per
32-value block (scale amax / 127), integer block dot products (AVX-512 VNNI, else AVX-VNNI,
else AVX2; AMX-INT8 tiles from eight rows where ``DARTCORE_INT8_KERNEL=amx`` asks for them), the
blocks' partial sums scaled and accumulated in one fixed order -- so each output row is the
same bits whatever the other rows and threads (a tree's verify computes each node as a plain
step would), and an extra row costs a fraction of the exact path's. Its weights are
interleaved eight rows at a time once (:func:`interleave_blocks`); :func:`int8_kernel` names
the kernel that runs here, ``DARTCORE_INT8_KERNEL=vnni`` (or ``avxvnni``, ``avx2``) in the
environment at import picks a slower one; ``DARTCORE_LINEAR_ISA=avx2`` leaves the 256-bit ones
(AVX-VNNI where the CPU has it, else AVX2), as on a CPU without AVX-512.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "BLOCK_FORMATS",
    "BlockWeight",
    "NUMERICS",
    "int8_kernel",
    "interleave_blocks",
    "LINEAR_THREADS",
    "MAX_ROWS",
    "NativeWeight",
    "dequantize_blocks",
    "exact_narrow",
    "pack_blocks",
    "linear_threads",
    "share_huge_pages",
    "native_linear_available",
    "native_linear_isa",
    "native_linears_",
    "native_product",
    "QUANTISED_FORMATS",
    "ScreenedWeight",
    "quantize_q4_0",
    "quantize_q8_0",
    "small_linear",
    "torch_threads",
]

MAX_ROWS = 16  # crates/dart-linear's MAX_ROWS


def _probe() -> str | None:
    """The instruction set the native kernel runs with here ("avx512", "avx2"), or None."""
    if os.environ.get("DARTCORE_NATIVE_LINEAR", "1") == "0":
        return None
    try:
        from dartcore import _native

        return _native.linear_isa() if _native.linear_available() else None
    except (ImportError, AttributeError):
        return None


_ISA = _probe()
_AVAILABLE = _ISA is not None


def _probe_int8() -> str | None:
    if not _AVAILABLE:
        return None
    from dartcore import _native

    return getattr(_native, "int8_kernel", lambda: None)()


_INT8 = _probe_int8()

# The numerics of block weights: their dequantised float32 values' products, or the integer path.
NUMERICS = ("exact", "int8")


def int8_kernel() -> str | None:
    """The integer path's kernel here: ``"vnni"`` (AVX-512 VNNI), ``"avxvnni"`` (AVX-VNNI, the
    256-bit ``vpdpbusd`` of CPUs without AVX-512), ``"avx2"``, ``"amx"`` (AMX-INT8 tiles from
    eight rows of ``x``, the VNNI kernel for fewer; only where ``DARTCORE_INT8_KERNEL=amx``
    names it), or None where it does not run (no AVX2, the native kernels off)."""
    return _INT8


def _env_threads() -> int | None:
    try:
        return max(1, int(os.environ["DARTCORE_LINEAR_THREADS"]))
    except (KeyError, ValueError):
        return None


# DARTCORE_LINEAR_THREADS (read at import), or None: the native kernel then runs on as many
# threads as torch's intra-op pool has when a weight is adopted (see linear_threads).
LINEAR_THREADS = _env_threads()


def linear_threads() -> int:
    """Threads of the native kernel for weights adopted now: ``DARTCORE_LINEAR_THREADS``, else
    torch's intra-op thread count -- the calling thread plus helpers that spin between calls
    (crates/dart-linear/src/team.rs)."""
    return LINEAR_THREADS or torch.get_num_threads()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block (restored after). The decoder
    runs its small torch ops on one thread while the native kernel's helpers spin: torch's
    OpenMP workers spinning next to them cost 4-5x (2-16-row forwards took 170-210 ms
    instead of ~40)."""
    prev = torch.get_num_threads()
    if prev != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if prev != n:
            torch.set_num_threads(prev)


def _product(
    x: torch.Tensor,
    w: np.ndarray,
    b: np.ndarray | None,
    threads: int,
    fmt: str = "f32",
    n: int | None = None,
) -> torch.Tensor:
    """The native call: ``x @ w.T + b`` into a new float32 tensor (``w`` float32, or uint16
    bit patterns or block rows of format ``fmt``; ``n`` output columns, default ``w``'s rows)."""
    from dartcore import _native

    out = torch.empty(x.shape[0], w.shape[0] if n is None else n)
    _native.linear_rows(x.detach().contiguous().numpy(), w, b, out.numpy(), threads, fmt)
    return out


# Elements checked before a whole weight is converted (most weights fail within them).
_NARROW_PROBE = 4096


def exact_narrow(weight: torch.Tensor) -> tuple[np.ndarray, str] | None:
    """``weight`` (float32) as float16 or bfloat16 bit patterns (uint16) with its format name,
    when every element converts back to exactly its float32 value; else None. The kernel
    converts them back exactly, so the products are bit for bit those of the float32 weight
    while half the bytes stream (the DART drafter ships fp16 weights)."""
    w = weight.detach()
    if w.dtype != torch.float32:
        return None
    flat = w.reshape(-1)
    for dtype, fmt in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
        probe = flat[:_NARROW_PROBE]
        if not torch.equal(probe.to(dtype).float(), probe):
            continue
        narrow = w.to(dtype)
        if torch.equal(narrow.float(), w):
            return narrow.contiguous().view(torch.int16).numpy().view(np.uint16), fmt
    return None


def native_linear_available() -> bool:
    """Whether the native kernel runs here (built, AVX-512F or AVX2 + FMA + F16C, not
    switched off)."""
    return _AVAILABLE


def native_linear_isa() -> str | None:
    """The instruction set the native kernel and layer ops run with: ``"avx512"``,
    ``"avx2"``, or None where they do not run (see :func:`native_linear_available`).
    Benchmarks name it with their figures."""
    return _ISA


class NativeWeight:
    """A float32 CPU weight ``[out, in]`` (contiguous) and bias, with the numpy views the
    kernel reads made once (a view per call costs about as much as a small product).

    ``narrow=True``: where the weight is exactly representable in float16 or bfloat16
    (:func:`exact_narrow`), the kernel reads a copy in that format -- bit for bit the same
    products, half the bytes streamed (the float32 weight stays for everything else).
    ``threads``: the kernel's threads (default :func:`linear_threads` now)."""

    __slots__ = ("weight", "bias", "ptr", "format", "threads", "_w", "_b")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        narrow: bool = False,
        threads: int | None = None,
    ):
        self.weight, self.bias = weight, bias
        self.threads = threads or linear_threads()
        self.ptr = weight.data_ptr()  # the storage the views were made of
        usable = _AVAILABLE and _fits(weight)
        packed = exact_narrow(weight) if usable and narrow else None
        self._w, self.format = (
            packed if packed is not None else (weight.detach().numpy() if usable else None, "f32")
        )
        self._b = (
            None if bias is None or self._w is None else np.ascontiguousarray(bias.detach().numpy())
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, natively for 1..MAX_ROWS float32 CPU rows (see the
        module docs)."""
        if (
            self._w is None
            or x.dim() != 2
            or not 1 <= x.shape[0] <= MAX_ROWS
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        ):
            return F.linear(x, self.weight, self.bias)
        return _product(x, self._w, self._b, self.threads, self.format)

    def native_parts(self) -> tuple[np.ndarray, str, np.ndarray | None] | None:
        """``(w, format, bias)`` as the native kernel reads them, or None where it does not run
        for this weight."""
        return None if self._w is None else (self._w, self.format, self._b)


def _fits(weight: torch.Tensor) -> bool:
    return (
        weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.is_contiguous()
    )


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` (``F.linear``), natively for a few float32 rows on the CPU.
    (Prefer a :class:`NativeWeight` for a weight used many times.)"""
    return NativeWeight(weight, bias)(x)


def native_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The native kernel itself for 1..MAX_ROWS rows (no fallback): tests and benchmarks."""
    if not (_AVAILABLE and _fits(weight)):
        raise RuntimeError(
            "the native kernel needs AVX-512F or AVX2 + FMA + F16C and a contiguous float32 CPU weight"
        )
    return _product(
        x, weight.detach().numpy(), None if bias is None else bias.detach().contiguous().numpy(), 1
    )


def native_product(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    numerics: str = "exact",
    narrow: bool = False,
    threads: int | None = None,
    block: str = "q8_0",
    screen: int = 0,
):
    """The native product of a float weight, ``product(x) = x @ W.T + bias``: with
    ``numerics="exact"`` a :class:`NativeWeight` (``W`` the weight itself); with ``"int8"``
    the weight quantised to blocks of ``block`` (Q8_0, or Q4_0: half the bytes) once and run
    on the integer path (:meth:`BlockWeight.from_float`: ``W`` the blocks' values, x quantised
    per 32 values); ``screen`` > 0: a :class:`ScreenedWeight` (the blocks' products, those of
    each row's ``screen`` best outputs made again from ``weight``: an LM head). A weight the
    integer path cannot take -- in-features not a multiple of 32, values beyond fp16 scales,
    the integer kernels not running here -- gets the exact product, with a one-line warning."""
    from dartcore.errors import DartError, WeightFormatError

    if numerics not in NUMERICS:
        raise DartError(f"numerics={numerics!r}: expected one of {NUMERICS}")
    if block not in _QUANTISERS:
        raise DartError(f"block={block!r}: expected one of {sorted(_QUANTISERS)}")
    if numerics == "int8":
        why = None
        if _INT8 is None:
            why = "the integer kernels do not run here"
        elif not _fits(weight):
            why = "not a contiguous 2-D float32 CPU weight"
        else:
            try:
                blocks = BlockWeight.from_float(weight, bias, threads=threads, fmt=block)
                return ScreenedWeight(blocks, weight, bias, screen) if screen > 0 else blocks
            except WeightFormatError as e:
                why = str(e)
        import warnings

        warnings.warn(
            f"numerics='int8': a {list(weight.shape)} weight stays exact ({why})", stacklevel=2
        )
    return NativeWeight(weight, bias, narrow=narrow, threads=threads)


class _NativeLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose inference forward of a few rows runs natively (see
    :func:`native_linears_`); same parameters, same state dict. The kernel's copy of the
    weight (:func:`native_product`) is made on first use and remade when the parameter is
    replaced or changed in place (its version counter)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native, version = self.__dict__.get("_native_weight", (None, -1))
        source = self.__dict__.get("_native_source")  # (the parameter, its storage)
        w = self.weight
        if (
            native is None
            or source[0] is not w
            or source[1] != w.data_ptr()
            or version != w._version
        ):
            native = native_product(
                w,
                self.bias,
                numerics=self.__dict__.get("_numerics", "exact"),
                narrow=self.__dict__.get("_narrow", False),
                threads=self.__dict__.get("_threads"),
                block=self.__dict__.get("_block", "q8_0"),
                screen=self.__dict__.get("_screen", 0),
            )
            self.__dict__["_native_weight"] = (native, w._version)
            self.__dict__["_native_source"] = (w, w.data_ptr())
        if x.dim() != 2 or (
            torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
        ):  # autograd: the float weight
            return F.linear(x, w, self.bias)
        return native(x)


def native_linears_(
    module: torch.nn.Module,
    *,
    narrow: bool = False,
    threads: int | None = None,
    numerics: str = "exact",
    block: str = "q8_0",
) -> torch.nn.Module:
    """Run the float32 CPU ``nn.Linear`` layers of ``module`` (in place) through the native
    kernel for 2-D inputs of at most :data:`MAX_ROWS` rows; other inputs, autograd and other
    devices / dtypes take ``F.linear`` as before. The DART drafter forwards a handful of rows
    per draft. ``narrow``: weights exactly representable in float16 / bfloat16 stream in that
    format (see :class:`NativeWeight`; same results). ``threads``: the kernel's (default
    :func:`linear_threads` at first use). ``numerics="int8"``: the weights as blocks of
    ``block`` (Q8_0 or Q4_0) on the integer path, any number of rows (see
    :func:`native_product`). A no-op where the
    kernel does not run."""
    if not _AVAILABLE:
        return module
    for m in module.modules():
        if type(m) in (torch.nn.Linear, _NativeLinear) and _fits(m.weight):
            m.__class__ = _NativeLinear
            m.__dict__["_narrow"] = narrow
            m.__dict__["_threads"] = threads
            m.__dict__["_numerics"] = numerics
            m.__dict__["_block"] = block
            m.__dict__.pop("_native_weight", None)
            m.__dict__.pop("_native_source", None)
            m.__dict__.pop("_screen", None)
    return module


# GGML block formats the kernel reads: bytes per 32-weight block (crates/dart-linear/src/quant.rs).
BLOCK_FORMATS = {"q4_0": 18, "q4_1": 20, "q8_0": 34}


def _block_row_bytes(fmt: str, k: int) -> int:
    from dartcore.errors import WeightFormatError

    if fmt not in BLOCK_FORMATS:
        raise WeightFormatError(
            f"fmt: unknown block format {fmt!r}, expected one of {sorted(BLOCK_FORMATS)}"
        )
    if k <= 0 or k % 32:
        raise WeightFormatError(
            f"k: {fmt} rows of {k} weights are not a whole number of 32-weight blocks"
        )
    return k // 32 * BLOCK_FORMATS[fmt]


def _check_rows(data, k: int, fmt: str) -> None:
    row = _block_row_bytes(fmt, k)
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != row
    ):
        from dartcore.errors import WeightFormatError

        got = (
            f"{data.dtype} {list(data.shape)}"
            if isinstance(data, np.ndarray)
            else type(data).__name__
        )
        raise WeightFormatError(f"data: {fmt} rows of {k} weights are uint8 [n, {row}], got {got}")


def dequantize_blocks(
    data: np.ndarray,
    k: int,
    fmt: str,
    *,
    packed: bool = False,
    rows: int | None = None,
    layout: str | None = None,
) -> torch.Tensor:
    """The float32 values ``[n, k]`` of ``n`` rows of GGML blocks (``data`` uint8 ``[n, k / 32
    * block bytes]``, as the file stores them, or ``packed`` by :func:`pack_blocks`; or
    ``layout="int8"``: interleaved by :func:`interleave_blocks`, ``rows`` of them), natively,
    as the ``gguf`` package's dequantiser computes them."""
    from dartcore import _native

    _check_rows(data, k, fmt)
    layout = layout or ("packed" if packed else "file")
    n = data.shape[0] if rows is None else int(rows)
    out = torch.empty(n, k)
    _native.dequantize_rows(
        np.ascontiguousarray(data), out.numpy(), fmt if layout == "file" else f"{fmt}_{layout}"
    )
    return out


def interleave_blocks(data: np.ndarray, k: int, fmt: str) -> np.ndarray:
    """Rows of GGML blocks as the file stores them (uint8 ``[n, k / 32 * block bytes]``) in
    the integer path's interleaved layout: a new uint8 array ``[ceil(n / 8) * 8, same]``
    (eight rows at a time, four bytes of each in turn; the last group padded with zero rows;
    crates/dart-linear/src/int8.rs)."""
    from dartcore import _native

    _check_rows(data, k, fmt)
    return _native.interleave_rows(np.ascontiguousarray(data), fmt)


def _unpack(data: np.ndarray, k: int, fmt: str) -> np.ndarray:
    """Packed rows (:func:`pack_blocks`) back as the file stores them."""
    n, nb, bb = data.shape[0], k // 32, BLOCK_FORMATS[fmt]
    sb = 4 if fmt == "q4_1" else 2
    scales = data[:, : nb * sb].reshape(n, nb, sb)
    quants = data[:, nb * sb :].reshape(n, nb, bb - sb)
    return np.ascontiguousarray(np.concatenate([scales, quants], axis=2).reshape(n, nb * bb))


def pack_blocks(data: np.ndarray, k: int, fmt: str) -> np.ndarray:
    """Rows of GGML blocks as the file stores them (uint8 ``[n, k / 32 * block bytes]``) in
    the kernel's packed layout (a new array of the same shape): each row's fp16 scales, block
    after block, then its quantised bytes -- the same bytes, reordered so that the kernel
    widens sixteen scales at a time instead of one (crates/dart-linear/src/quant.rs)."""
    from dartcore import _native

    _check_rows(data, k, fmt)
    out = np.empty_like(data)
    _native.pack_rows(np.ascontiguousarray(data), out, fmt)
    return out


def _float_blocks(values, fmt: str) -> tuple[int, int, np.ndarray]:
    """``values`` (float rows ``[n, k]``, a tensor or array) checked for a quantiser of ``fmt``
    (finite, ``k`` a positive multiple of 32) as float32 blocks ``[n, k / 32, 32]``."""
    from dartcore.errors import WeightFormatError

    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float32).numpy()
    x = np.asarray(values, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] == 0 or x.shape[1] % 32:
        raise WeightFormatError(
            f"values: {fmt} rows of a whole number of 32-value blocks, got shape {list(x.shape)}"
        )
    if not np.isfinite(x).all():
        raise WeightFormatError(f"values: {fmt} blocks of non-finite values")
    n, k = x.shape
    return n, k, x.reshape(n, k // 32, 32)


def quantize_q8_0(values) -> np.ndarray:
    """Float rows ``[n, k]`` (a tensor or array; ``k`` a multiple of 32) as GGML Q8_0 blocks,
    uint8 ``[n, k / 32 * 34]`` as a GGUF file stores them (what :class:`BlockWeight` reads):
    per 32 values the scale ``d = amax / 127`` (float32, stored as fp16) then ``q = round(x /
    d)`` as int8 (x times the float32 ``1 / d``, halves away from zero; ``q = 0`` where ``d`` is
    0) -- GGML's reference quantiser, byte for byte. A block whose scale is below fp16's range
    keeps a zero scale (its values dequantise to 0), as in GGML. Non-finite values, or a scale
    above fp16's range (|x| > 8.3e6), are errors."""
    from dartcore.errors import WeightFormatError

    n, k, blocks = _float_blocks(values, "Q8_0")
    d = np.abs(blocks).max(axis=2) / np.float32(127)
    with np.errstate(over="ignore"):
        d16 = d.astype(np.float16)
    if np.isinf(d16).any():
        raise WeightFormatError("values: a Q8_0 block's scale (amax / 127) is beyond fp16's range")
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    scaled = blocks * inv[:, :, None]
    mag = np.abs(scaled)
    whole = np.floor(mag)
    q = np.copysign(whole + (mag - whole >= np.float32(0.5)), scaled)
    out = np.empty((n, k // 32, 34), dtype=np.uint8)
    out[:, :, :2] = d16[:, :, None].view(np.uint8)
    out[:, :, 2:] = np.clip(q, -127, 127).astype(np.int8).view(np.uint8)
    return out.reshape(n, k // 32 * 34)


def quantize_q4_0(values) -> np.ndarray:
    """Float rows ``[n, k]`` (a tensor or array; ``k`` a multiple of 32) as GGML Q4_0 blocks,
    uint8 ``[n, k / 32 * 18]`` as a GGUF file stores them: per 32 values the scale ``d = m /
    -8`` (``m`` the value of largest magnitude, the first of equals; float32, stored as fp16)
    then ``q = min(15, trunc(x / d + 8.5))`` as 4 bits (x times the float32 ``1 / d``; ``q = 8``
    where ``d`` is 0), values 0..15 in the low nibbles, 16..31 in the high ones -- GGML's
    reference quantiser, byte for byte. About half the bytes of Q8_0, with 4-bit values.
    Non-finite values, or a scale beyond fp16's range (|x| > 5.2e5), are errors."""
    from dartcore.errors import WeightFormatError

    n, k, blocks = _float_blocks(values, "Q4_0")
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[:, :, None], 2)[:, :, 0]
    d = peak / np.float32(-8)
    with np.errstate(over="ignore"):
        d16 = d.astype(np.float16)
    if np.isinf(d16).any():
        raise WeightFormatError("values: a Q4_0 block's scale (amax / 8) is beyond fp16's range")
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(np.trunc(blocks * inv[:, :, None] + np.float32(8.5)), 15).astype(np.uint8)
    out = np.empty((n, k // 32, 18), dtype=np.uint8)
    out[:, :, :2] = d16[:, :, None].view(np.uint8)
    out[:, :, 2:] = q[:, :, :16] | (q[:, :, 16:] << 4)
    return out.reshape(n, k // 32 * 18)


# The float weights' block formats of :meth:`BlockWeight.from_float`: their quantisers.
_QUANTISERS = {"q4_0": quantize_q4_0, "q8_0": quantize_q8_0}
QUANTISED_FORMATS = tuple(_QUANTISERS)  # what a float weight may be quantised to


class BlockWeight:
    """A weight ``[n, k]`` kept as GGML blocks: ``data`` uint8 ``[n, k / 32 * block bytes]``
    (each row its blocks, as the GGUF file stores them; or ``packed`` already by
    :func:`pack_blocks`), ``fmt`` one of :data:`BLOCK_FORMATS`, an optional float32 bias.
    ``numerics="exact"``: ``w(x)`` is ``F.linear(x, W, bias)`` with ``W`` the dequantised
    float32 weight: natively from the blocks for 1..MAX_ROWS float32 CPU rows (bit for bit),
    else through a temporary float32 ``W`` (:meth:`dequantize`); ``data`` holds the rows
    packed (the same bytes). ``numerics="int8"`` (where :func:`int8_kernel` runs): the integer
    path (see the module docs), MAX_ROWS rows per native call whatever the number of rows;
    ``data`` holds the rows interleaved (:func:`interleave_blocks`)."""

    __slots__ = ("data", "format", "shape", "bias", "threads", "numerics", "adopted", "_b")

    def __init__(
        self,
        data: np.ndarray,
        k: int,
        fmt: str,
        bias: torch.Tensor | None = None,
        *,
        threads: int | None = None,
        packed: bool = False,
        numerics: str = "exact",
    ):
        from dartcore.errors import WeightFormatError

        _check_rows(data, k, fmt)
        if numerics not in NUMERICS:
            raise WeightFormatError(f"numerics: {numerics!r}, expected one of {NUMERICS}")
        if numerics == "int8" and _INT8 is None:
            raise WeightFormatError(
                "numerics='int8' needs the integer kernels (AVX2 + FMA + F16C, the native "
                "kernels on): use numerics='exact'"
            )
        self.format, self.shape, self.numerics = fmt, (int(data.shape[0]), int(k)), numerics
        if numerics == "int8":
            self.data = interleave_blocks(_unpack(data, k, fmt) if packed else data, k, fmt)
        else:
            self.data = np.ascontiguousarray(data) if packed else pack_blocks(data, k, fmt)
        self.bias = bias
        self.threads = threads or linear_threads()
        self.adopted = False  # whether a TargetModel runs it (transformer.py)
        self._b = None if bias is None else np.ascontiguousarray(bias.detach().numpy())

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        threads: int | None = None,
        numerics: str = "int8",
        fmt: str = "q8_0",
    ) -> BlockWeight:
        """A float weight ``[n, k]`` (``k`` a multiple of 32) quantised to blocks of ``fmt``
        (``"q8_0"``, :func:`quantize_q8_0`: ~4x fewer bytes than float32; ``"q4_0"``,
        :func:`quantize_q4_0`: ~7x) and run with ``numerics``: its products those of the
        blocks' values, not of ``weight``."""
        from dartcore.errors import WeightFormatError

        quantise = _QUANTISERS.get(fmt)
        if quantise is None:
            raise WeightFormatError(f"fmt={fmt!r}: expected one of {sorted(_QUANTISERS)}")
        return cls(
            quantise(weight),
            int(weight.shape[1]),
            fmt,
            None if bias is None else bias.detach().to(torch.float32).contiguous(),
            threads=threads,
            numerics=numerics,
        )

    @classmethod
    def rows_of(cls, whole: BlockWeight, start: int, n: int) -> BlockWeight:
        """Rows ``start .. start + n`` of a weight as a weight of their own (no bias) sharing
        its bytes (int8: ``start`` and ``n`` whole groups of 8)."""
        if whole.numerics == "int8" and (start % 8 or n % 8):
            raise ValueError(
                f"rows {start}..{start + n} of an int8 weight are not whole groups of 8"
            )
        self = cls.__new__(cls)
        self.data = whole.data[start : start + n]
        self.format, self.shape, self.numerics = whole.format, (n, whole.shape[1]), whole.numerics
        self.bias, self.threads, self.adopted, self._b = None, whole.threads, False, None
        return self

    def with_numerics(self, numerics: str, *, copy: bool = False) -> BlockWeight:
        """This weight laid out for ``numerics`` (the same values): re-laid out in place, or
        with ``copy`` a new weight (this one unchanged)."""
        if numerics == self.numerics and not copy:
            return self
        bias = self.bias
        new = BlockWeight(
            self.file_rows(),
            self.shape[1],
            self.format,
            bias,
            threads=self.threads,
            numerics=numerics,
        )
        if copy:
            return new
        self.data, self.numerics = new.data, numerics
        return self

    def file_rows(self) -> np.ndarray:
        """The rows as the GGUF file stores them (a new array)."""
        if self.numerics == "exact":
            return _unpack(self.data, self.shape[1], self.format)
        from dartcore import _native

        return _native.deinterleave_rows(self.data, self.shape[0], self.format)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def _layout(self) -> str:
        return "int8" if self.numerics == "int8" else "packed"

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[n, k]`` (a new tensor)."""
        return dequantize_blocks(
            self.data, self.shape[1], self.format, rows=self.shape[0], layout=self._layout()
        )

    def dequantize_rows(self, rows: np.ndarray) -> torch.Tensor:
        """The float32 rows ``rows`` (indices in ``0 .. n``) of the weight, ``[len(rows), k]``:
        :meth:`dequantize`'s rows, reading only their blocks (natively)."""
        from dartcore import _native

        rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
        out = torch.empty(rows.size, self.shape[1])
        _native.dequantize_rows_at(self.data, rows, out.numpy(), f"{self.format}_{self._layout()}")
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (
            _AVAILABLE
            and x.dim() == 2
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and x.requires_grad)
        ):
            fmt = f"{self.format}_{self._layout()}"
            if 1 <= x.shape[0] <= MAX_ROWS:
                return _product(x, self.data, self._b, self.threads, fmt, self.shape[0])
            if self.numerics == "int8" and x.shape[0] > 0:
                # the integer path at any number of rows, MAX_ROWS at a time (each row's
                # result is the same whatever the others)
                return torch.cat(
                    [
                        _product(
                            x[i : i + MAX_ROWS],
                            self.data,
                            self._b,
                            self.threads,
                            fmt,
                            self.shape[0],
                        )
                        for i in range(0, x.shape[0], MAX_ROWS)
                    ]
                )
        return F.linear(x, self.dequantize().to(x.device, x.dtype), self.bias)

    def native_parts(self) -> tuple[np.ndarray, str, np.ndarray | None] | None:
        """``(block rows, format name, bias)`` as the native kernel reads them (None where it
        does not run here): packed rows (``"q4_1_packed"``), or interleaved ones for the
        integer path (``"q4_1_int8"``)."""
        return (self.data, f"{self.format}_{self._layout()}", self._b) if _AVAILABLE else None


# Bytes of a transparent huge page (x86-64's PMD size): the mapping of share_huge_pages is a
# whole number of them.
HUGE_PAGE = 2 << 20


def share_huge_pages(weights, views=()) -> int:
    """Move the bytes of ``weights`` (:class:`BlockWeight`, each once however often given) into
    one anonymous mapping advised for transparent huge pages (``MADV_HUGEPAGE``), side by side
    in the order given, 64-byte aligned: each weight's ``data`` becomes a view of the same
    bytes and shape there. ``views``: weights whose ``data`` may be rows of one of
    ``weights``' arrays (:meth:`BlockWeight.rows_of`, a fused group's projections); those
    become the same rows of its new place, so the old arrays are freed. Returns the bytes
    moved; 0 (nothing moved) where the platform has no ``MADV_HUGEPAGE`` or refuses the
    mapping or the advice.

    Why: a forward of a few rows streams every weight once, and on 4 KB pages SmolLM2's
    ~66 MB of layer blocks cross ~16,000 pages, a TLB miss each that the prefetches wait on;
    Linux gives huge pages to anonymous memory only where advised (the default
    ``transparent_hugepage=madvise``), and a weight of its own (0.2-1.1 MB here) is smaller
    than one. Measured on the 2-vCPU Xeon with ``crates/dart-linear/examples/rows.rs`` (the
    int8 products of SmolLM2's layers and head, ``DART_LINEAR_HUGE=1`` against without)."""
    import mmap

    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    unique, seen = [], set()
    for w in weights:
        if isinstance(w, BlockWeight) and id(w) not in seen:
            seen.add(id(w))
            unique.append(w)
    if advice is None or not unique:
        return 0
    offsets, total = [], 0
    for w in unique:
        offsets.append(total)
        total += -(-int(w.data.nbytes) // 64) * 64
    try:
        size = -(-total // HUGE_PAGE) * HUGE_PAGE
        # private: a shared anonymous mapping is shmem, whose huge pages are off by default
        arena = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(advice)
    except (OSError, ValueError):
        return 0
    moved, places = 0, []
    for w, at in zip(unique, offsets):
        data = np.ascontiguousarray(w.data)
        view = np.frombuffer(arena, dtype=data.dtype, count=data.size, offset=at)
        view = view.reshape(data.shape)
        view[...] = data
        places.append((_address(w.data), int(w.data.nbytes), w.data.strides[0], view))
        w.data = view
        moved += int(data.nbytes)
    for v in views:
        if not isinstance(v, BlockWeight) or id(v) in seen or v.data.ndim != 2:
            continue
        start = _address(v.data)
        for old, nbytes, stride, view in places:
            if old <= start < old + nbytes and v.data.strides[0] == stride:
                row = (start - old) // stride
                v.data = view[row : row + v.data.shape[0]]
                break
    return moved


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


class ScreenedWeight:
    """An LM head's product on blocks, refined where it matters: ``blocks`` (a
    :class:`BlockWeight` of ``weight``, e.g. Q4_0) computes every output, then each row's
    ``screen`` largest outputs are computed again from the float ``weight`` itself (float32
    dot products of those rows of it, plus ``bias``: ``refine_top``, natively). A drafter's
    search reads only the top of each row, so its tokens and their log-probabilities come out
    as the float weight's (unless the blocks' error pushes one of them below the ``screen``
    best), while the head streams the blocks' bytes: SmolLM2's drafter head as Q4_0 alone
    agrees with the fp16 head's top token 75% of the time, screened (32 or 64; its other layers
    Q8_0) 98%."""

    __slots__ = ("blocks", "weight", "bias", "screen")

    def __init__(
        self, blocks: BlockWeight, weight: torch.Tensor, bias: torch.Tensor | None, screen: int
    ):
        self.blocks = blocks
        self.weight = np.ascontiguousarray(weight.detach().numpy())
        self.bias = None if bias is None else np.ascontiguousarray(bias.detach().numpy())
        self.screen = min(int(screen), blocks.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(x)
        if out.dim() != 2 or out.shape[0] == 0 or out.requires_grad:
            return out
        self.refine(out.numpy(), x.detach().float().contiguous().numpy())
        return out

    def native_parts(self) -> tuple[np.ndarray, str, np.ndarray | None] | None:
        """The blocks' (see :meth:`BlockWeight.native_parts`); their products want
        :meth:`refine`."""
        return self.blocks.native_parts()

    def refine(self, values: np.ndarray, x: np.ndarray) -> None:
        """``values`` (float32 ``[rows, n]``, the blocks' products of ``x`` ``[rows, k]``) with
        each row's ``screen`` largest made again from the float weight, in place."""
        from dartcore import _native

        _native.refine_top(values, x, self.weight, self.bias, self.screen)

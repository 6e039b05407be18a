"""Small-batch fp32 linear layers on the CPU through dartcore's native kernel.

``small_linear(x, weight, bias)`` = ``F.linear(x, weight, bias)``, natively for the few rows
a tree verification forwards (up to :data:`MAX_ROWS`): the weight (``[out, in]``, the
``nn.Linear`` layout) is streamed once and every row uses each weight from a register, so a
tree of 5 rows costs little more than a plain step of 1 (MKL's small-M GEMM: ~1.5x on one
thread). Each output row is computed by the same instructions whatever the other rows (bit
for bit, see crates/dart-linear). :class:`dartcore.models.transformer.TargetModel` says when
the decoder uses it.

Threads: ``DARTCORE_LINEAR_THREADS`` (read at import, default 1) -- the calling thread plus
helpers that spin between calls (a forward makes ~120 of them; waking a parked thread per
call cost more than the second thread gained). With 1, one row stays with MKL's
matrix-vector product (as fast as ours on one thread); with more, every row count from 1
runs natively. Measured on the 2-vCPU dev box (4 GSM8K prompts, AR / dart / dart+ctx tok/s):
torch 2 threads + MKL 26.8-27.4 / 33.0-33.3 / 36.6-38.7; ``torch.set_num_threads(1)`` and
``DARTCORE_LINEAR_THREADS=2`` 24.7-24.8 / 35.2-36.2 / 38.1-38.9 (DART faster, plain AR
slower: torch's other ops then run on one thread). Keep torch at one thread when the helpers
spin: torch's own spinning OpenMP workers and these fight over the cores (2-16-row forwards
took 170-210 ms instead of ~40).

Elsewhere -- more than MAX_ROWS rows, a non-float32 or non-CPU tensor, autograd, a CPU
without AVX-512F, ``DARTCORE_NATIVE_LINEAR=0`` in the environment at import -- it is
``F.linear``.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["LINEAR_THREADS", "MAX_ROWS", "NativeWeight", "native_linear_available", "native_linears_", "small_linear"]

MAX_ROWS = 16  # crates/dart-linear's MAX_ROWS


def _probe() -> bool:
    if os.environ.get("DARTCORE_NATIVE_LINEAR", "1") == "0":
        return False
    try:
        from dartcore import _native

        return bool(_native.linear_available())
    except (ImportError, AttributeError):
        return False


_AVAILABLE = _probe()


def _linear_threads() -> int:
    try:
        return max(1, int(os.environ.get("DARTCORE_LINEAR_THREADS", "1")))
    except ValueError:
        return 1


# Threads of the native kernel (read at import): the calling thread plus n - 1 helpers that
# spin between calls (crates/dart-linear/src/team.rs).
LINEAR_THREADS = _linear_threads()
# Fewest rows taken natively: with one thread a single row stays with MKL's matrix-vector
# product (as fast as ours there).
_MIN_ROWS = 1 if LINEAR_THREADS > 1 else 2


def _product(x: torch.Tensor, w: np.ndarray, b: np.ndarray | None, threads: int) -> torch.Tensor:
    """The native call: ``x @ w.T + b`` into a new float32 tensor."""
    from dartcore import _native

    out = torch.empty(x.shape[0], w.shape[0])
    _native.linear_rows(x.detach().contiguous().numpy(), w, b, out.numpy(), threads)
    return out


def native_linear_available() -> bool:
    """Whether the native kernel runs here (built, AVX-512F + FMA, not switched off)."""
    return _AVAILABLE


class NativeWeight:
    """A float32 CPU weight ``[out, in]`` (contiguous) and bias, with the numpy views the
    kernel reads made once (a view per call costs about as much as a small product)."""

    __slots__ = ("weight", "bias", "ptr", "_w", "_b")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.ptr = weight.data_ptr()  # the storage the views were made of
        self._w = weight.detach().numpy() if _AVAILABLE and _fits(weight) else None
        self._b = None if bias is None or self._w is None else np.ascontiguousarray(bias.detach().numpy())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, natively for float32 CPU rows in ``_MIN_ROWS ..
        MAX_ROWS`` (see the module docs)."""
        if (self._w is None or x.dim() != 2 or not _MIN_ROWS <= x.shape[0] <= MAX_ROWS
                or x.dtype != torch.float32 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        return _product(x, self._w, self._b, LINEAR_THREADS)


def _fits(weight: torch.Tensor) -> bool:
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.is_contiguous())


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``F.linear``), natively for a few float32 rows on the CPU.
    (Prefer a :class:`NativeWeight` for a weight used many times.)"""
    return NativeWeight(weight, bias)(x)


def native_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The native kernel itself for 1..MAX_ROWS rows (no fallback): tests and benchmarks."""
    if not (_AVAILABLE and _fits(weight)):
        raise RuntimeError("the native kernel needs AVX-512F and a contiguous float32 CPU weight")
    return _product(x, weight.detach().numpy(), None if bias is None else bias.detach().contiguous().numpy(), 1)


class _NativeLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose inference forward of a few rows runs natively (see
    :func:`native_linears_`); same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self.__dict__.get("_native_weight")
        if native is None or native.weight is not self.weight or native.ptr != self.weight.data_ptr():
            native = self.__dict__["_native_weight"] = NativeWeight(self.weight, self.bias)
        return native(x) if x.dim() == 2 else F.linear(x, self.weight, self.bias)


def native_linears_(module: torch.nn.Module) -> torch.nn.Module:
    """Run the float32 CPU ``nn.Linear`` layers of ``module`` (in place) through the native
    kernel for 2-D inputs of at most :data:`MAX_ROWS` rows; other inputs, autograd and other
    devices / dtypes take ``F.linear`` as before. The DART drafter forwards a handful of rows
    per draft. A no-op where the kernel does not run."""
    if not _AVAILABLE:
        return module
    for m in module.modules():
        if type(m) is torch.nn.Linear and _fits(m.weight):
            m.__class__ = _NativeLinear
    return module

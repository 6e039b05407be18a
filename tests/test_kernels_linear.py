"""The native small-batch linear kernel (dartcore.kernels.linear, crates/dart-linear) against
float64 products, its fallbacks and bad input, the drafter's module swap, its row
independence (a row's result does not depend on the other rows of the product, bit for bit),
and its narrow weight formats (exactly the results of the float32 values)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from dartcore.kernels.linear import (
    MAX_ROWS,
    NativeWeight,
    exact_narrow,
    native_linear_available,
    native_linear_isa,
    native_linears_,
    native_rows,
    small_linear,
)

torch.set_num_threads(1)

native = pytest.mark.skipif(
    not native_linear_available(), reason="the native kernel needs AVX-512F or AVX2 + FMA + F16C"
)

REPO = Path(__file__).resolve().parents[1]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _isa_in_subprocess(env_isa: str, code: str) -> str:
    """The stdout of ``code`` run in a fresh interpreter with DARTCORE_LINEAR_ISA=env_isa (the
    instruction set is chosen once per process)."""
    env = {**os.environ, "DARTCORE_LINEAR_ISA": env_isa, "PYTHONPATH": str(REPO / "python")}
    env.pop("DARTCORE_NATIVE_LINEAR", None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(
    not Path("/proc/cpuinfo").exists(), reason="reads the CPU's flags from /proc/cpuinfo"
)
def test_the_isa_in_use_is_the_widest_this_cpu_has():
    flags = _cpu_flags()
    if "DARTCORE_LINEAR_ISA" in os.environ or os.environ.get("DARTCORE_NATIVE_LINEAR") == "0":
        pytest.skip("the instruction set is forced from the environment")
    from dartcore import _native

    want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma", "f16c"} <= flags else None
    assert _native.linear_isa() == want == native_linear_isa()
    assert native_linear_available() == (want is not None)


@native
def test_each_isa_can_be_forced_and_the_products_stay_float64_close():
    flags = _cpu_flags()
    code = (
        "import torch, torch.nn.functional as F\n"
        "from dartcore.kernels.linear import native_linear_isa, native_rows\n"
        "g = torch.Generator().manual_seed(4)\n"
        "w, b, x = torch.randn(960, 576, generator=g), torch.randn(960, generator=g), torch.randn(16, 576, generator=g)\n"
        "ref = F.linear(x.double(), w.double(), b.double())\n"
        "tol = 1e-5 * (1 + ref.abs().max().item())\n"
        "ok = native_linear_isa() is None or all(torch.allclose(native_rows(x[:m], w, b).double(), ref[:m],"
        " atol=tol, rtol=0)"
        " and torch.equal(native_rows(x[:m], w, b)[0], native_rows(x[:1], w, b)[0]) for m in range(1, 17))\n"
        "print(native_linear_isa(), ok)"
    )
    assert _isa_in_subprocess("none", code) == "None True"
    for isa, needs in (("avx2", {"avx2", "fma", "f16c"}), ("avx512", {"avx512f"})):
        if needs <= flags:
            assert _isa_in_subprocess(isa, code) == f"{isa} True"


@native
@pytest.mark.parametrize("k, n", [(576, 960), (37, 5), (16, 1), (1536, 576)])
def test_small_linear_equals_a_float64_product_and_rows_are_independent(k, n):
    g = torch.Generator().manual_seed(k * 31 + n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(MAX_ROWS, k, generator=g)
    singles = torch.cat([native_rows(x[i : i + 1], w, b) for i in range(MAX_ROWS)])
    for rows in range(1, MAX_ROWS + 1):
        got = native_rows(x[:rows], w, b)
        assert torch.equal(small_linear(x[:rows], w, b), got)
        ref = F.linear(x[:rows].double(), w.double(), b.double())
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert torch.allclose(got.double(), ref, atol=1e-5 * (1 + ref.abs().max().item()), rtol=0)
        assert torch.equal(got, singles[:rows])  # bit for bit, whatever the other rows
    assert torch.allclose(
        native_rows(x[:3], w).double(), F.linear(x[:3].double(), w.double()), atol=1e-4
    )


def test_other_inputs_take_f_linear():
    w, b = torch.randn(7, 16), torch.randn(7)
    for x in (
        torch.randn(MAX_ROWS + 1, 16),
        torch.randn(2, 3, 16),
        torch.randn(2, 16, dtype=torch.float64),
    ):
        w_x = w.to(x.dtype)
        assert torch.allclose(
            small_linear(x, w_x, b.to(x.dtype)), F.linear(x, w_x, b.to(x.dtype)), atol=1e-5
        )
    # autograd: the native path never runs with gradients, so they flow as with F.linear
    wg = w.clone().requires_grad_()
    x = torch.randn(2, 16)
    small_linear(x, wg, b).sum().backward()
    assert torch.allclose(wg.grad, x.sum(0).expand(7, 16))
    # a transposed (non-contiguous) weight is fine too
    wt = torch.randn(16, 7).t()
    assert torch.allclose(small_linear(x, wt), F.linear(x, wt), atol=1e-5)


@native
def test_bad_shapes_are_errors_not_crashes():
    from dartcore import _native

    x, w, out = (
        np.zeros((2, 4), np.float32),
        np.zeros((3, 4), np.float32),
        np.zeros((2, 3), np.float32),
    )
    _native.linear_rows(x, w, None, out)
    with pytest.raises(ValueError, match="do not fit"):
        _native.linear_rows(x, np.zeros((3, 5), np.float32), None, out)
    with pytest.raises(ValueError, match="elements"):
        _native.linear_rows(x, w, np.zeros(2, np.float32), out)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS}"):
        _native.linear_rows(
            np.zeros((MAX_ROWS + 1, 4), np.float32),
            w,
            None,
            np.zeros((MAX_ROWS + 1, 3), np.float32),
        )
    with pytest.raises(ValueError, match="contiguous"):
        _native.linear_rows(np.zeros((4, 2), np.float32).T, w, None, out)
    with pytest.raises(ValueError, match="unknown weight format"):
        _native.linear_rows(x, w, None, out, 1, "f8")
    with pytest.raises(ValueError, match="uint16"):
        _native.linear_rows(x, w, None, out, 1, "f16")  # float32 data under a 16-bit format
    with pytest.raises(ValueError, match="float32"):
        _native.linear_rows(x, w.view(np.uint16), None, out, 1, "f32")


def test_exact_narrow_only_takes_exactly_representable_weights():
    g = torch.Generator().manual_seed(5)
    half = torch.randn(40, 24, generator=g).half().float()  # an fp16 export, loaded as float32
    brain = torch.randn(40, 24, generator=g).bfloat16().float()
    brain[0, 0] = 2.0**100  # beyond float16's range: bfloat16 only (else fp16 holds them too)
    for w, fmt, dtype in ((half, "f16", torch.float16), (brain, "bf16", torch.bfloat16)):
        bits, got = exact_narrow(w)
        assert got == fmt and bits.dtype == np.uint16 and bits.shape == (40, 24)
        assert torch.equal(torch.from_numpy(bits.view(np.int16)).view(dtype).float(), w)
    assert exact_narrow(torch.randn(40, 24, generator=g)) is None  # full float32 precision
    late = half.clone()
    late[-1, -1] += 1e-4  # the probe of the first elements passes, the whole weight does not
    assert exact_narrow(late) is None
    assert exact_narrow(half.double()) is None


@native
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrow_weights_give_the_float32_results_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(203, 576, generator=g).to(dtype).float()
    if dtype == torch.bfloat16:
        w[7, 3] = 2.0**100  # beyond float16's range (randn's bf16 values are fp16-exact too)
    b = torch.randn(203, generator=g)
    wide, narrow = NativeWeight(w, b), NativeWeight(w, b, narrow=True)
    assert (wide.format, narrow.format) == ("f32", "f16" if dtype == torch.float16 else "bf16")
    for rows in (1, 2, 5, MAX_ROWS):
        x = torch.randn(rows, 576, generator=g)
        assert torch.equal(narrow(x), wide(x))
    x = torch.randn(MAX_ROWS + 1, 576, generator=g)  # past MAX_ROWS: F.linear on the float32 weight
    assert torch.equal(narrow(x), F.linear(x, w, b))


@native
def test_native_linears_keep_parameters_and_outputs():
    from dartcore.drafter import DartDrafter

    model = tiny_model("llama", layers=6)
    drafter = DartDrafter.from_target(model, d=4).eval()
    x = torch.randn(3, drafter.fc.in_features)  # 3 rows: the native path
    before_state = {k: v.clone() for k, v in drafter.state_dict().items()}
    before = drafter.fc(x)
    native_linears_(drafter)
    assert type(drafter.fc).__name__ == "_NativeLinear" and isinstance(drafter.fc, torch.nn.Linear)
    assert all(torch.equal(v, before_state[k]) for k, v in drafter.state_dict().items())
    with torch.no_grad():
        assert torch.allclose(drafter.fc(x), before, atol=1e-5)
    # training still works through F.linear (the native path never sees gradients)
    drafter.fc(x).sum().backward()
    assert drafter.fc.weight.grad is not None
    # a replaced weight storage is picked up (no stale view of the old one)
    with torch.no_grad():
        drafter.fc.weight.data = torch.zeros_like(drafter.fc.weight)
        assert torch.equal(drafter.fc(x), torch.zeros(3, drafter.fc.out_features))
    # narrow copies (fp16-exact weights) follow in-place changes of the parameter
    native_linears_(drafter, narrow=True)
    with torch.no_grad():
        drafter.fc.weight.copy_(torch.randn_like(drafter.fc.weight).half().float())
        first = drafter.fc(x)
        assert drafter.fc.__dict__["_native_weight"][0].format == "f16"
        assert torch.equal(first, NativeWeight(drafter.fc.weight, drafter.fc.bias)(x))
        drafter.fc.weight.mul_(2)
        assert torch.equal(drafter.fc(x), NativeWeight(drafter.fc.weight, drafter.fc.bias)(x))
    # non-contiguous: F.linear
    assert NativeWeight(torch.randn(4, 4).t())(torch.randn(1, 4)).shape == (1, 4)


@native
def test_helper_threads_give_the_same_bits():
    from dartcore import _native

    g = torch.Generator().manual_seed(11)
    w, b = torch.randn(203, 96, generator=g), torch.randn(203, generator=g)
    for rows in (1, 5, MAX_ROWS):
        x = torch.randn(rows, 96, generator=g)
        outs = []
        for threads in (1, 2, 3, 1, 2):  # teams of 2 and 3 threads, each reused
            out = torch.empty(rows, 203)
            _native.linear_rows(x.numpy(), w.numpy(), b.numpy(), out.numpy(), threads)
            outs.append(out)
        assert all(torch.equal(o, outs[0]) for o in outs)


def test_block_attention_splits_heads_between_threads_with_the_same_bits():
    from dartcore import _native

    g = torch.Generator().manual_seed(12)
    heads, kv, d, n, prefix, capacity = 9, 3, 64, 5, 37, 48
    qkv = torch.randn(n, (heads + 2 * kv) * d, generator=g)
    cos, sin = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    mask = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 0, 1]],
        dtype=torch.bool,
    )
    k0, v0 = torch.randn(kv, capacity, d, generator=g), torch.randn(kv, capacity, d, generator=g)
    results = []
    for threads in (1, 2, 3, 2):
        k, v, out = k0.clone(), v0.clone(), torch.empty(n, heads * d)
        _native.block_attention(
            qkv.numpy(),
            heads,
            kv,
            cos.numpy(),
            sin.numpy(),
            k.numpy(),
            v.numpy(),
            prefix,
            mask.numpy(),
            d**-0.5,
            out.numpy(),
            threads=threads,
        )
        results.append((out, k, v))
    for out, k, v in results[1:]:
        assert (
            torch.equal(out, results[0][0])
            and torch.equal(k, results[0][1])
            and torch.equal(v, results[0][2])
        )


def test_torch_threads_sets_and_restores_even_on_error():
    from dartcore.kernels.linear import torch_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), torch_threads(1):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

#!/usr/bin/env python3
"""Tree attention on CUDA: the Triton kernel against the PyTorch reference and
SDPA with a dense boolean mask, for the tree sizes and prefixes decoding uses.

For each (model shape, prefix, tree nodes, dtype): median kernel time of each
implementation (``triton.testing.do_bench``, CUDA events) and the Triton kernel's
largest error against a float64 evaluation of the same attention, on fresh random
inputs and random trees. Needs a CUDA device (the reference alone runs anywhere,
but there is nothing to compare on CPU).

    python tools/bench_tree_attention.py --json --out artifacts/bench_tree_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen3-8b": (32, 8, 128)}  # heads, kv heads, head dim
PREFIXES = (256, 2048, 8192)
NODES = (1, 8, 32, 60, 128)
DTYPES = ("float32", "bfloat16")


def _tree_mask(n: int, rng: np.random.Generator) -> torch.Tensor:
    from dartcore.acceptance import ancestor_mask

    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    return torch.from_numpy(ancestor_mask(parents))


def _sdpa(q, k, v, prefix, mask, scale):
    n = q.shape[1]
    full = torch.ones(n, prefix + n, dtype=torch.bool, device=q.device)
    full[:, prefix:] = mask
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=full, scale=scale, enable_gqa=q.shape[0] != k.shape[0]
    )[0]


def _exact(q, k, v, prefix, mask, scale):
    """Float64 attention with the kv heads expanded (the independent reference)."""
    group = q.shape[0] // k.shape[0]
    k64 = k.double().repeat_interleave(group, 0)
    v64 = v.double().repeat_interleave(group, 0)
    scores = (q.double() @ k64.transpose(1, 2)) * scale
    scores[..., prefix:].masked_fill_(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v64


def _cpu_bench(fn, warmup: int, rep: int, return_mode: str) -> float:
    """do_bench's interface for --device cpu (TRITON_INTERPRET=1 dry runs): median ms."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def run(shapes, prefixes, nodes, dtypes, seed: int = 0, device: str = "cuda") -> list[dict]:
    if device == "cpu":
        do_bench = _cpu_bench
    else:
        from triton.testing import do_bench

    from dartcore.kernels.tree_attention import (
        pack_block_mask,
        tree_attention_reference,
    )
    from dartcore.kernels.triton_tree import tree_attention_triton

    rng = np.random.default_rng(seed)
    rows = []
    for name, (heads, kv_heads, d) in shapes.items():
        for prefix in prefixes:
            for n in nodes:
                for dtype_name in dtypes:
                    dtype = getattr(torch, dtype_name)
                    g = torch.Generator(device=device).manual_seed(int(rng.integers(1 << 31)))
                    q = torch.randn(heads, n, d, device=device, dtype=dtype, generator=g)
                    k = torch.randn(
                        kv_heads, prefix + n, d, device=device, dtype=dtype, generator=g
                    )
                    v = torch.randn(
                        kv_heads, prefix + n, d, device=device, dtype=dtype, generator=g
                    )
                    mask = _tree_mask(n, rng).to(device)
                    bits = pack_block_mask(mask)
                    scale = d**-0.5
                    out = tree_attention_triton(q, k, v, prefix, bits, scale=scale)
                    exact = _exact(q, k, v, prefix, mask, scale)
                    err = float((out.double() - exact).abs().max())
                    ref_err = float(
                        (
                            tree_attention_reference(q, k, v, prefix, mask, scale=scale).double()
                            - exact
                        )
                        .abs()
                        .max()
                    )
                    timings = {
                        "triton_us": do_bench(
                            partial(tree_attention_triton, q, k, v, prefix, bits, scale=scale),
                            warmup=10,
                            rep=40,
                            return_mode="median",
                        )
                        * 1e3,
                        "reference_us": do_bench(
                            partial(tree_attention_reference, q, k, v, prefix, mask, scale=scale),
                            warmup=10,
                            rep=40,
                            return_mode="median",
                        )
                        * 1e3,
                        "sdpa_dense_mask_us": do_bench(
                            partial(_sdpa, q, k, v, prefix, mask, scale),
                            warmup=10,
                            rep=40,
                            return_mode="median",
                        )
                        * 1e3,
                    }
                    rows.append(
                        {
                            "shape": name,
                            "heads": heads,
                            "kv_heads": kv_heads,
                            "head_dim": d,
                            "prefix": prefix,
                            "nodes": n,
                            "dtype": dtype_name,
                            "triton_max_err": err,
                            "reference_max_err": ref_err,
                            **timings,
                        }
                    )
                    print(
                        f"{name} prefix {prefix} nodes {n} {dtype_name}: "
                        + ", ".join(f"{key} {val:.1f}" for key, val in timings.items())
                        + f", err {err:.2e}",
                        file=sys.stderr,
                    )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| shape | dtype | prefix | nodes | Triton µs | reference µs | SDPA (dense mask) µs | "
        "Triton max err | reference max err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['prefix']} | {r['nodes']} | {r['triton_us']:.1f} | "
            f"{r['reference_us']:.1f} | {r['sdpa_dense_mask_us']:.1f} | {r['triton_max_err']:.1e} | "
            f"{r['reference_max_err']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"from {', '.join(SHAPES)}")
    p.add_argument("--prefixes", default=",".join(map(str, PREFIXES)))
    p.add_argument("--nodes", default=",".join(map(str, NODES)))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--json", action="store_true", help="print the JSON rows on stdout")
    # cpu: TRITON_INTERPRET=1 dry run
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench_tree_attention: needs a CUDA device (the Triton kernel runs on GPUs; "
            "tests/test_kernels_tree_attention.py checks it in the interpreter on CPU)",
            file=sys.stderr,
        )
        return 2
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    rows = run(
        shapes,
        [int(x) for x in args.prefixes.split(",")],
        [int(x) for x in args.nodes.split(",")],
        args.dtypes.split(","),
        device=args.device,
    )
    report = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "rows": rows,
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - the benchmark imported it already
        pass
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    print(table(rows))
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""One Gated DeltaNet layer over a draft tree on CUDA: the Triton tree kernels
(dartcore.kernels.triton_delta) on an n-node tree against the same kernels on a chain of n nodes
and of the tree's depth, Hugging Face's one-token functions level by level (the torch reference
form), and Hugging Face's chunked form on the chain (``flash-linear-attention`` where installed).

Per (head shape, nodes, dtype): median time of each (``triton.testing.do_bench``) and the
kernels' largest difference from the reference. ``--device cpu`` (with ``TRITON_INTERPRET=1``) is
a dry run of the same steps on tiny shapes.

    python3 tools/bench_delta_tree.py --out artifacts/bench_delta_tree.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# DeltaNet heads: key heads, value heads, key dim, value dim, conv kernel (Qwen3-Next-80B-A3B's
# published values: tools/bench_hybrid_verify.py PUBLISHED; Qwen3.5-4B's DeltaNet is the same)
SHAPES = {"qwen3-next-80b-a3b": (16, 32, 128, 128, 4), "tiny": (2, 4, 8, 8, 4)}
TREES = ((8, 3), (16, 4), (32, 5), (64, 6))  # nodes, depth


def shaped_parents(nodes: int, depth: int, seed: int) -> np.ndarray:
    """A tree of ``nodes`` nodes and ``depth`` levels below the root (a spine first, the rest
    hung at random levels), nodes in depth order."""
    rng = np.random.default_rng(seed)
    parents, depths = [-1] + list(range(depth)), list(range(depth + 1))
    while len(parents) < nodes:
        p = int(rng.integers(0, len(parents)))
        if depths[p] < depth:
            parents.append(p)
            depths.append(depths[p] + 1)
    order = np.argsort(np.asarray(depths), kind="stable")
    new = np.empty(len(order), dtype=np.int64)
    new[order] = np.arange(len(order))
    par = np.asarray(parents)[order]
    return np.where(par >= 0, new[np.maximum(par, 0)], -1)


def _cpu_bench(fn, **_kw) -> float:
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def _case(device, do_bench, hk, hv, dk, dv, K, nodes, depth, dtype) -> tuple[float, dict]:
    """One (shape, tree, dtype): the kernels' largest relative difference from the reference, and
    each form's median time in microseconds."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from dartcore.kernels.triton_delta import tree_conv_triton, tree_delta_rule_triton

    C = 2 * hk * dk + hv * dv
    gen = torch.Generator(device).manual_seed(nodes)
    x = torch.randn(nodes, C, device=device, generator=gen).to(dtype)
    c0 = torch.randn(C, K, device=device, generator=gen).to(dtype)
    w = torch.randn(C, K, device=device, generator=gen).to(dtype) / K
    g = -torch.rand(nodes, hv, device=device, generator=gen)
    beta = torch.rand(nodes, hv, device=device, generator=gen).to(dtype)
    s0 = torch.randn(hv, dk, dv, device=device, generator=gen)

    def split(co):
        a, b, c = torch.split(co, [hk * dk, hk * dk, hv * dv], -1)
        m = co.shape[0]
        return a.reshape(m, hk, dk), b.reshape(m, hk, dk), c.reshape(m, hv, dv)

    def kernels(parents, x=x, g=g, beta=beta):
        co, _ = tree_conv_triton(x, parents, c0, w, None, "silu")
        q, k, v = split(co)
        return tree_delta_rule_triton(q, k, v, g, beta, parents, s0)

    def levels(parents, x=x, g=g, beta=beta):
        """HF's one-token functions, all nodes of a depth together."""
        depthv = np.zeros(len(parents), dtype=np.int64)
        for i, p in enumerate(parents):
            depthv[i] = 0 if p < 0 else depthv[p] + 1
        convs = torch.empty(len(parents), C, K, dtype=dtype, device=device)
        recs = torch.empty(len(parents), hv, dk, dv, device=device)
        out = torch.empty(len(parents), hv, dv, dtype=dtype, device=device)
        for d in range(int(depthv.max()) + 1):
            idx = torch.from_numpy(np.flatnonzero(depthv == d)).to(device)
            par = torch.from_numpy(parents[np.flatnonzero(depthv == d)]).to(device)
            cs = c0[None].expand(len(idx), -1, -1).clone() if d == 0 else convs[par]
            st = s0[None].expand(len(idx), -1, -1, -1) if d == 0 else recs[par]
            co = hf.causal_conv1d_update(x[idx][:, :, None], cs, w, None, "silu")
            q, k, v = split(co[:, :, 0])
            o, s = hf.torch_recurrent_gated_delta_rule(
                q[:, None],
                k[:, None],
                v[:, None],
                g=g[idx][:, None],
                beta=beta[idx][:, None],
                initial_state=st,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            convs[idx], recs[idx], out[idx] = cs, s.float(), o[:, 0]
        return out, recs

    def chunked(n):
        """HF's chunked prefill form on a chain of n nodes."""
        full = torch.cat([c0[None], x[:n].t()[None]], dim=-1)
        co = hf.causal_conv1d_fn(full, w, None, activation="silu")[:, :, -n:]
        q, k, v = split(co[0].t())
        return hf.torch_chunk_gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g=g[None, :n],
            beta=beta[None, :n],
            initial_state=s0[None].clone(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    tree = shaped_parents(nodes, depth, seed=nodes)
    chain = np.arange(-1, nodes - 1)
    short = np.arange(-1, depth)
    got, want = kernels(tree), levels(tree)
    err = max(
        float((a.float() - b.float()).abs().max() / max(1.0, b.float().abs().max()))
        for a, b in zip(got, want)
    )
    bench = dict(warmup=10, rep=50, return_mode="median")
    us = {
        "triton_tree_us": do_bench(lambda: kernels(tree), **bench) * 1e3,
        "triton_chain_same_nodes_us": do_bench(lambda: kernels(chain), **bench) * 1e3,
        "triton_chain_same_depth_us": do_bench(
            lambda: kernels(short, x=x[: depth + 1], g=g[: depth + 1], beta=beta[: depth + 1]),
            **bench,
        )
        * 1e3,
        "torch_levels_tree_us": do_bench(lambda: levels(tree), **bench) * 1e3,
        "hf_chunked_chain_same_nodes_us": do_bench(lambda: chunked(nodes), **bench) * 1e3,
    }
    return err, {k: round(v, 2) for k, v in us.items()}


def run(shapes, trees, dtypes, device: str) -> list[dict]:
    if device == "cpu":
        do_bench = _cpu_bench
    else:
        from triton.testing import do_bench
    rows = []
    for name, (hk, hv, dk, dv, K) in shapes.items():
        for nodes, depth in trees:
            for dtype_name in dtypes:
                err, us = _case(
                    device, do_bench, hk, hv, dk, dv, K, nodes, depth, getattr(torch, dtype_name)
                )
                row = {
                    "shape": name,
                    "nodes": nodes,
                    "depth": depth,
                    "dtype": dtype_name,
                    "max_rel_err_vs_reference": err,
                    **us,
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    shapes = {"tiny": SHAPES["tiny"]} if args.device == "cpu" else SHAPES
    trees = TREES[:2] if args.device == "cpu" else TREES
    try:
        import fla  # noqa: F401

        chunked_by = "flash-linear-attention"
    except ImportError:
        chunked_by = "transformers torch form"
    report = {
        "command": "python3 tools/bench_delta_tree.py " + " ".join(argv or sys.argv[1:]),
        "machine": {
            "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },
        "hf_chunked_by": chunked_by,
        "rows": run(shapes, trees, args.dtypes.split(","), args.device),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

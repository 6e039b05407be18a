#!/usr/bin/env python3
"""Verify cost on a hybrid target (Gated DeltaNet + full attention, ``qwen3_next``): one
:class:`~dartcore.models.hybrid.HybridTarget` forward over an n-node tree against a chain of the
same depth and a single step, after a cached prefix, on random-weight configs (CPU, float32).

    python3 tools/bench_hybrid_verify.py --threads 1 --json tools/reports/bench_hybrid_verify.json

Each block is a forward of its rows after ``--prefix`` committed tokens without the LM head
(the CPU decoder computes logits lazily), median of ``--repeats`` after two warm-up calls; the
shapes and the DeltaNet tree forms (``--forms``: ``parallel``, the chunked form under the tree's
ancestor mask; ``recurrent``, HF's one-token step level by level, every node's state formed)
alternate per repeat so machine noise hits them alike. ``--products``: the blocks' products
through dartcore's native small-batch kernel (HybridTarget's default on a float32 CPU where it
runs) or torch's.

``--memory``: no timing; the bytes each tree node's staged states take per Gated DeltaNet layer
and per model for the published configs in :data:`PUBLISHED`
(``dartcore.models.hybrid.state_bytes_per_node``):

    python3 tools/bench_hybrid_verify.py --memory --json tools/reports/hybrid_state_bytes.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

CONFIGS = {
    # the tests' tiny config
    "tiny": dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    # Qwen3-Next's head shapes (DeltaNet 8 key / 16 value heads of 128, attention heads of
    # 128) at a quarter of its width, 3 DeltaNet layers per full-attention layer
    "medium": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
    ),
}

# Published configs (the text config's fields that the states depend on), for --memory.
PUBLISHED = {
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (huggingface.co): hidden_size 2048, head_dim
    # 256, linear_conv_kernel_dim 4, linear_key_head_dim 128, linear_num_key_heads 16,
    # linear_num_value_heads 32, linear_value_head_dim 128, full_attention_interval 4; 48 layers
    # of 16 attention heads over 2 key/value heads (THUDM/slime scripts/models/
    # qwen3-next-80B-A3B.sh: --num-layers 48 --num-attention-heads 16 --num-query-groups 2
    # --kv-channels 256; transformers' Qwen3NextConfig defaults, documented as that model's,
    # agree). bfloat16 weights.
    "Qwen3-Next-80B-A3B": dict(
        hidden_size=2048,
        num_hidden_layers=48,
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
    ),
    # Qwen3.5-4B: hidden_size 2560, 32 layers, 16 attention heads over 4 key/value heads of 256
    # (the Qwen3.5-4B model card's figures, as restated by kshitijthakkar/qwen3.5-moe-4.7B-d4B's
    # README, whose backbone is Qwen3.5-4B's); the DeltaNet fields from a Qwen3_5ForCausalLM
    # config.json of those dimensions (huggingface.co/halen214/st01): linear_conv_kernel_dim 4,
    # 16 key / 32 value heads of 128, full_attention_interval 4. Qwen's own config.json for
    # Qwen/Qwen3.5-4B was not among the sources read: these are a copy's values.
    "Qwen3.5-4B": dict(
        hidden_size=2560,
        num_hidden_layers=32,
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
    ),
}


def memory_report(argv) -> dict:
    """Bytes per tree node of the published configs' states (no model is built)."""
    from dartcore.models.hybrid import state_bytes_per_node

    models = {}
    for name, cfg in PUBLISHED.items():
        b = state_bytes_per_node(cfg)  # bfloat16 conv windows and KV, float32 recurrent states
        b["state_mib_per_node"] = round(b["state_bytes_per_node"] / 2**20, 2)
        b["state_mib_16_node_tree"] = round(16 * b["state_bytes_per_node"] / 2**20, 1)
        b["kv_kib_per_node"] = round(b["kv_bytes_per_node"] / 2**10, 1)
        models[name] = {"config": cfg, **b}
        print(
            f"{name}: {b['linear_layers']} DeltaNet layers x "
            f"{b['state_bytes_per_layer']:,} B (conv {b['conv_bytes_per_layer']:,} + recurrent "
            f"{b['recurrent_bytes_per_layer']:,}) = {b['state_mib_per_node']} MiB per node "
            f"({b['state_mib_16_node_tree']} MiB for 16 nodes); KV {b['kv_kib_per_node']} KiB"
        )
    return {
        "command": "python3 tools/bench_hybrid_verify.py " + " ".join(argv),
        "machine": machine(),
        "dtypes": {"conv": "bfloat16", "recurrent": "float32", "kv": "bfloat16"},
        "models": models,
    }


def machine() -> dict:
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("", platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx512f", "avx512_vnni", "avx2", "fma", "f16c") if f in flags]
    import torch
    import transformers

    return {
        "cpu": cpu,
        "vcpus": os.cpu_count(),
        "isa": " ".join(isa) or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def shaped_tree(nodes: int, depth: int, seed: int):
    """A tree of ``nodes`` nodes (root included) of exactly ``depth`` levels below the root:
    a spine of ``depth`` nodes, the rest hung at random levels, in depth order."""
    import numpy as np

    from dartcore.tree import Tree

    rng = np.random.default_rng(seed)
    parents, depths = [-1], [0]
    for d in range(1, depth + 1):
        parents.append(d - 1), depths.append(d)
    while len(parents) < nodes:
        p = int(rng.integers(0, len(parents)))
        if depths[p] < depth:
            parents.append(p), depths.append(depths[p] + 1)
    order = np.argsort(np.asarray(depths), kind="stable")
    new = np.empty(len(order), dtype=np.int64)
    new[order] = np.arange(len(order))
    par = np.asarray(parents)[order]
    par = np.where(par >= 0, new[np.maximum(par, 0)], -1)
    toks = rng.integers(3, 60, size=len(order))
    return Tree(toks.astype(np.int64), par.astype(np.int64), np.asarray(depths)[order])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,medium")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--shapes", default="1:0,5:4,8:4,16:4,32:4,9:8,16:8", help="nodes:depth,...")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--forms", default="parallel,recurrent", help="HybridTarget tree_form values")
    p.add_argument(
        "--products",
        choices=("default", "native", "torch"),
        default="default",
        help="the 1-16 row products: the native kernel, torch's, or HybridTarget's default",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="only the bytes per tree node of the published configs' states (no timing)",
    )
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    if args.memory:
        report = memory_report(argv if argv is not None else sys.argv[1:])
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        return 0

    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    from dartcore.models.hybrid import HybridTarget
    from dartcore.tree import ancestor_mask

    torch.set_num_threads(args.threads)
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    report = {
        "command": "python3 tools/bench_hybrid_verify.py " + " ".join(argv or sys.argv[1:]),
        "machine": {**machine(), "torch_threads": args.threads},
        "prefix": args.prefix,
        "repeats": args.repeats,
        "configs": {},
    }
    for name in args.configs.split(","):
        kw = CONFIGS[name]
        cfg = Qwen3NextConfig(
            **kw,
            num_hidden_layers=len(kw["layer_types"]),
            linear_conv_kernel_dim=4,
            num_experts=0,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        native = None if args.products == "default" else args.products == "native"
        target = HybridTarget(model, native_products=native)
        cache = target.new_cache(args.prefix + 64)
        prompt = torch.randint(3, 60, (args.prefix,))
        target.forward(cache, prompt, torch.arange(args.prefix), logits_rows=slice(0, 0))
        cache.commit(args.prefix)
        blocks = []
        for nodes, depth in shapes:
            tree = shaped_tree(nodes, depth, seed=nodes * 31 + depth)
            blocks.append(
                (
                    f"{nodes}n/d{depth}",
                    torch.from_numpy(tree.tokens),
                    torch.from_numpy(tree.depths + args.prefix),
                    torch.from_numpy(ancestor_mask(tree.parents)),
                )
            )
        forms = args.forms.split(",")
        times = {(f, b[0]): [] for f in forms for b in blocks}
        for rep in range(args.repeats + 2):
            for form in forms:
                target.tree_form = form
                for label, toks, pos, mask in blocks:
                    t = time.perf_counter()
                    target.forward(cache, toks, pos, mask, logits_rows=slice(0, 0))
                    if rep >= 2:
                        times[form, label].append(time.perf_counter() - t)
        params = sum(p.numel() for p in model.parameters())
        out = {
            "params": params,
            "layer_types": kw["layer_types"],
            "native_products": target.native_products,
            "forms": {},
        }
        print(f"== {name} ({params / 1e6:.1f} M params, native products {target.native_products})")
        for form in forms:
            rows = {}
            for (nodes, depth), (label, *_rest) in zip(shapes, blocks):
                ms = statistics.median(times[form, label]) * 1e3
                rows[label] = {"nodes": nodes, "depth": depth, "ms": round(ms, 3)}
            step = rows[blocks[0][0]]["ms"]
            for row in rows.values():
                row["x_single_step"] = round(row["ms"] / step, 2)
                chain = next(
                    (
                        r
                        for r in rows.values()
                        if r["depth"] == row["depth"] and r["nodes"] == r["depth"] + 1
                    ),
                    None,
                )
                if chain is not None:
                    row["x_chain_same_depth"] = round(row["ms"] / chain["ms"], 2)
            out["forms"][form] = rows
            print(f"  tree_form={form}")
            for label, row in rows.items():
                extra = (
                    f"  x chain {row['x_chain_same_depth']}" if "x_chain_same_depth" in row else ""
                )
                print(f"  {label:>8}: {row['ms']:8.2f} ms  x step {row['x_single_step']}{extra}")
        report["configs"][name] = out
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Target forward cost per block size for the CPU weight layouts, measured side by side in one
process: the HF layout (``TargetModel(fuse_cpu_weights=False)``), fused column-major for MKL
(``native_linear=False``) and fused row-major through dartcore's native small-batch kernel
(``native_linear=True``, where the CPU has AVX-512F or AVX2 + FMA + F16C).

    python3 tools/bench_verify_layout.py --threads 2 [--logits] [--json]

A forward of n new rows after --prefix cached tokens (SmolLM2-135M-Instruct, fp32, CPU), without
the LM head unless ``--logits`` (then every row's logits, as the decoder computes them on the
native path), median of --repeats after two warm-up calls; the layouts alternate per block size
so machine noise hits them alike. ``--threads`` sets torch's threads; the native kernel runs on
as many (``DARTCORE_LINEAR_THREADS`` overrides).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--sizes", default="1,2,3,4,6,8,12,16,24,32")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--logits", action="store_true", help="include every row's LM-head logits")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch

    from dartcore.kernels.linear import native_linear_available
    from dartcore.models.hub import load_target
    from dartcore.models.transformer import TargetModel

    torch.set_num_threads(args.threads)
    models = {
        "row-major (HF layout)": TargetModel(
            load_target(args.target, quantized=False)[0], fuse_cpu_weights=False
        ),
        "fused column-major (MKL)": TargetModel(
            load_target(args.target, quantized=False)[0], native_linear=False
        ),
    }
    if native_linear_available():
        models["fused row-major (native)"] = TargetModel(
            load_target(args.target, quantized=False)[0], native_linear=True
        )
    logits_rows = None if args.logits else slice(0, 0)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 1000, (args.prefix,), generator=gen)
    caches = {}
    for name, tm in models.items():
        cache = tm.new_cache(args.prefix + 64)
        tm.forward(cache, prefix, torch.arange(args.prefix), logits_rows=slice(0, 0))
        cache.commit(args.prefix)
        caches[name] = cache
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        toks = torch.randint(0, 1000, (n,), generator=gen)
        pos = torch.arange(args.prefix, args.prefix + n)
        mask = torch.ones(n, n, dtype=torch.bool).tril_()
        times = {name: [] for name in models}
        for r in range(args.repeats + 2):
            for name, tm in models.items():
                t = time.perf_counter()
                tm.forward(caches[name], toks, pos, mask, logits_rows=logits_rows)
                if r >= 2:
                    times[name].append(time.perf_counter() - t)
        rows.append({"rows": n, **{name: statistics.median(v) * 1e3 for name, v in times.items()}})
    names = list(models)
    base = {name: rows[0][name] for name in names}
    if args.json:
        print(
            json.dumps(
                {"threads": args.threads, "prefix": args.prefix, "logits": args.logits, "ms": rows}
            )
        )
        return 0
    what = "with every row's logits" if args.logits else "without the LM head"
    print(
        f"target forward ms {what} (prefix {args.prefix}, {args.threads} torch threads; x = cost / own 1-row cost)"
    )
    print("| rows | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for r in rows:
        print(
            f"| {r['rows']} | "
            + " | ".join(f"{r[n]:.1f} ({r[n] / base[n]:.2f}x)" for n in names)
            + " |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

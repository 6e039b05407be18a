#!/usr/bin/env python3
"""Target forward cost per block size with and without the fused column-major CPU weights
(``TargetModel(fuse_cpu_weights=...)``), measured side by side in one process.

    python3 tools/bench_verify_layout.py --threads 2 [--json]

A forward of n new rows after --prefix cached tokens (SmolLM2-135M-Instruct, fp32, CPU, no LM
head: the decoder's lazy logits compute it per accepted row), median of --repeats after two
warm-up calls; the two layouts alternate per block size so machine noise hits both alike.
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
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch

    from dartcore.models.hub import load_target
    from dartcore.models.transformer import TargetModel

    torch.set_num_threads(args.threads)
    models = {"row-major (HF layout)": TargetModel(load_target(args.target)[0], fuse_cpu_weights=False),
              "fused column-major": TargetModel(load_target(args.target)[0], fuse_cpu_weights=True)}
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
                tm.forward(caches[name], toks, pos, mask, logits_rows=slice(0, 0))
                if r >= 2:
                    times[name].append(time.perf_counter() - t)
        rows.append({"rows": n, **{name: statistics.median(v) * 1e3 for name, v in times.items()}})
    names = list(models)
    base = {name: rows[0][name] for name in names}
    if args.json:
        print(json.dumps({"threads": args.threads, "prefix": args.prefix, "ms": rows}))
        return 0
    print(f"target forward ms (prefix {args.prefix}, {args.threads} threads; x = cost / own 1-row cost)")
    print("| rows | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for r in rows:
        print(f"| {r['rows']} | " + " | ".join(f"{r[n]:.1f} ({r[n] / base[n]:.2f}x)" for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

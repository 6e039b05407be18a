#!/usr/bin/env python3
"""Speedup over AR per tree budget, interleaved in one process (the CPU budget choice).

For every prompt, AR and each (builder, budget) decoder run back to back, so machine noise
hits all of them alike; the output must equal AR's (greedy) or the script says MISMATCH.

    python3 tools/bench_budgets.py --index artifacts/demo/smollm2.idx            # after the demo
    python3 tools/bench_budgets.py --index smollm2.idx --budgets 4,6,8 --trees dart,dart+ngram --json
    python3 tools/bench_budgets.py --index artifacts/demo/smollm2.idx --quantized --budgets 1,2,3,4 --trees dart \
        --datasets builtin --n 5 --max-new-tokens 128                                  # block weights
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="smollm2")
    p.add_argument(
        "--quantized", action="store_true", help="the target's GGUF blocks (smollm2: its Q4_1 file)"
    )
    p.add_argument(
        "--numerics",
        choices=("int8", "exact"),
        default="int8",
        help="with --quantized: the block products' numerics (int8 falls back to exact where "
        "the integer kernels do not run)",
    )
    p.add_argument("--index", required=True)
    p.add_argument("--budgets", default="4,6,8")
    p.add_argument("--trees", default="dart,dart+ctx,dart+ngram")
    p.add_argument("--datasets", default="humaneval,gsm8k,code_alpaca")
    p.add_argument("--n", type=int, default=3, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch

    from dartcore import DartDecoder, NgramIndex
    from dartcore.benchmark.datasets import load_prompts
    from dartcore.models.hub import load_drafter, load_target

    torch.set_num_threads(args.threads)
    numerics = args.numerics
    if args.quantized and numerics == "int8":
        from dartcore.kernels.linear import int8_kernel

        numerics = "int8" if int8_kernel() is not None else "exact"
    model, tok = load_target(
        args.target, quantized=args.quantized, numerics=numerics if args.quantized else "exact"
    )
    drafter = load_drafter(args.drafter, model, tok)
    index = NgramIndex(args.index)
    decoders = {"ar": DartDecoder(model, tok, tree="ar")}
    for b in [int(x) for x in args.budgets.split(",")]:
        for tree in args.trees.split(","):
            decoders[f"{tree}@{b}"] = DartDecoder(
                model, tok, drafter, index, tree=tree, max_nodes=b
            )
    prompts = [m for ds in args.datasets.split(",") for m in load_prompts(ds.strip(), args.n)]
    for dec in decoders.values():  # warm-up
        dec.generate(prompts[0], max_new_tokens=8)
    secs = {k: [] for k in decoders}
    taus = {k: [] for k in decoders}
    identical = True
    for messages in prompts:
        ref = None
        for name, dec in decoders.items():
            res = dec.generate(messages, max_new_tokens=args.max_new_tokens)
            secs[name].append(res.stats.total_s)
            taus[name].append(res.stats.tau)
            if ref is None:
                ref = res.tokens
            elif res.tokens != ref:
                identical = False
                print(f"MISMATCH: {name} differs from AR", file=sys.stderr)
    rows = []
    for name in decoders:
        speedups = [a / b for a, b in zip(secs["ar"], secs[name])]
        rows.append(
            {
                "method": name,
                "tau": statistics.mean(taus[name]),
                "speedup_median": statistics.median(speedups),
                "speedup_mean": statistics.mean(speedups),
            }
        )
    if args.json:
        from dartcore.benchmark.runner import machine_info

        print(
            json.dumps(
                {
                    "command": "python3 tools/bench_budgets.py " + " ".join(sys.argv[1:]),
                    "machine": {**machine_info(), "threads": args.threads},
                    "target": f"{args.target} ({'GGUF blocks' if args.quantized else 'float32'})",
                    "numerics": numerics if args.quantized else "exact",
                    "drafter": args.drafter,
                    "max_new_tokens": args.max_new_tokens,
                    "prompts": len(prompts),
                    "threads": args.threads,
                    "greedy_identical": identical,
                    "rows": rows,
                }
            )
        )
        return 0 if identical else 1
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {args.threads} threads, T = 0")
    print("| method@budget | τ | speedup median | speedup mean |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['tau']:.2f} | {r['speedup_median']:.2f}× | {r['speedup_mean']:.2f}× |"
        )
    print(f"greedy identical to AR: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Tree builders compared on the same prompts: τ, tokens/s, speedup over plain AR, stage
times and per-position acceptance Pr(L ≥ t) for tree = ar | dart | dartree | hybrid | ddtree.

    python3 tools/bench_trees.py --drafter smollm2 --index artifacts/dolma.idx \\
        --datasets gsm8k humaneval --n 4 --max-new-tokens 96

Prints a table, writes one JSON row per (dataset, method) with the benchmark schema of
tools/bench_decode.py (dataset, method, temperature, tau, tok_per_s, speedup, seconds per
stage, plus the acceptance curve), a PNG of the acceptance curves and, with ``--report``,
the markdown table. Greedy runs also check every output against plain AR decoding
(``same_as_ar``). CPU, small n: numbers are for comparing builders with each other.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "eval"
METHODS = ("ar", "dart", "dartree", "hybrid", "ddtree")


def load_prompts(name: str, n: int) -> list[list[dict]]:
    """The first ``n`` prompts of an eval set as chat messages."""
    if name == "gsm8k":
        with open(DATA / "gsm8k_test.jsonl") as f:
            recs = [json.loads(line) for line, _ in zip(f, range(n))]
        texts = [r["question"] for r in recs]
    elif name == "humaneval":
        with gzip.open(DATA / "humaneval.jsonl.gz", "rt") as f:
            recs = [json.loads(line) for line, _ in zip(f, range(n))]
        texts = ["Complete this Python function.\n\n" + r["prompt"] for r in recs]
    elif name == "code_alpaca":
        recs = json.loads((DATA / "code_alpaca_2k.json").read_text())[:n]
        texts = [r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "") for r in recs]
    else:
        raise SystemExit(f"unknown dataset {name!r} (gsm8k, humaneval, code_alpaca)")
    return [[{"role": "user", "content": t}] for t in texts]


def accept_curve(hist: list[int], d: int) -> list[float]:
    """Pr(L ≥ t) for t = 1..d from a histogram of accepted drafted tokens per round."""
    rounds = sum(hist)
    if rounds == 0:
        return [0.0] * d
    return [sum(hist[t:]) / rounds for t in range(1, d + 1)]


def run_method(decoder, prompts, *, max_new_tokens: int, temperature: float, seed: int):
    outs, stats = [], []
    for i, p in enumerate(prompts):
        r = decoder.generate(p, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
        outs.append(r.tokens)
        stats.append(r.stats)
    return outs, stats


def aggregate(stats, d: int) -> dict:
    hist: list[int] = []
    for s in stats:
        for a, c in enumerate(s.accept_hist):
            if len(hist) <= a:
                hist.extend([0] * (a + 1 - len(hist)))
            hist[a] += c
    rounds = sum(hist)
    new = sum(s.new_tokens for s in stats)
    total = sum(s.total_s for s in stats)
    seconds = {k: sum(s.seconds.get(k, 0.0) for s in stats) for k in stats[0].seconds}
    return {
        "tau": sum((a + 1) * c for a, c in enumerate(hist)) / rounds if rounds else 0.0,
        "tok_per_s": new / total if total else 0.0,
        "new_tokens": new,
        "rounds": rounds,
        "total_s": total,
        "seconds": seconds,
        "ms_per_round": {k: 1e3 * v / max(rounds, 1) for k, v in seconds.items() if k != "prefill"},
        "accept_hist": hist,
        "accept_curve": accept_curve(hist, d),
    }


def plot(rows: list[dict], path: Path, d: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r["dataset"] for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for r in rows:
            if r["dataset"] != ds or r["method"] == "ar":
                continue
            ax.plot(range(1, d + 1), r["accept_curve"], marker="o", label=f"{r['method']} (τ={r['tau']:.2f})")
        ax.set_title(f"{ds}, T={rows[0]['temperature']}")
        ax.set_xlabel("t (draft position)")
        ax.set_ylabel("Pr(L ≥ t)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows: list[dict]) -> str:
    head = ("| dataset | method | τ | tok/s | speedup | draft ms | search ms | verify ms | "
            "Pr(L≥1) | Pr(L≥2) | Pr(L≥4) | same as AR |")
    lines = [head, "|" + "|".join(["---"] * 12) + "|"]
    for r in rows:
        ms = r["ms_per_round"]
        c = r["accept_curve"] + [0.0] * 4
        same = "—" if r["same_as_ar"] is None else ("yes" if r["same_as_ar"] else "NO")
        lines.append(f"| {r['dataset']} | {r['method']} | {r['tau']:.2f} | {r['tok_per_s']:.1f} | "
                     f"{r['speedup']:.2f}× | {ms.get('draft', 0):.1f} | {ms.get('search', 0):.1f} | "
                     f"{ms.get('verify', 0):.1f} | {c[0]:.2f} | {c[1]:.2f} | {c[3]:.2f} | {same} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default="smollm2", help="drafter directory or built-in name")
    ap.add_argument("--index", default=None, help="n-gram index file (needed by dart and hybrid)")
    ap.add_argument("--head", default=None, help="correction head directory / name (default: built-in)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval"])
    ap.add_argument("--n", type=int, default=4, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-nodes", type=int, default=None, help="node budget for every tree (default: each builder's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default="tools/reports/bench_trees.json")
    ap.add_argument("--png", default="tools/reports/dartree_acceptance.png")
    ap.add_argument("--report", default=None, help="write the markdown table here")
    args = ap.parse_args(argv)

    import torch

    from dartcore import DartDecoder
    from dartcore.drafter import DartDrafter
    from dartcore.models.hub import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.target)
    drafter = DartDrafter.from_pretrained(args.drafter, model)
    index = None
    if args.index:
        from dartcore.index import NgramIndex

        index = NgramIndex(args.index)
    methods = [m for m in args.methods if index is not None or m not in ("dart", "hybrid")]
    skipped = sorted(set(args.methods) - set(methods))
    if skipped:
        print(f"no --index: skipping {skipped}", file=sys.stderr)

    rows: list[dict] = []
    for ds in args.datasets:
        prompts = load_prompts(ds, args.n)
        reference = None
        base_tps = None
        for method in (["ar"] if "ar" not in methods else []) + methods:
            params = {}
            if args.max_nodes is not None and method != "ar":
                params["max_nodes"] = args.max_nodes
            if args.head is not None and method in ("dartree", "hybrid"):
                params["head"] = args.head
            dec = DartDecoder(model, tokenizer, drafter if method != "ar" else None,
                              index if method in ("dart", "hybrid") else None, tree=method, **params)
            dec.generate(prompts[0], max_new_tokens=8, temperature=args.temperature, seed=args.seed)  # warm-up
            t0 = time.perf_counter()
            outs, stats = run_method(dec, prompts, max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature, seed=args.seed)
            agg = aggregate(stats, drafter.d)
            if method == "ar":
                reference, base_tps = outs, agg["tok_per_s"]
            same = (outs == reference) if (args.temperature == 0 and reference is not None) else None
            row = {"dataset": ds, "method": method, "temperature": args.temperature,
                   "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                   "speedup": agg["tok_per_s"] / base_tps if base_tps else 0.0,
                   "same_as_ar": same, "wall_s": time.perf_counter() - t0,
                   "max_nodes": getattr(dec.builder, "max_nodes", None), **agg}
            if method in args.methods:
                rows.append(row)
            print(f"{ds:10s} {method:8s} tau={row['tau']:.2f} tok/s={row['tok_per_s']:.1f} "
                  f"speedup={row['speedup']:.2f} same_as_ar={same}", file=sys.stderr, flush=True)

    meta = {"target": args.target, "drafter": args.drafter, "index": args.index, "head": args.head,
            "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    plot(rows, Path(args.png), drafter.d)
    md = table(rows)
    print(md)
    if args.report:
        Path(args.report).write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

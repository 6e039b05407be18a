#!/usr/bin/env python3
"""Tree builders compared on the same prompts: τ, tokens/s, speedup over plain AR, stage
times and per-position acceptance Pr(L ≥ t) for tree = dart | dartree | hybrid | ddtree.

    python3 tools/bench_trees.py --drafter smollm2 --index /path/smollm2.idx \\
        --datasets gsm8k,humaneval --n 4 --max-new-tokens 96 --report tools/reports/dartree.md

Runs on the benchmark machinery of ``dart-bench`` / tools/bench_decode.py
(:func:`dartcore.benchmark.runner.run_benchmark`: every method in one process, AR first,
speedup against ``ar`` of the same run, ``greedy_identical`` checked token for token), so
its rows have the same schema (dataset, method, temperature, tau, tok_per_s, speedup,
``*_ms_per_round`` stage times, accept_hist) plus ``accept_curve`` = Pr(L ≥ t), t = 1..d,
where L is the number of drafted tokens accepted in a round. Writes the JSON object, a PNG
of the acceptance curves and, with ``--report``, the markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

METHODS = ("ar", "dart", "dartree", "hybrid", "ddtree")
# Ablation, registered by this tool only: DARTree's search with the identity head
# (q̃ = the drafter's marginal renormalised in its top-K), i.e. without the learned correction.
ABLATIONS = ("dartree-untrained",)


def _register_ablations() -> None:
    from dartcore.dartree.builders import DartreeBuilder
    from dartcore.trees import register_tree_builder

    register_tree_builder(
        "dartree-untrained",
        lambda **kw: DartreeBuilder(**{**kw, "head": "untrained"}),
        replace=True,
    )


def accept_curve(hist: list[int], d: int) -> list[float]:
    """Pr(L ≥ t) for t = 1..d from a histogram of accepted drafted tokens per round."""
    rounds = sum(hist)
    if rounds == 0:
        return [0.0] * d
    return [sum(hist[t:]) / rounds for t in range(1, d + 1)]


def plot(rows: list[dict], path: Path, d: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["dataset"], r["temperature"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 4), squeeze=False)
    for ax, (ds, temp) in zip(axes[0], keys):
        for r in rows:
            if (r["dataset"], r["temperature"]) != (ds, temp) or r["method"] == "ar":
                continue
            ax.plot(
                range(1, d + 1),
                r["accept_curve"],
                marker="o",
                label=f"{r['method']} (τ={r['tau']:.2f})",
            )
        ax.set_title(f"{ds}, T={temp:g}")
        ax.set_xlabel("t (draft position)")
        ax.set_ylabel("Pr(L ≥ t)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def table(rows: list[dict]) -> str:
    head = (
        "dataset",
        "T",
        "method",
        "τ",
        "tok/s",
        "speedup",
        "draft ms",
        "search ms",
        "verify ms",
        "Pr(L≥1)",
        "Pr(L≥2)",
        "Pr(L≥3)",
        "Pr(L≥4)",
        "identical to AR",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        c = (r.get("accept_curve") or []) + [None] * 4
        lines.append(
            "| "
            + " | ".join(
                [
                    r["dataset"],
                    f"{r['temperature']:g}",
                    r["method"],
                    f(r.get("tau"), ".2f"),
                    f(r["tok_per_s"], ".1f"),
                    f(r.get("speedup"), ".2f"),
                    f(r.get("draft_ms_per_round"), ".1f"),
                    f(r.get("search_ms_per_round"), ".2f"),
                    f(r.get("verify_ms_per_round"), ".1f"),
                    *(f(x, ".2f") for x in c[:4]),
                    {True: "yes", False: "NO", None: "-"}[r.get("greedy_identical")],
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="smollm2", help="drafter directory or built-in name")
    p.add_argument("--index", help="n-gram index built with the target's tokenizer (dart, hybrid)")
    p.add_argument("--head", help="correction head directory or name (default: the built-in one)")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated tree builders (also: {', '.join(ABLATIONS)})",
    )
    p.add_argument("--datasets", default="gsm8k,humaneval")
    p.add_argument("--temperatures", default="0")
    p.add_argument("--n", type=int, default=4, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument(
        "--max-nodes",
        type=int,
        help="node budget of every tree (default: each builder's CPU budget)",
    )
    p.add_argument("--threads", type=int)
    p.add_argument("--data-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="artifacts/bench_trees.json")
    p.add_argument("--png", default="tools/reports/dartree_acceptance.png")
    p.add_argument("--report", help="also write the markdown table to this file")
    args = p.parse_args(argv)

    import torch

    from dartcore.benchmark.runner import BenchConfig, run_benchmark

    if args.threads:
        torch.set_num_threads(args.threads)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if any(m in ABLATIONS for m in methods):
        _register_ablations()
    if not args.index and any(m in ("dart", "hybrid") for m in methods):
        p.error("dart and hybrid need --index (or drop them from --methods)")
    tree_params: dict[str, dict] = {m: {} for m in methods if m != "ar"}
    for m in tree_params:
        if args.max_nodes:
            tree_params[m]["max_nodes"] = args.max_nodes
        if args.head and m in ("dartree", "hybrid"):
            tree_params[m]["head"] = args.head
    cfg = BenchConfig(
        target=args.target,
        drafter=args.drafter,
        index=args.index,
        datasets=tuple(d.strip() for d in args.datasets.split(",") if d.strip()),
        n=args.n,
        methods=methods,
        temperatures=tuple(float(t) for t in args.temperatures.split(",")),
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        data_dir=args.data_dir,
        tree_params=tree_params,
    )
    from tqdm import tqdm

    bar = tqdm(
        total=len(cfg.datasets) * len(cfg.temperatures) * cfg.n * len(set(methods) | {"ar"}),
        desc="bench_trees",
        unit="run",
        file=sys.stderr,
    )

    def progress(dataset, temperature, i, method, rec):
        bar.set_postfix_str(f"{dataset} T={temperature:g} {method}")
        bar.update(1)

    start = time.perf_counter()
    report = run_benchmark(cfg, progress=progress)
    bar.close()
    # Curve length: the drafter's d (8 by default), or longer if some round accepted more.
    d = max(8, max((len(r.get("accept_hist") or []) for r in report["results"]), default=1) - 1)
    for r in report["results"]:
        r["accept_curve"] = accept_curve(r.get("accept_hist") or [], d) if r.get("rounds") else None
    report["bench_s"] = time.perf_counter() - start
    report["tree_params"] = {m: {k: str(v) for k, v in t.items()} for m, t in tree_params.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot([r for r in report["results"] if r.get("accept_curve")], Path(args.png), d)
    md = table(report["results"])
    print(md)
    print(f"\ngreedy_identical: {report['greedy_identical']}; JSON: {out}; plot: {args.png}")
    if args.report:
        Path(args.report).write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Decoding benchmark of DartDecoder on SmolLM2-135M-Instruct (CPU by default).

Per dataset (HumanEval, GSM8K, CodeAlpaca-2k; --n prompts each) and temperature
(0 and 1) every method runs in the same process, AR first: ``ar`` (plain
autoregressive decoding in the same loop = the baseline), ``dart``,
``dart-no-ngram``, ``dart-chain``, ``ngram-only``. Each row carries ``dataset``,
``method``, ``temperature``, ``tau`` (committed tokens per target forward, bonus
included), ``tok_per_s``, ``speedup`` (over ``ar`` in the same run) and per-round
stage times; the object carries ``results``, ``greedy_identical`` (true only if
every T = 0 output equals the AR output) and ``verify_cost``: the target's
forward time for trees of 1..128 nodes after a cached prefix on this machine,
with the node budget that maximises tau(n) / t(n).

    python tools/bench_decode.py --index /tmp/smollm2.idx --n 5 --json
    python tools/bench_decode.py --verify-cost-only

The runs reuse dartcore.benchmark (the dart-bench machinery); this script picks
the decoder's methods, adds the verify-cost curve and prints the table. JSON goes
to --out (default artifacts/bench_decode.json) and, with --json, to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

METHODS = ("ar", "dart", "dart-no-ngram", "dart-chain", "ngram-only")
SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def _table(report: dict) -> str:
    head = ("dataset", "method", "T", "tau", "tok/s", "speedup", "draft ms", "search ms", "verify ms",
            "accept ms", "identical")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in report["results"]:
        lines.append("| " + " | ".join([
            r["dataset"], r["method"], f"{r['temperature']:g}", f(r.get("tau"), ".2f"), f(r.get("tok_per_s"), ".1f"),
            f(r.get("speedup"), ".2f"), f(r.get("draft_ms_per_round"), ".1f"), f(r.get("search_ms_per_round"), ".2f"),
            f(r.get("verify_ms_per_round"), ".1f"), f(r.get("accept_ms_per_round"), ".2f"),
            {True: "yes", False: "NO", None: "-"}[r.get("greedy_identical")],
        ]) + " |")
    return "\n".join(lines)


def _verify_cost_table(choice: dict) -> str:
    lines = ["| nodes | verify ms | tau model | tok/s model |", "|---|---|---|---|"]
    for r in choice["curve"]:
        lines.append(f"| {r['nodes']} | {r['ms']:.1f} | {r['tau']:.2f} | {r['tok_per_s']:.1f} |")
    lines.append(f"\nbudget with the most tokens/s: {choice['budget']} nodes (tau model: {choice['tau_model']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="smollm2", help="drafter directory or built-in name")
    p.add_argument("--index", help="n-gram index built with the SmolLM2 tokenizer (needed by dart, ngram-only)")
    p.add_argument("--datasets", default="humaneval,gsm8k,code_alpaca")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--n", type=int, default=5, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-nodes", type=int, help="tree budget for every tree method (default: the builders')")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--data-dir", help="shared data directory (default: ../shared/data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-len", type=int, default=256, help="cached prefix of the verify-cost forwards")
    p.add_argument("--budgets", default="",
                   help="comma-separated node budgets at which to measure dart's T=0 tau on --budget-prompts "
                        "prompts of the first dataset (feeds the budget choice), e.g. 4,8,16,24,32")
    p.add_argument("--budget-prompts", type=int, default=3)
    p.add_argument("--no-verify-cost", action="store_true")
    p.add_argument("--verify-cost-only", action="store_true")
    p.add_argument("--out", default="artifacts/bench_decode.json")
    p.add_argument("--json", action="store_true", help="print the JSON object on stdout (table on stderr)")
    args = p.parse_args(argv)

    import torch

    from dartcore.benchmark.runner import BenchConfig, machine_info, median_speedups, run_benchmark
    from dartcore.benchmark.verify_cost import choose_budget, measure_verify_cost

    if args.threads:
        torch.set_num_threads(args.threads)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    report: dict = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if not args.verify_cost_only:
        tree_params = ({m: {"max_nodes": args.max_nodes} for m in methods if m != "ar"}
                       if args.max_nodes else {})
        cfg = BenchConfig(
            target=args.target, drafter=args.drafter, index=args.index,
            datasets=tuple(d.strip() for d in args.datasets.split(",") if d.strip()), n=args.n,
            methods=methods, temperatures=tuple(float(t) for t in args.temperatures.split(",")),
            max_new_tokens=args.max_new_tokens, seed=args.seed, data_dir=args.data_dir,
            tree_params=tree_params,
        )
        from tqdm import tqdm

        total = len(cfg.datasets) * len(cfg.temperatures) * cfg.n * len(set(methods) | {"ar"})
        bar = tqdm(total=total, desc="bench_decode", unit="run", file=sys.stderr)

        def progress(dataset, temperature, i, method, rec):
            bar.set_postfix_str(f"{dataset} T={temperature:g} {method}")
            bar.update(1)

        report.update(run_benchmark(cfg, progress=progress))
        bar.close()
        report["median_speedup"] = {f"T={t:g}": median_speedups(report, t) for t in cfg.temperatures}
    if not args.no_verify_cost:
        from dartcore.models.hub import load_target
        from dartcore.models.transformer import TargetModel

        model, _ = load_target(args.target)
        curve = measure_verify_cost(TargetModel(model), prefix_len=args.prefix_len, sizes=SIZES)
        taus: dict[int, list[float]] = {}
        for r in report.get("results", []):
            if r["method"] == "dart" and r["temperature"] == 0.0 and r.get("tau"):
                budget = args.max_nodes or _default_budget()
                taus.setdefault(budget, []).append(r["tau"])
        if args.budgets:
            report["tau_by_budget"] = _tau_by_budget(args, model, [int(b) for b in args.budgets.split(",")])
            for row in report["tau_by_budget"]:
                taus.setdefault(row["max_nodes"], []).append(row["tau"])
        tau_at = {n: statistics.mean(v) for n, v in taus.items()}
        if tau_at:
            tau_at.setdefault(1, 1.0)  # a root-only tree commits exactly one token
        report["verify_cost"] = choose_budget(curve, tau_at or None)
        report.setdefault("machine", machine_info())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    text = []
    if report.get("results"):
        text.append(_table(report))
        text.append(f"\ngreedy_identical: {report['greedy_identical']}; median speedup: {report['median_speedup']}")
    if report.get("verify_cost"):
        text.append("\n" + _verify_cost_table(report["verify_cost"]))
    print("\n".join(text), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _tau_by_budget(args, model, budgets: list[int]) -> list[dict]:
    """dart's greedy tau and tokens/s at each node budget (same prompts, same run)."""
    from transformers import AutoTokenizer

    from dartcore.benchmark.datasets import load_prompts
    from dartcore.decoder import DartDecoder
    from dartcore.drafter import DartDrafter
    from dartcore.index import NgramIndex
    from dartcore.models.hub import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target(args.target))
    drafter = DartDrafter.from_pretrained(args.drafter, model, tokenizer=tok)
    index = NgramIndex(args.index)
    dataset = args.datasets.split(",")[0].strip()
    prompts = load_prompts(dataset, args.budget_prompts, args.data_dir)
    rows = []
    for b in budgets:
        dec = DartDecoder(model, tok, drafter, index, tree="dart", max_nodes=b)
        tokens = rounds = committed = 0
        seconds = 0.0
        for messages in prompts:
            res = dec.generate(messages, max_new_tokens=args.max_new_tokens)
            s = res.stats
            tokens += s.new_tokens
            seconds += s.total_s
            rounds += s.rounds
            committed += sum((a + 1) * c for a, c in enumerate(s.accept_hist))
        rows.append({"max_nodes": b, "dataset": dataset, "prompts": len(prompts),
                     "tau": committed / max(rounds, 1), "tok_per_s": tokens / seconds if seconds else 0.0})
        print(f"budget {b}: tau {rows[-1]['tau']:.2f}, {rows[-1]['tok_per_s']:.2f} tok/s", file=sys.stderr)
    return rows


def _default_budget() -> int:
    from dartcore.builders import CPU_MAX_NODES

    return CPU_MAX_NODES


if __name__ == "__main__":
    raise SystemExit(main())

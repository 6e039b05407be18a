"""dart-bench: the decoding benchmark (datasets x methods x temperatures), side by
side with plain AR decoding and Hugging Face's generate / prompt lookup in the
same run. Writes bench.json, bench.md and PNG plots to --out.

    dart-bench --index artifacts/demo/smollm2.idx --n 5 --out artifacts/bench
    dart-bench --index artifacts/demo/smollm2.idx --verify-cost-only --out artifacts/bench

Tree methods: any registered tree builder (listed under --methods); hf-generate and
hf-prompt-lookup are Hugging Face's own decoding. Speedups are against `ar` (the same
decoder loop with no draft), which every run includes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dartcore.cli._common import (
    ArgumentParser,
    HelpFormatter,
    UsageError,
    add_max_nodes,
    add_target_weights,
    check_choice,
    check_drafter,
    check_index,
    check_index_tokenizer,
    check_target,
    check_target_weights,
    run_cli,
)

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from dartcore.benchmark.datasets import DATASETS
    from dartcore.benchmark.runner import DEFAULT_METHODS, HF_METHODS
    from dartcore.trees import tree_builders

    p = ArgumentParser(prog="dart-bench", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--target",
        default="smollm2",
        help="target model: built-in name, HF model directory or .gguf",
    )
    p.add_argument(
        "--drafter",
        default="smollm2",
        help="drafter directory (dart-train's drafter/) or built-in name",
    )
    p.add_argument(
        "--index",
        help="n-gram index built with the target's tokenizer (ngram-build); "
        "needed by the methods that read one",
    )
    p.add_argument(
        "--datasets",
        default="humaneval,gsm8k,code_alpaca",
        help=f"comma-separated, from {', '.join(DATASETS)}, or .jsonl prompt files "
        '(one {"messages": [...]} or {"prompt": ...} per line)',
    )
    p.add_argument("--n", type=int, default=5, help="prompts per dataset")
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated, from the tree builders "
        + ", ".join(tree_builders())
        + " and "
        + ", ".join(HF_METHODS),
    )
    p.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per prompt; the median time is kept"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--data-dir", help="data directory holding eval/ (default: $DARTCORE_DATA)")
    add_max_nodes(
        p, "node budget per round, root excluded, for every tree method (default: the builder's)"
    )
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="target weights (default: float32)",
    )
    add_target_weights(p)
    p.add_argument("--verify-cost", action="store_true", help="also measure the verify-cost curve")
    p.add_argument(
        "--verify-cost-only", action="store_true", help="only measure the verify-cost curve"
    )
    p.add_argument(
        "--prefix-len", type=int, default=256, help="cached prefix of the verify-cost forwards"
    )
    p.add_argument(
        "--budgets",
        default="",
        help="comma-separated node budgets at which to measure dart's T=0 tau on --budget-prompts "
        "prompts of the first dataset (feeds the budget choice), e.g. 4,8,16,24,32 (default: none)",
    )
    p.add_argument("--budget-prompts", type=int, default=3, help="prompts per budget of --budgets")
    p.add_argument(
        "--out",
        default="artifacts/bench",
        help="output directory (bench.json, bench.md, PNG plots)",
    )
    p.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    return p


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated numbers, e.g. 0,1") from None


def _check(args) -> tuple[str, ...]:
    """Every argument a user can get wrong, before the model loads; returns the methods."""
    from dartcore.benchmark.datasets import DATASETS, load_prompts
    from dartcore.benchmark.runner import HF_METHODS
    from dartcore.errors import CorpusError
    from dartcore.trees import make_tree_builder, tree_builders

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if not methods and not args.verify_cost_only:
        raise UsageError("--methods is empty: pass e.g. --methods ar,dart")
    for m in methods:
        check_choice("--methods", m, [*tree_builders(), *HF_METHODS])
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for d in datasets:
        if not d.endswith(".jsonl"):
            check_choice("--datasets", d, DATASETS)
    if args.n <= 0 or args.max_new_tokens <= 0 or args.repeats <= 0:
        raise UsageError("--n, --max-new-tokens and --repeats must be positive")
    if any(t < 0 for t in _floats("--temperatures", args.temperatures)):
        raise UsageError(
            f"--temperatures {args.temperatures!r}: temperatures are 0 (greedy) or more"
        )
    try:
        [int(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        raise UsageError(
            f"--budgets {args.budgets!r}: expected comma-separated integers, e.g. 4,8,16"
        ) from None
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise UsageError(
            f"--data-dir {args.data_dir} is not a directory: pass the data directory "
            "(the one holding eval/)"
        )
    if not args.verify_cost_only:
        for d in datasets:
            try:
                load_prompts(d, 1, args.data_dir)
            except CorpusError as exc:
                raise CorpusError(f"--datasets {d}: {exc}") from None
    check_target(args.target)
    check_target_weights(args)
    tree_methods = [m for m in methods if m not in HF_METHODS]
    if (
        any(getattr(make_tree_builder(m), "needs_drafter", False) for m in tree_methods)
        or args.budgets
    ):
        check_drafter(args.drafter)
    # Which methods read the index: the builders say so themselves (`needs_index`).
    needed = (
        []
        if args.verify_cost_only
        else [m for m in tree_methods if make_tree_builder(m).needs_index]
    )
    if args.budgets and "dart" not in needed:
        needed.append("--budgets (dart)")
    index = check_index(
        args.index,
        needed_by=[f"--methods {', '.join(needed)}"] if needed else [],
        alternative="only methods without one (ar, dart-no-ngram, hf-generate)",
    )
    if index is not None:
        check_index_tokenizer(index, args.target)
    return methods


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli("dart-bench", lambda: _run(args))


def _run(args) -> int:
    methods = _check(args)
    import torch

    from dartcore.benchmark.report import markdown_table, plot_all, plot_verify_cost
    from dartcore.benchmark.runner import (
        HF_METHODS,
        BenchConfig,
        machine_info,
        run_benchmark,
    )

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    if not args.verify_cost_only:
        tree_params = {}
        if args.max_nodes:
            tree_params = {
                m: {"max_nodes": args.max_nodes}
                for m in methods
                if m not in HF_METHODS and m != "ar"
            }
        cfg = BenchConfig(
            target=args.target,
            drafter=args.drafter,
            index=args.index,
            datasets=tuple(d.strip() for d in args.datasets.split(",") if d.strip()),
            n=args.n,
            methods=methods,
            temperatures=tuple(float(t) for t in args.temperatures.split(",")),
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            seed=args.seed,
            data_dir=args.data_dir,
            tree_params=tree_params,
            device=args.device,
            dtype=args.dtype,
            quantized=args.quantized,
            numerics=args.numerics,
        )
        from tqdm import tqdm

        total = len(cfg.datasets) * len(cfg.temperatures) * cfg.n * len(set(methods) | {"ar"})
        bar = tqdm(total=total, desc="dart-bench", unit="run", file=sys.stderr)

        def progress(dataset, temperature, i, method, rec):
            bar.set_postfix_str(f"{dataset} T={temperature:g} {method}")
            bar.update(1)

        report = run_benchmark(cfg, progress=progress)
        bar.close()
    if report.get("results"):
        from dartcore.benchmark.runner import median_speedups

        report["median_speedup"] = {
            f"T={t:g}": median_speedups(report, t) for t in cfg.temperatures
        }
    if args.verify_cost or args.verify_cost_only:
        report["verify_cost"] = _verify_cost(args, report)
        report.setdefault("machine", machine_info())
        if not args.no_plots:
            plot_verify_cost(report["verify_cost"], out / "verify_cost.png")
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    if report.get("results"):
        table = markdown_table(report)
        (out / "bench.md").write_text(table + "\n")
        print(table)
        print(f"\ngreedy_identical: {report['greedy_identical']}")
        if not args.no_plots:
            plot_all(report, out)
    if "verify_cost" in report:
        vc = report["verify_cost"]
        print("\n| nodes | forward ms | τ model | tok/s |\n|---|---|---|---|")
        for c in vc["curve"]:
            print(f"| {c['nodes']} | {c['ms']:.1f} | {c['tau']:.2f} | {c['tok_per_s']:.1f} |")
        print(f"best budget: {vc['budget']} nodes (τ model: {vc['tau_model']})")
    if args.json:
        print(json.dumps(report))
    print(f"wrote {out}/bench.json", file=sys.stderr)
    return 0


def _verify_cost(args, report: dict) -> dict:
    """The verify-cost curve and the budget it implies, with τ measured in this run: dart's
    T = 0 rows at the budget they ran with, plus --budgets sweeps."""
    import statistics

    from dartcore.benchmark.runner import torch_dtype
    from dartcore.benchmark.verify_cost import (
        DEFAULT_SIZES,
        choose_budget,
        measure_verify_cost,
    )
    from dartcore.models.hub import load_target
    from dartcore.models.transformer import TargetModel

    model, tok = load_target(
        args.target,
        dtype=torch_dtype(args.dtype),
        device=args.device,
        quantized=args.quantized,
        numerics=args.numerics,
    )
    curve = measure_verify_cost(TargetModel(model), prefix_len=args.prefix_len, sizes=DEFAULT_SIZES)
    taus: dict[int, list[float]] = {}
    for r in report.get("results", []):
        if r["method"] == "dart" and r["temperature"] == 0.0 and r.get("tau"):
            taus.setdefault(r["max_nodes"], []).append(r["tau"])  # the budget the decoder used
    if args.budgets:
        report["tau_by_budget"] = _tau_by_budget(
            args, model, tok, [int(b) for b in args.budgets.split(",")]
        )
        for row in report["tau_by_budget"]:
            taus.setdefault(row["max_nodes"], []).append(row["tau"])
    tau_at = {n: statistics.mean(v) for n, v in taus.items()}
    if tau_at:
        tau_at.setdefault(1, 1.0)  # a root-only tree commits exactly one token
    return choose_budget(curve, tau_at or None)


def _tau_by_budget(args, model, tok, budgets: list[int]) -> list[dict]:
    """dart's greedy tau and tokens/s at each node budget (same prompts, same run)."""
    from dartcore.benchmark.datasets import load_prompts
    from dartcore.decoder import DartDecoder
    from dartcore.index import DECODE_PREFAULT, DECODE_VERIFY, NgramIndex
    from dartcore.models.hub import load_drafter

    drafter = load_drafter(args.drafter, model, tok)
    index = NgramIndex(args.index, verify=DECODE_VERIFY, prefault=DECODE_PREFAULT)
    dataset = args.datasets.split(",")[0].strip()
    prompts = load_prompts(dataset, args.budget_prompts, args.data_dir)
    rows = []
    for b in budgets:
        dec = DartDecoder(model, tok, drafter, index, tree="dart", max_nodes=b)
        tokens = rounds = committed = 0
        seconds = 0.0
        for messages in prompts:
            s = dec.generate(messages, max_new_tokens=args.max_new_tokens).stats
            tokens += s.new_tokens
            seconds += s.total_s
            rounds += s.rounds
            committed += sum((a + 1) * c for a, c in enumerate(s.accept_hist))
        rows.append(
            {
                "max_nodes": b,
                "dataset": dataset,
                "prompts": len(prompts),
                "tau": committed / max(rounds, 1),
                "tok_per_s": tokens / seconds if seconds else 0.0,
            }
        )
        print(
            f"budget {b}: tau {rows[-1]['tau']:.2f}, {rows[-1]['tok_per_s']:.2f} tok/s",
            file=sys.stderr,
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Batched decoding benchmark (not a test): throughput and per-request latency of the
batched engine on SmolLM2-135M-Instruct (fp32, CPU) at several concurrencies, for batched
plain AR (``ar``, budget 0), DART with a fixed budget (``dart-fixed``, 4 nodes per sequence)
and DART with the budget controller (``dart-adaptive``), one run, the same prompts (a mix of
HumanEval, GSM8K and CodeAlpaca from $DARTCORE_DATA/eval, chat template), greedy.

Closed loop: ``c`` requests are in the engine at once; when one finishes the next prompt
joins. Latency = a request's time from joining to its last token. tok/s = all requests'
new tokens over the wall time of the whole run at that concurrency. ``greedy_identical``:
every output equals the same prompt's output under ``ar`` at concurrency 1 (= batch-1
greedy decoding).

    python tools/bench_batch.py --json                         # 16 prompts x 128 tokens
    python tools/bench_batch.py --n 16 --max-new-tokens 32 --concurrency 1,2,4,8,16 --json

Writes bench_batch.json and bench_batch.png (throughput against concurrency) to --out.
Without --index it builds a SmolLM2-tokenizer index once from the shipped target responses
and the answers of $DARTCORE_DATA's training sets (never the eval sets), cached under
$DARTCORE_CACHE/bench_batch/ (default ~/.cache/dartcore).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = {"ar": 0, "dart-fixed": None, "dart-adaptive": "adaptive"}


def build_default_index(tok, data_dir) -> Path:
    """The demo-like domain index (see tools/demo.py's write_task_responses), built once."""
    import numpy as np

    from dartcore.benchmark.datasets import find_data_dir
    from dartcore.index import build_index
    from dartcore.paths import cache_root
    from dartcore.tokenizers import fingerprint
    from dartcore.training.data import read_documents

    data = find_data_dir(data_dir)
    name = "smollm2-responses+train.idx" if data is not None else "smollm2-responses.idx"
    out = cache_root() / "bench_batch" / name
    if out.is_file():
        return out
    files = [REPO / "python" / "dartcore" / "assets" / "corpus" / "smollm2_responses.jsonl.gz"]
    if data is not None:
        files += sorted((data / "train").glob("*.json*"))
    docs = []
    for f in files:
        if not f.is_file():
            continue
        for doc in read_documents(f):
            if doc.messages and doc.messages[-1]["role"] == "assistant":
                ids = tok(doc.messages[-1]["content"])["input_ids"] + [tok.eos_token_id]
                docs.append(np.asarray(ids, dtype=np.int64))
    out.parent.mkdir(parents=True, exist_ok=True)
    build_index(
        docs,
        out,
        vocab_size=len(tok),
        metadata={"tokenizer": {"name": "smollm2", "fingerprint": fingerprint(tok)}},
    )
    return out


def load_prompts(tok, n: int, data_dir) -> list[list[int]]:
    from dartcore.benchmark.datasets import load_prompts as load

    per = (n + 2) // 3
    chats = []
    for name in ("humaneval", "gsm8k", "code_alpaca"):
        chats.append(load(name, per, data_dir))
    # interleaved: lengths mix in every batch
    mixed = [c for group in zip(*chats) for c in group][:n]
    out = []
    for messages in mixed:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run_one(
    engine_cls, params_cls, dec, prompts, concurrency: int, budget, max_new: int, max_seq_len: int
):
    engine = engine_cls(dec, max_batch=concurrency, max_seq_len=max_seq_len, budget=budget)
    params = params_cls(max_new_tokens=max_new)
    pending = list(enumerate(prompts))
    joined: dict[str, tuple[int, float]] = {}
    results: dict[int, dict] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and engine.num_running() + engine.num_waiting() < concurrency:
            i, p = pending.pop(0)
            joined[engine.add_request(p, params)] = (i, time.perf_counter())
        for out in engine.step():
            if out.finished:
                i, t0 = joined[out.request_id]
                results[i] = {
                    "tokens": out.tokens,
                    "latency_s": time.perf_counter() - t0,
                    "stats": out.stats,
                }
    wall = time.perf_counter() - start
    return engine, results, wall


def percentile(xs, q):
    import numpy as np

    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=16, help="prompts (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument(
        "--budget", type=int, default=4, help="dart-fixed's nodes per sequence (default 4)"
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="the data directory (eval/ and train/; default $DARTCORE_DATA)",
    )
    p.add_argument("--index", help="n-gram index (default: built once from the shipped responses)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    p.add_argument("--remeasure", action="store_true", help="measure the verify-cost curve again")
    p.add_argument("--out", default=str(REPO / "artifacts" / "bench_batch"))
    p.add_argument("--json", action="store_true", help="print the JSON object")
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from dartcore import DartDecoder
    from dartcore.benchmark.runner import machine_info
    from dartcore.engine import Engine, SamplingParams
    from dartcore.index import NgramIndex
    from dartcore.models.hub import load_drafter, load_target

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {sorted(METHODS)}")
    model, tok = load_target("smollm2", quantized=False)
    drafter = load_drafter("smollm2", model, tok)
    index = NgramIndex(args.index or build_default_index(tok, args.data_dir))
    dec = DartDecoder(model, tok, drafter, index, tree="dart", max_nodes=max(args.budget, 1))
    prompts = load_prompts(tok, args.n, args.data_dir)
    max_seq_len = max(len(x) for x in prompts) + args.max_new_tokens + dec.max_nodes + 2
    print(
        f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
        f"{args.max_new_tokens} new tokens, backend {dec.backend.name}, {torch.get_num_threads()} torch threads",
        file=sys.stderr,
    )

    # the cost curve for the largest concurrency, measured (or read) once
    if "dart-adaptive" in methods:
        from dartcore.controller import CostCurve

        nodes = max(dec.max_nodes, drafter.d)
        CostCurve.for_target(
            dec.target,
            dec.backend,
            max_rows=max(concurrencies) * (nodes + 1),
            remeasure=args.remeasure,
        )
    rows, outputs = [], {}
    for c in concurrencies:
        for method in methods:
            budget = args.budget if METHODS[method] is None else METHODS[method]
            engine, res, wall = run_one(
                Engine, SamplingParams, dec, prompts, c, budget, args.max_new_tokens, max_seq_len
            )
            outputs[(method, c)] = [res[i]["tokens"] for i in range(len(prompts))]
            new = sum(len(r["tokens"]) for r in res.values())
            rounds = sum(r["stats"]["rounds"] for r in res.values())
            committed = sum(
                (a + 1) * k for r in res.values() for a, k in enumerate(r["stats"]["accept_hist"])
            )
            budgets = [b for r in res.values() for b in r["stats"]["budgets"]]
            lat = [r["latency_s"] for r in res.values()]
            st = engine.stats
            row = {
                "method": method,
                "concurrency": c,
                "tok_per_s": new / wall,
                "latency_p50_s": percentile(lat, 50),
                "latency_p99_s": percentile(lat, 99),
                "tau": committed / max(rounds, 1),
                "mean_budget": sum(budgets) / max(len(budgets), 1),
                "wall_s": wall,
                "new_tokens": new,
                "steps": st.num_steps,
                "mean_rows_per_step": st.rows_verified / max(st.num_steps, 1),
                "stage_s": {k: round(v, 3) for k, v in st.seconds.items()},
                "controller_ms_per_step": 1e3 * st.controller_s / max(st.num_steps, 1),
            }
            rows.append(row)
            print(
                f"  {method:14s} c={c:2d}  {row['tok_per_s']:6.1f} tok/s  tau {row['tau']:.2f}  "
                f"budget {row['mean_budget']:.2f}  p50 {row['latency_p50_s']:.1f}s  p99 {row['latency_p99_s']:.1f}s"
                f"  ({wall:.0f}s)",
                file=sys.stderr,
            )
    ar_rate = {r["concurrency"]: r["tok_per_s"] for r in rows if r["method"] == "ar"}
    for r in rows:
        r["speedup_vs_ar"] = (
            r["tok_per_s"] / ar_rate[r["concurrency"]] if r["concurrency"] in ar_rate else None
        )
    reference = outputs.get(("ar", concurrencies[0])) or next(iter(outputs.values()))
    identical = all(v == reference for v in outputs.values())
    result = {
        "results": rows,
        "greedy_identical": identical,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "budget": args.budget,
        "backend": dec.backend.name,
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0],
        "machine": machine_info(),
        "command": " ".join(["python3", *sys.argv]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "bench_batch.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out / "bench_batch.json")
    _plot(rows, out / "bench_batch.png")
    print(_table(rows), file=sys.stderr)
    print(f"greedy identical: {identical}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


def _table(rows) -> str:
    lines = [
        "| method | concurrency | tok/s | speedup vs AR | p50 s | p99 s | tau | mean budget |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sp = f"{r['speedup_vs_ar']:.2f}x" if r.get("speedup_vs_ar") is not None else "-"
        lines.append(
            f"| {r['method']} | {r['concurrency']} | {r['tok_per_s']:.1f} | {sp} | {r['latency_p50_s']:.2f} "
            f"| {r['latency_p99_s']:.2f} | {r['tau']:.2f} | {r['mean_budget']:.2f} |"
        )
    return "\n".join(lines)


def _plot(rows, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        pts = sorted((r["concurrency"], r["tok_per_s"]) for r in rows if r["method"] == method)
        if pts:
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests decoded together)")
    ax.set_ylabel("throughput (tok/s, all requests)")
    ax.set_title("SmolLM2-135M batched decoding, greedy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())

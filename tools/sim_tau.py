#!/usr/bin/env python3
"""Offline τ of tree builders under greedy decoding, without re-running the target.

Under T = 0 the committed text is the target's greedy output whatever the tree, and the
drafter's proposal at a position depends only on the committed text before it. So one
recording pass (plain AR decoding that also runs the drafter at every position and keeps its
top-``--keep`` logits per row) fixes everything a builder sees; a builder's τ is then
replayed round by round: build the tree at the current position, accept the longest tree path
that matches the greedy output, move on by accepted + 1. Hundreds of builder settings cost
seconds each instead of a decoding run each. ``--check`` runs the real DartDecoder for the
first configuration on the first prompts and compares the acceptance histograms (they match
up to rare float ties between a 1-row and a k-row drafter step).

    python tools/sim_tau.py --index artifacts/demo/smollm2.idx --n 10 \\
        --configs "dart" "dart:max_nodes=3" "dart:ngram_weight=1.0" "dart+ctx"

A configuration is ``tree[:key=value,...]`` with DartDecoder tree parameters. Builders that
read only the top-k of the drafter rows (dart, dart-no-ngram, dart-chain, dart+ctx,
dart+ngram, ngram-only) replay exactly; keep ``--keep`` >= their k.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch


class _Recorder:
    """Tree builder that returns the root alone (plain AR) and records what a builder would
    have seen at every position: the context and the drafter's top-``keep`` logits per row."""

    needs_drafter = True
    needs_hidden = False
    needs_index = False

    def __init__(self, max_nodes: int, keep: int):
        self.max_nodes = max_nodes
        self.keep = keep
        self.rows: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def __call__(self, inputs):
        from dartcore.trees import root_only

        values, ids = torch.topk(
            inputs.logits.float(), min(self.keep, inputs.logits.shape[-1]), dim=-1
        )
        self.rows.append((values.cpu(), ids.cpu(), int(inputs.logits.shape[-1])))
        return root_only(int(inputs.context[-1]))


def record(decoder_cls, model, tok, drafter, prompts, max_new_tokens: int, keep: int) -> list[dict]:
    """One AR pass per prompt with the drafter running at every position."""
    from dartcore.trees import register_tree_builder

    recorder = _Recorder(max_nodes=drafter.d, keep=keep)
    register_tree_builder("_sim-record", lambda **_: recorder, replace=True)
    dec = decoder_cls(model, tok, drafter, None, tree="_sim-record")
    out = []
    for dataset, messages in prompts:
        recorder.rows = []
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        res = dec.generate(ids, max_new_tokens=max_new_tokens)
        out.append(
            {
                "dataset": dataset,
                "ids": ids,
                "tokens": list(res.tokens),
                "rows": list(recorder.rows),
            }
        )
    return out


def _logits(row) -> torch.Tensor:
    values, ids, vocab = row
    full = torch.full((values.shape[0], vocab), float("-inf"))
    return full.scatter_(1, ids, values)


def replay(builder, rec: dict, drafter, index, eos_ids: tuple[int, ...]) -> tuple[list[int], int]:
    """Acceptance histogram of ``builder`` along one recorded greedy output, and the number
    of tree rows verified (every round's tree, root included)."""
    from dartcore.acceptance import flatten, prune
    from dartcore.trees import TreeInputs, node_budget

    ids, gen, rows = rec["ids"], rec["tokens"], rec["rows"]
    hist = [0] * 65
    nodes = 0  # tree nodes verified, roots included (the rows of the target forwards)
    g = 1  # the prefill commits the first token
    while g < len(gen):
        max_depth = len(gen) - g - 1 if g - 1 < len(rows) else 0
        accepted = 0
        if max_depth > 0:
            tree = builder(
                TreeInputs(
                    context=np.asarray(ids + gen[:g], dtype=np.int64),
                    logits=_logits(rows[g - 1]),
                    drafter=drafter,
                    index=index,
                    max_depth=max_depth,
                    max_nodes=node_budget(builder, drafter=drafter),
                    eos_token_ids=eos_ids,
                )
            )
            flat = prune(flatten(tree), max_depth=max_depth, max_nodes=1 << 30)
            nodes += len(flat.tokens) - 1
            children: dict[tuple[int, int], int] = {}
            for i in range(1, len(flat.tokens)):
                children[(int(flat.parents[i]), int(flat.tokens[i]))] = i
            node = 0
            while g + accepted < len(gen) and (node, gen[g + accepted]) in children:
                node = children[(node, gen[g + accepted])]
                accepted += 1
        hist[accepted] += 1
        nodes += 1
        g += accepted + 1
    return hist, nodes


def parse_config(text: str) -> tuple[str, dict]:
    """``"dart:max_nodes=3,ngram_weight=1.0"`` -> ``("dart", {"max_nodes": 3, "ngram_weight": 1.0})``."""
    tree, _, rest = text.partition(":")
    params: dict = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        for cast in (int, float):
            try:
                params[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            params[key] = {"True": True, "False": False}.get(value, value)
    return tree, params


def tau(hist: list[int]) -> float:
    rounds = sum(hist)
    return sum((a + 1) * c for a, c in enumerate(hist)) / rounds if rounds else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="smollm2")
    p.add_argument("--index", required=True)
    p.add_argument("--datasets", default="humaneval,gsm8k,code_alpaca")
    p.add_argument("--n", type=int, default=10, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--keep", type=int, default=64, help="top logits kept per drafter row")
    p.add_argument("--data-dir")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--recording", type=Path, help="cache of the recording pass (written if missing)"
    )
    p.add_argument("--configs", nargs="+", default=["dart", "dart+ctx"])
    p.add_argument(
        "--check", type=int, default=0, help="run the real decoder on this many prompts to compare"
    )
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from dartcore.benchmark.datasets import load_prompts
    from dartcore.decoder import DartDecoder
    from dartcore.index import NgramIndex
    from dartcore.models.hub import load_drafter, load_target
    from dartcore.trees import make_tree_builder

    model, tok = load_target(args.target, quantized=False)
    drafter = load_drafter(args.drafter, model, tok)
    index = NgramIndex(args.index)
    prompts = [
        (ds, m) for ds in args.datasets.split(",") for m in load_prompts(ds, args.n, args.data_dir)
    ]
    if args.recording and args.recording.exists():
        recs = torch.load(args.recording, weights_only=False)
    else:
        t0 = time.perf_counter()
        recs = record(DartDecoder, model, tok, drafter, prompts, args.max_new_tokens, args.keep)
        print(
            f"recorded {len(recs)} greedy outputs in {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
        )
        if args.recording:
            torch.save(recs, args.recording)
    eos = DartDecoder(model, tok, None, None, tree="ar").eos_token_ids

    results = []
    for text in args.configs:
        tree, params = parse_config(text)
        builder = make_tree_builder(tree, **params)
        t0 = time.perf_counter()
        by_ds: dict[str, list[int]] = {}
        rows = 0
        for rec in recs:
            h, n = replay(builder, rec, drafter, index, eos)
            rows += n
            acc = by_ds.setdefault(rec["dataset"], [0] * len(h))
            for i, c in enumerate(h):
                acc[i] += c
        taus = {ds: tau(h) for ds, h in by_ds.items()}
        rounds = sum(sum(h) for h in by_ds.values())
        results.append(
            {
                "config": text,
                "tau": taus,
                "median_tau": statistics.median(taus.values()),
                "rows_per_round": rows / rounds if rounds else 0.0,
                "hist": by_ds,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(
            f"{text:50s} "
            + " ".join(f"{ds} {t:.3f}" for ds, t in taus.items())
            + f"  median {results[-1]['median_tau']:.3f}  rows/round {results[-1]['rows_per_round']:.2f}",
            file=sys.stderr,
        )
    if args.check:
        tree, params = parse_config(args.configs[0])
        dec = DartDecoder(model, tok, drafter, index, tree=tree, **params)
        builder = make_tree_builder(tree, **params)
        for rec in recs[: args.check]:
            real = dec.generate(rec["ids"], max_new_tokens=args.max_new_tokens)
            sim, _ = replay(builder, rec, drafter, index, eos)
            hist = list(real.stats.accept_hist)
            same = sim[: len(hist)] == hist and not any(sim[len(hist) :])
            print(
                f"check {rec['dataset']}: tokens identical {real.tokens == rec['tokens']}, "
                f"histograms equal {same} (decoder {hist}, replay {sim[: max(len(hist), 1)]})",
                file=sys.stderr,
            )
    print("| config | " + " | ".join(args.datasets.split(",")) + " | median | rows / round |")
    print("|---|" + "---|" * (len(args.datasets.split(",")) + 2))
    for r in results:
        print(
            f"| {r['config']} | "
            + " | ".join(f"{r['tau'].get(ds, 0):.3f}" for ds in args.datasets.split(","))
            + f" | {r['median_tau']:.3f} | {r['rows_per_round']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

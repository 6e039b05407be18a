#!/usr/bin/env python3
"""Drafters (each with its own index) side by side in one run: τ, speedup over AR and hit@1 by
drafted position, per dataset.

    python tools/bench_drafters.py --datasets general,humaneval,gsm8k,code_alpaca --n 10 \\
        --variant shipped=smollm2@artifacts/demo/smollm2.idx \\
        --variant general=artifacts/general/run/export_fp16@artifacts/general/smollm2.idx --json

For every prompt the target decodes once with plain AR (the reference output and the time
every speedup is against), then every variant x method decodes the same prompt (greedy; the
output must equal AR token for token, which the report checks). hit@1 at drafted position k is
the fraction of the target's own greedy response tokens (AR's outputs, teacher-forced) that
the drafter's top-1 at position k predicts, as `dart-train --eval-only --eval-generate`
measures it; top-10 likewise. Writes a Markdown table to stdout and, with --json, the
whole report (``--out``, default artifacts/bench_drafters/bench_drafters.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))


def parse_variant(text: str) -> tuple[str, str, str | None]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected LABEL=DRAFTER[@INDEX]")
    label, rest = text.split("=", 1)
    drafter, _, index = rest.partition("@")
    if not label or not drafter:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected LABEL=DRAFTER[@INDEX]")
    return label, drafter, index or None


def hit_rates(model, tok, drafter, prompts, outputs, ctx_len: int = 512) -> dict:
    """hit@1 / top-10 per drafted position on the target's greedy responses."""
    from dartcore.cli.dart_train import _evaluate_with_progress
    from dartcore.training.data import Document, pack_documents, tokenize_document

    docs = [
        Document(
            messages=p + [{"role": "assistant", "content": tok.decode(o, skip_special_tokens=True)}]
        )
        for p, o in zip(prompts, outputs)
    ]
    seqs = pack_documents(
        [tokenize_document(d, tok) for d in docs], ctx_len, pad_id=tok.pad_token_id or 0
    )
    return _evaluate_with_progress(model, drafter, seqs, progress=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        required=True,
        help="LABEL=DRAFTER[@INDEX] (repeatable): a drafter directory or built-in name, and the "
        "index its methods read",
    )
    p.add_argument("--datasets", default="general,humaneval,gsm8k,code_alpaca")
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--skip", type=int, default=0, help="start at this prompt of each dataset")
    p.add_argument("--methods", default="dart,dart+ctx")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--out", default=str(REPO / "artifacts" / "bench_drafters" / "bench_drafters.json")
    )
    args = p.parse_args(argv)
    labels = [v[0] for v in args.variant]
    if len(set(labels)) != len(labels):
        p.error(f"--variant labels must differ, got {labels}")
    if args.n <= 0 or args.skip < 0 or args.max_new_tokens <= 0:
        p.error("--n and --max-new-tokens must be positive, --skip >= 0")

    import torch

    from dartcore.benchmark.datasets import load_prompts
    from dartcore.benchmark.runner import BenchConfig, _aggregate, _one, machine_info
    from dartcore.decoder import DartDecoder
    from dartcore.index import NgramIndex
    from dartcore.models.hub import load_drafter, load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    prompts = {d: load_prompts(d, args.skip + args.n, args.data_dir)[args.skip :] for d in datasets}
    model, tok = load_target(args.target, quantized=False)
    drafters, decoders = {}, {"ar": DartDecoder(model, tok, None, None, tree="ar")}
    for label, dname, iname in args.variant:
        drafters[label] = load_drafter(dname, model, tok)
        index = NgramIndex(iname) if iname else None
        for m in methods:
            decoders[f"{label}/{m}"] = DartDecoder(model, tok, drafters[label], index, tree=m)
    cfg = BenchConfig(max_new_tokens=args.max_new_tokens)
    warm = BenchConfig(max_new_tokens=4)
    for key in decoders:
        _one(decoders, key, model, tok, tok("Hello")["input_ids"], warm, 0.0, 0)

    rows, identical = [], True
    for ds in datasets:
        per = {k: [] for k in decoders}
        outputs = []
        for i, msgs in enumerate(prompts[ds]):
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
            ref = None
            for key in decoders:
                rec = _one(decoders, key, model, tok, ids, cfg, 0.0, i)
                if key == "ar":
                    ref = rec["tokens"]
                    outputs.append(ref)
                else:
                    rec["identical"] = rec["tokens"] == ref
                    identical &= rec["identical"]
                per[key].append(rec)
            print(f"{ds} {i + 1}/{len(prompts[ds])}", file=sys.stderr, flush=True)
        ar = _aggregate(per["ar"], None)
        for key in decoders:
            row = _aggregate(per[key], ar["tok_per_s"])
            row.update(
                dataset=ds,
                variant=key.split("/")[0] if "/" in key else "-",
                method=key.split("/")[-1],
            )
            if key != "ar":
                row["greedy_identical"] = all(r["identical"] for r in per[key])
            row["per_prompt_speedup"] = [
                (len(r["tokens"]) / r["seconds"]) / (len(a["tokens"]) / a["seconds"])
                for r, a in zip(per[key], per["ar"])
            ]
            rows.append(row)
        for label, drafter in drafters.items():
            t0 = time.time()
            res = hit_rates(model, tok, drafter, prompts[ds], outputs)
            rows.append(
                {
                    "dataset": ds,
                    "variant": label,
                    "method": "hit-rates",
                    **res,
                    "seconds": time.time() - t0,
                }
            )
            print(
                f"{ds} hit rates {label}: {[round(x, 3) for x in res['hit1']]}",
                file=sys.stderr,
                flush=True,
            )

    lines = [
        "| dataset | variant | method | τ | tok/s | speedup vs AR | median per-prompt speedup | identical |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["method"] == "hit-rates":
            continue
        tau = f"{r['tau']:.2f}" if r.get("tau") else "1.00"
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "1.00x"
        med = statistics.median(r["per_prompt_speedup"])
        lines.append(
            f"| {r['dataset']} | {r['variant']} | {r['method']} | {tau} | {r['tok_per_s']:.1f} | {sp} | "
            f"{med:.2f}x | {'yes' if r.get('greedy_identical', True) else 'NO'} |"
        )
    d = max(len(r["hit1"]) for r in rows if r["method"] == "hit-rates")
    lines += [
        "",
        "| dataset | variant | "
        + " | ".join(f"hit@1 k={k + 1}" for k in range(d))
        + " | top-10 k=1 | n k=1 |",
        "|---|---|" + "---:|" * (d + 2),
    ]
    for r in rows:
        if r["method"] == "hit-rates":
            lines.append(
                f"| {r['dataset']} | {r['variant']} | "
                + " | ".join(f"{x * 100:.1f}" for x in r["hit1"])
                + f" | {r['top10'][0] * 100:.1f} | {int(r['count'][0])} |"
            )
    print("\n".join(lines))
    print(f"greedy outputs identical to AR: {identical}")
    if args.json:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "machine": machine_info(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": rows,
            "greedy_identical": identical,
            "table": "\n".join(lines),
        }
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(out)
        print(f"wrote {out}", file=sys.stderr)
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The integer path against the exact one on a GGUF target's blocks (SmolLM2's Q4_1 file by
default): the target forward (30 layers + the LM head, through the native layer stack) of
1/2/4/8/16 rows after a cached prompt, exact vs int8, interleaved repeats, medians; and the
int8 path's distance from exact on held-out text (dolma-sample documents): greedy agreement of
the next token, mean KL(exact || int8) of the next-token distributions, perplexity of each.

    python3 tools/bench_int8.py [--target smollm2] [--repeats 9] [--docs 8] [--tokens 256] [--json PATH]

Prints a table; ``--json`` writes the report (machine, command, figures). ``--numerics int8
--docs 0`` times the int8 forward alone (no held-out pass): quick before/after comparisons of
the kernels, e.g. alternating two builds by ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _held_out(tok, docs: int, tokens: int, data: Path) -> list[list[int]]:
    out = []
    for path in sorted((data / "dolma-sample" / "documents").glob("*.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                ids = tok(json.loads(line).get("text", ""))["input_ids"]
                if len(ids) >= tokens:
                    out.append(ids[:tokens])
                if len(out) == docs:
                    return out
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--prompt", type=int, default=128, help="cached tokens before the timed rows")
    p.add_argument(
        "--numerics", default="exact,int8", help="the numerics timed (held-out needs both)"
    )
    p.add_argument("--docs", type=int, default=8, help="held-out documents (0: none)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument(
        "--data", default=str(Path(__file__).resolve().parents[1] / ".." / "shared" / "data")
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from dartcore.kernels.linear import (
        int8_kernel,
        linear_threads,
        native_linear_isa,
        torch_threads,
    )
    from dartcore.models.hub import load_target
    from dartcore.models.transformer import TargetModel

    if int8_kernel() is None:
        sys.exit("the integer kernels do not run here (AVX2 + FMA + F16C needed)")
    chosen = args.numerics.split(",")
    if not chosen or any(n not in ("exact", "int8") for n in chosen):
        sys.exit(f"--numerics: a comma-separated list of exact, int8 (got {args.numerics!r})")
    if args.docs and set(chosen) != {"exact", "int8"}:
        sys.exit("the held-out comparison needs --numerics exact,int8 (or --docs 0)")
    models = {}
    for numerics in chosen:
        model, tok = load_target(args.target, quantized=True, numerics=numerics)
        models[numerics] = TargetModel(model)
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).vocab_size
    prompt = torch.randint(0, vocab, (args.prompt,), generator=gen)
    block = torch.randint(0, vocab, (max(rows),), generator=gen)
    caches = {}
    for numerics, t in models.items():
        cache = t.new_cache(args.prompt + max(rows))
        t.forward(cache, prompt, torch.arange(args.prompt), logits_rows=slice(0, 0))
        cache.commit(args.prompt)
        caches[numerics] = cache
    times: dict[str, dict[int, list[float]]] = {n: {r: [] for r in rows} for n in models}
    with torch_threads(1):
        for _ in range(args.repeats + 1):  # the first pass warms up
            for r in rows:
                for numerics, t in models.items():
                    t0 = time.perf_counter()
                    t.forward(
                        caches[numerics], block[:r], torch.arange(args.prompt, args.prompt + r)
                    )
                    times[numerics][r].append((time.perf_counter() - t0) * 1e3)
    forward_ms = {
        n: {r: round(statistics.median(v[1:]), 2) for r, v in per.items()}
        for n, per in times.items()
    }
    extra_row_ms = {
        n: round((per[max(rows)] - per[min(rows)]) / (max(rows) - min(rows)), 3)
        for n, per in forward_ms.items()
    }

    docs = _held_out(tok, args.docs, args.tokens, Path(args.data)) if args.docs else []
    agree = total = 0
    kl_sum = 0.0
    nll = {"exact": 0.0, "int8": 0.0}
    for ids in docs:
        x = torch.tensor(ids)
        logp = {}
        for numerics, t in models.items():
            cache = t.new_cache(len(ids))
            out = t.forward(cache, x, torch.arange(len(ids)))
            logp[numerics] = torch.log_softmax(out.logits[:-1].double(), dim=-1)
            nll[numerics] += float(-logp[numerics].gather(1, x[1:, None]).sum())
        pe, pi = logp["exact"], logp["int8"]
        agree += int((pe.argmax(-1) == pi.argmax(-1)).sum())
        kl_sum += float((pe.exp() * (pe - pi)).sum())
        total += len(ids) - 1
    report = {
        "command": "python3 tools/bench_int8.py " + " ".join(sys.argv[1:]),
        "machine": {
            "cpu": _cpu_model(),
            "vcpus": os.cpu_count(),
            "isa": native_linear_isa(),
            "int8_kernel": int8_kernel(),
            "threads": linear_threads(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "target": args.target,
        "forward_ms": forward_ms,
        "extra_row_ms": extra_row_ms,
        "held_out": {
            "docs": len(docs),
            "positions": total,
            "greedy_agreement": round(agree / max(total, 1), 4),
            "mean_kl": round(kl_sum / max(total, 1), 5),
            "perplexity": {
                n: round(float(torch.exp(torch.tensor(v / max(total, 1)))), 3)
                for n, v in nll.items()
            },
        }
        if docs
        else None,
    }
    print(
        f"{report['machine']['cpu']}, {report['machine']['vcpus']} vCPUs, {report['machine']['isa']}, "
        f"int8 kernel {int8_kernel()}, {linear_threads()} threads; median of {args.repeats}, ms per forward"
    )
    print("rows     " + "".join(f"{r:>8}" for r in rows) + "   per extra row")
    for n in models:
        print(
            f"{n:<9}"
            + "".join(f"{forward_ms[n][r]:>8.2f}" for r in rows)
            + f"   {extra_row_ms[n]:.3f}"
        )
    h = report["held_out"]
    if h:
        print(
            f"held-out: {h['positions']} positions of {h['docs']} documents: greedy agreement {h['greedy_agreement']:.4f}, "
            f"mean KL {h['mean_kl']:.5f}, perplexity exact {h['perplexity']['exact']} / int8 {h['perplexity']['int8']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The integer path against the exact one on a GGUF target's blocks (SmolLM2's Q4_1 file by
default): the target forward (30 layers + the LM head, through the native layer stack) of
1/2/4/8/16 rows after a cached prompt, exact vs int8, interleaved repeats, medians; and the
int8 path's distance from exact on held-out text (dolma-sample documents): greedy agreement of
the next token, mean KL(exact || int8) of the next-token distributions, perplexity of each.

    python3 tools/bench_int8.py [--target smollm2] [--repeats 9] [--docs 8] [--tokens 256] [--json PATH]

``--section drafter``: the DART drafter on the int8 target, its products fp16-exact
(``draft_numerics="exact"``) against Q8_0 blocks on the integer kernels (``"int8"``): ms per
draft call (a round's drafter forward after a cached prompt: n real rows + MASK rows, medians
of interleaved repeats), top-1 agreement of the two drafters' draft rows along held-out text,
and ``dart`` on built-in chat prompts with each drafter (tau, the draft stage's ms per round,
tok/s medians; every output checked against the int8 target's own AR):

    python3 tools/bench_int8.py --section drafter --index artifacts/demo/smollm2.idx [--prompts 4] [--max-new-tokens 128] [--runs 3]

Prints a table; ``--json`` writes the report (machine, command, figures). ``--numerics int8
--docs 0`` times the int8 forward alone (no held-out pass): quick before/after comparisons of
the kernels, e.g. alternating two builds by ``PYTHONPATH``, or ``--int8-kernel vnni`` against
the default kernel (the report's ``machine.int8_kernel`` names the one that ran).
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


def _command() -> str:
    """The command line, with the environment variables that change the kernels' setup."""
    env = [
        f"{k}={os.environ[k]}"
        for k in (
            "DARTCORE_LINEAR_THREADS",
            "DARTCORE_LINEAR_ISA",
            "DARTCORE_INT8_KERNEL",
            "DARTCORE_NATIVE_LINEAR",
        )
        if k in os.environ
    ]
    return " ".join([*env, "python3 tools/bench_int8.py", *sys.argv[1:]])


def _machine() -> dict:
    from dartcore.kernels.linear import int8_kernel, linear_threads, native_linear_isa

    return {
        "cpu": _cpu_model(),
        "vcpus": os.cpu_count(),
        "isa": native_linear_isa(),
        "int8_kernel": int8_kernel(),
        "threads": linear_threads(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
    }


def drafter_section(args) -> None:
    """The drafter fp16 against Q8_0 on the int8 target (see the module docs)."""
    from dartcore import DartDecoder
    from dartcore.benchmark.datasets import load_prompts
    from dartcore.drafter import DartDrafter
    from dartcore.index import NgramIndex
    from dartcore.kernels.linear import int8_kernel, torch_threads
    from dartcore.models.hub import load_target

    if int8_kernel() is None:
        sys.exit("the integer kernels do not run here (AVX2 + FMA + F16C needed)")
    if not args.index:
        sys.exit("--section drafter needs --index (e.g. artifacts/demo/smollm2.idx)")
    model, tok = load_target(args.target, quantized=True, numerics="int8")
    index = NgramIndex(args.index)
    kinds = ("exact", "int8")
    decs = {
        n: DartDecoder(
            model,
            tok,
            DartDrafter.from_pretrained(args.target, model, tokenizer=tok),
            index,
            tree="dart",
            draft_numerics=n,
        )
        for n in kinds
    }
    ar = DartDecoder(model, tok, None, index, tree="ar")
    steps = {n: d.backend.native_drafts[id(d.drafter)] for n, d in decs.items()}
    assert all(steps[n].numerics == n for n in kinds)
    drafter = decs["exact"].drafter
    target = decs["exact"].target

    # real taps of held-out text for both measurements below
    docs = _held_out(tok, args.docs, args.tokens, Path(args.data))
    if not docs:
        sys.exit(f"no dolma-sample documents of {args.tokens} tokens under {args.data}")

    def taps_of(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(torch.tensor(ids)[None], output_hidden_states=True).hidden_states
        return torch.cat([hidden[t] for t in drafter.taps], -1)[0]

    # ms per draft call: n real rows + (rows - 1) MASK rows after a cached prompt
    shapes = [(1, 2), (2, 2), (3, 2), (1, drafter.d)]
    ids = docs[0]
    taps = taps_of(ids)
    x = torch.tensor(ids)
    prompt = args.prompt
    call_ms: dict[str, dict[str, list[float]]] = {
        n: {f"{a}+{b - 1}": [] for a, b in shapes} for n in kinds
    }
    with torch_threads(1):
        for rep in range(args.repeats + 1):  # the first pass warms up
            for n_real, rows in shapes:
                for n, step in steps.items():
                    state = step.drafter.new_state(prompt + 16)
                    step.draft(state, taps[:prompt], x[1 : prompt + 1])
                    t0 = time.perf_counter()
                    step.draft(
                        state,
                        taps[prompt : prompt + n_real],
                        x[prompt + 1 : prompt + 1 + n_real],
                        rows=rows,
                    )
                    if rep:
                        call_ms[n][f"{n_real}+{rows - 1}"].append((time.perf_counter() - t0) * 1e3)
    draft_call_ms = {
        n: {k: round(statistics.median(v), 3) for k, v in per.items()} for n, per in call_ms.items()
    }
    # the fastest call of each: the cost without other processes' interference (a shared box)
    draft_call_min_ms = {
        n: {k: round(min(v), 3) for k, v in per.items()} for n, per in call_ms.items()
    }

    # top-1 agreement of the draft rows, each drafter on its own state along the text
    agree, drafts = torch.zeros(drafter.d), 0
    for ids in docs:
        x, taps = torch.tensor(ids), taps_of(ids)
        states = {n: s.drafter.new_state(len(ids) + drafter.d) for n, s in steps.items()}
        for n, s in steps.items():
            s.draft(states[n], taps[:32], x[1:33])
        for q in range(32, len(ids) - 1):
            top = {
                n: s.draft(states[n], taps[q : q + 1], x[q + 1 : q + 2]).argmax(-1)
                for n, s in steps.items()
            }
            agree += (top["exact"] == top["int8"]).float()
            drafts += 1
    rate = (agree / max(drafts, 1)).tolist()

    # dart on built-in chat prompts with each drafter
    prompts = load_prompts("builtin", args.prompts)
    want = [ar.generate(m, max_new_tokens=args.max_new_tokens).tokens for m in prompts]
    runs: dict[str, list[dict]] = {n: [] for n in kinds}
    for _ in range(args.runs):
        for n, dec in decs.items():
            tokens = seconds = draft_s = 0.0
            rounds = 0
            taus = []
            for m, w in zip(prompts, want):
                res = dec.generate(m, max_new_tokens=args.max_new_tokens)
                if list(res.tokens) != list(w):
                    sys.exit(f"draft_numerics={n}: an output differs from the int8 target's own AR")
                st = res.stats
                tokens += st.new_tokens
                seconds += st.total_s
                draft_s += st.seconds["draft"]
                rounds += st.rounds
                taus.append(st.tau)
            runs[n].append(
                {
                    "tok_s": tokens / seconds,
                    "draft_ms_per_round": draft_s / max(rounds, 1) * 1e3,
                    "tau": statistics.mean(taus),
                    "draft_share": draft_s / seconds,
                }
            )
    dart = {
        n: {
            k: round(statistics.median(r[k] for r in per), 4 if k in ("tau", "draft_share") else 2)
            for k in per[0]
        }
        for n, per in runs.items()
    }
    report = {
        "command": _command(),
        "machine": _machine(),
        "target": args.target,
        "target_numerics": target.numerics,
        "max_nodes": decs["exact"].max_nodes,
        "draft_call_ms": {
            "rows": "real + MASK rows of one draft call after a cached prompt of "
            f"{prompt} tokens; median of {args.repeats}",
            **draft_call_ms,
            "min": draft_call_min_ms,
        },
        "draft_top1_agreement": {
            "drafts": drafts,
            "per_row": [round(r, 4) for r in rate],
            "mean": round(sum(rate) / len(rate), 4),
        },
        "dart": {
            "prompts": f"{len(prompts)} built-in chat prompts x {args.max_new_tokens} new tokens, "
            f"median of {args.runs} runs; outputs equal the int8 target's own AR",
            **dart,
        },
    }
    mach = report["machine"]
    print(
        f"{mach['cpu']}, {mach['vcpus']} vCPUs, {mach['isa']}, int8 kernel {mach['int8_kernel']}, "
        f"{mach['threads']} threads; int8 target, drafter products fp16 (exact) vs Q8_0 (int8)"
    )
    print("ms per draft call (real+MASK rows): " + ", ".join(draft_call_ms["exact"]))
    for n in kinds:
        print(
            f"  {n:<6}"
            + "".join(f"{v:>9.3f}" for v in draft_call_ms[n].values())
            + "   min "
            + " ".join(f"{v:.3f}" for v in draft_call_min_ms[n].values())
        )
    print(f"top-1 agreement over {drafts} drafts, per row: {[round(r, 3) for r in rate]}")
    for n in kinds:
        r = dart[n]
        print(
            f"dart {n:<6} tau {r['tau']:.3f}  {r['tok_s']:.1f} tok/s  draft {r['draft_ms_per_round']:.3f} "
            f"ms/round ({100 * r['draft_share']:.1f}% of the time)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


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
    p.add_argument("--section", choices=("target", "drafter"), default="target")
    p.add_argument("--index", default=None, help="the n-gram index (--section drafter)")
    p.add_argument("--prompts", type=int, default=4, help="built-in chat prompts (drafter)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="dart runs over the prompts (drafter)")
    p.add_argument(
        "--int8-kernel",
        choices=("amx", "vnni", "avxvnni", "avx2"),
        default=None,
        help="the integer kernel (default: the fastest this CPU runs)",
    )
    args = p.parse_args()
    if args.int8_kernel:
        # read once, when dartcore.kernels.linear is first imported (below)
        os.environ["DARTCORE_INT8_KERNEL"] = args.int8_kernel
        from dartcore.kernels.linear import int8_kernel

        if int8_kernel() != args.int8_kernel:
            sys.exit(f"--int8-kernel {args.int8_kernel}: this CPU runs {int8_kernel()}")
    if args.section == "drafter":
        return drafter_section(args)

    from dartcore.kernels.linear import (
        int8_kernel,
        linear_threads,
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
        "command": _command(),
        "machine": _machine(),
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

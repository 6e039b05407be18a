"""Speed of decoders that learn from what they serve (dartcore.live), on workloads that repeat
themselves, against the same decoder without the live layer, in one run.

Every method decodes the same request sequence, greedy, each with a fresh live layer of its
own; the methods take each request in turn, so their times are taken seconds apart:

* ``ask``:        five questions, first time;
* ``revise``:     two-turn conversations whose second turn revises the first answer (comments
                  on every line, shorter, in French), the first answer in the context;
* ``code-edit``:  edit requests over functions the package ships, two per function;
* ``ask-again``:  the five questions again, as another client would ask them;
* ``fresh``:      five first-turn prompts seen nowhere before (nothing to learn from).

Methods: ``ar``, ``dart``, ``dart+ctx``, ``suffix`` (the suffix-match chain alone, what a
suffix-decoding peer runs), ``dart+mix`` and ``dart+live``. Outputs are checked equal to
``ar``'s; each method's speed is also given as the median, over the runs, of its ratio to
``ar``, ``dart`` and ``suffix`` within a run. A method named ``name@key=value`` gets that tree
parameter, read as ``--tree-param`` reads it (``dart+live@short=0``,
``dart+live@adapt=false``). Also measured: the insert of a
128-token output into a layer holding the package's source, the layer's bytes per million
tokens, and one search with and without the layer.

    python3 tools/bench_live.py --index artifacts/demo/smollm2.idx --repeats 3 \\
        --json tools/reports/bench_live_smollm2.json

``--weights 0.25,0.5,0.75`` runs ``dart+mix`` and ``dart+live`` once per λ of the mix (shown
as ``dart+mix@0.25``...), to choose ``dartcore.live.LIVE_WEIGHT``: ``weight_sweep`` in the
report gives each one's speed over ``dart`` on the repetitive workloads and on fresh prompts.

``--serve`` adds the same through ``dart-serve`` on 127.0.0.1 (one worker): one client asks
the five questions, another client of the same tenant asks them again, then the fresh
prompts; servers with speculation off, ``dart`` and ``dart+ctx`` (both without learning), and
``suffix`` / ``dart+live`` with ``--learn``, each with its default budget; new servers every
run, medians over the runs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

QUESTIONS = [
    "How do I reverse a list in Python?",
    "What is the difference between a process and a thread?",
    "Explain what a hash table is.",
    "Give three tips for writing clear emails.",
    "What causes the seasons on Earth?",
]
FIRST_TURNS = [
    "Write a short Python function that checks whether a string is a palindrome.",
    "Write a haiku about autumn leaves.",
    "Summarise why unit tests are useful, in three sentences.",
]
REVISIONS = [
    "Now rewrite your answer with a comment on every line.",
    "Now make your answer shorter.",
    "Now translate your answer into French.",
]
EDITS = [
    "Add a comment above every line of this function:",
    "Rewrite this function with clearer variable names:",
]
FRESH = [
    "Describe how a bicycle works.",
    "What is a good way to learn a new language?",
    "Name three uses of copper.",
    "Why is the sky blue?",
    "Suggest a name for a small bakery.",
]
METHODS = ["ar", "dart", "dart+ctx", "suffix", "dart+mix", "dart+live"]
LIVE_MIXES = ("dart+mix", "dart+live")
REPETITIVE = ("ask-again", "code-edit", "revise")


def code_snippets() -> list[str]:
    from dartcore import live, trees

    return [inspect.getsource(trees.context_continuation), inspect.getsource(live.live_layer)]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def workload(answers: dict[str, str]):
    """(category, chat messages) in serving order. A second turn carries the first turn's
    answer, read from ``answers`` when it comes up (the method's own first turn, which equals
    every other method's: outputs are the target's)."""
    yield from (("ask", user(q)) for q in QUESTIONS)
    yield from (("first-turn", user(q)) for q in FIRST_TURNS)
    for q, r in zip(FIRST_TURNS, REVISIONS):
        yield ("revise", user(q) + [{"role": "assistant", "content": answers[q]}] + user(r))
    for code in code_snippets():
        for e in EDITS:
            yield ("code-edit", user(f"{e}\n```python\n{code}```"))
    yield from (("ask-again", user(q)) for q in QUESTIONS)
    yield from (("fresh", user(q)) for q in FRESH)


def method_parts(dec, method: str, drafter, max_nodes=None) -> dict:
    """The decoder parts ``method`` runs with, its own live layer among them (kept across the
    workload, as a server keeps its layer and its tree builder's judge)."""
    from dartcore.cli._common import tree_param
    from dartcore.live import LiveLayer
    from dartcore.trees import make_tree_builder, node_budget

    # "dart+mix@0.25": the mix at λ = 0.25; "dart+live@trust=4", "@adapt=false": a parameter
    name, _, given = method.partition("@")
    params = {} if max_nodes is None or method == "ar" else {"max_nodes": max_nodes}
    for item in filter(None, given.split(",")):
        key, value = tree_param(item if "=" in item else f"live_weight={item}")
        params[key] = value
    builder = make_tree_builder(name, **params)
    used = drafter if builder.needs_drafter else None
    nodes = node_budget(
        builder,
        drafter=used,
        device=dec.target.device.type,
        blocks=bool(getattr(dec.target, "blocks", False)),
    )
    return {
        "builder": builder,
        "drafter": used,
        "max_nodes": nodes,
        "live": LiveLayer(dec.target.vocab_size),
    }


def run_methods(dec, methods, drafter, max_new_tokens, max_nodes=None, turn=0):
    """Every method decodes the workload, request by request: each request is decoded by
    every method in turn (the order rotating by one with every request, starting at
    ``turn``), so that a method's time and its peers' are taken seconds apart and the
    machine's drift favours none. Each method keeps its own live layer and tree builder
    over the workload. Returns {method: rows}."""
    parts = {m: method_parts(dec, m, drafter, max_nodes) for m in methods}
    rows = {m: [] for m in methods}
    answers: dict[str, str] = {}
    for i, (cat, msgs) in enumerate(workload(answers)):
        k = (turn + i) % len(methods)
        for m in methods[k:] + methods[:k]:
            for key, value in parts[m].items():
                setattr(dec.parts, key, value)
            t0 = time.perf_counter()
            res = dec.generate(msgs, max_new_tokens=max_new_tokens)
            dt = time.perf_counter() - t0
            if cat == "first-turn":
                answers.setdefault(msgs[0]["content"], res.text)
            rows[m].append(
                {
                    "category": cat,
                    "tokens": res.tokens,
                    "s": dt,
                    "tau": res.stats.tau,
                    "max_nodes": parts[m]["max_nodes"],
                }
            )
    return rows


def micro(index, tok, repeats: int) -> dict:
    """Insert, memory and search costs with the layer holding the package's own source."""
    from dartcore import tree as T
    from dartcore.live import LiveLayer

    docs = []
    for p in sorted((ROOT / "python" / "dartcore").rglob("*.py")) + sorted(ROOT.glob("docs/*.md")):
        docs.append(tok(p.read_text(), add_special_tokens=False)["input_ids"])
    vocab = int(index.vocab_size)
    layer = LiveLayer(vocab)
    for d in docs:
        layer.insert(d)
    held = len(layer)
    rng = np.random.default_rng(0)
    outs = [docs[int(rng.integers(len(docs)))] for _ in range(200)]
    outs = [d[:128] for d in outs if len(d) >= 128]
    # at capacity every inserted token also evicts one
    full = LiveLayer(vocab, capacity=held)
    for d in docs:
        full.insert(d)
    ins_full = []
    for o in outs:
        t0 = time.perf_counter()
        full.insert(o)
        ins_full.append(time.perf_counter() - t0)
    ins = []
    probe = LiveLayer(vocab, capacity=held + 200 * 130)
    for d in docs:
        probe.insert(d)
    for o in outs:
        t0 = time.perf_counter()
        probe.insert(o)
        ins.append(time.perf_counter() - t0)
    # searches over real contexts: rows of random top-k over the vocabulary
    ctxs = [d[i : i + 8] for d in docs[:40] for i in range(0, len(d) - 8, 97)][:200]
    toks = np.stack([rng.permutation(vocab)[:8] for _ in range(6)]).astype(np.int64)
    lps = np.log(np.full((6, 8), 1 / 8, dtype=np.float32))
    timing = {}
    for name, kw in (("static", {}), ("with_live", {"live": layer})):
        per = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for c in ctxs:
                T.beam_search(index, c, toks, lps, max_nodes=4, **kw)
            per.append((time.perf_counter() - t0) / len(ctxs))
        timing[name] = statistics.median(per) * 1e6
    return {
        "layer_tokens": held,
        "bytes_per_million_tokens": round(layer.nbytes() / held * 1e6),
        "insert_128_us_median": round(statistics.median(ins) * 1e6, 1),
        "insert_128_at_capacity_us_median": round(statistics.median(ins_full) * 1e6, 1),
        "search_us_median": {k: round(v, 1) for k, v in timing.items()},
        "search_ratio": round(timing["with_live"] / timing["static"], 3),
    }


SERVE_MODES = {
    "off": ["--max-nodes", "0"],
    "dart": ["--tree", "dart"],
    "dart+ctx": ["--tree", "dart+ctx"],
    "suffix --learn": ["--tree", "suffix", "--learn"],
    "dart+live --learn": ["--tree", "dart+live", "--learn"],
}


def target_weight_flags(args) -> list[str]:
    """The --quantized / --numerics flags this run was given, for dart-serve."""
    flags = []
    if args.quantized is not None:
        flags.append("--quantized" if args.quantized else "--no-quantized")
    if args.numerics is not None:
        flags += ["--numerics", args.numerics]
    return flags


def serve_section(args, threads: int) -> dict:
    """Phases ask / ask-again (another client) / fresh through one dart-serve per mode, a
    new server each run (``--repeats`` runs, every other one with the modes in reverse
    order): medians of each phase's tok/s and of its ratio to the server with speculation
    off within a run."""
    import tempfile

    from bench_serve import Server, _one_request

    phases = [("ask", QUESTIONS), ("ask-again", QUESTIONS), ("fresh", FRESH)]
    modes = list(SERVE_MODES)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(max(1, args.repeats)):
            run: dict = {}
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                server = Server(
                    [
                        "--index",
                        args.index,
                        "--workers",
                        "1",
                        "--threads",
                        str(threads),
                        *target_weight_flags(args),
                        *SERVE_MODES[mode],
                    ],
                    Path(tmp) / "serve.log",
                    600.0,
                )
                try:
                    run[mode] = {}
                    for phase, qs in phases:
                        tokens = seconds = 0.0
                        for q in qs:
                            body = {
                                "model": "smollm2",
                                "messages": user(q),
                                "max_tokens": args.max_new_tokens,
                                "temperature": 0,
                                "stream": True,
                                "stream_options": {"include_usage": True},
                            }
                            r = _one_request(server.port, body, 600.0)
                            if "error" in r:
                                raise SystemExit(f"dart-serve ({mode}): {r['error']}")
                            tokens += r["tokens"]
                            seconds += r["latency"]
                        run[mode][phase] = tokens / seconds
                finally:
                    server.stop()
            runs.append(run)
    return {
        mode: {
            phase: {
                "tok_s": round(statistics.median(r[mode][phase] for r in runs), 1),
                "vs_off": round(
                    statistics.median(r[mode][phase] / r["off"][phase] for r in runs), 3
                ),
            }
            for phase, _ in phases
        }
        for mode in modes
    }


def summarise(rows_by_method: dict[str, list[dict]]) -> dict:
    cats = sorted({r["category"] for r in next(iter(rows_by_method.values()))})
    out = {}
    for m, rows in rows_by_method.items():
        out[m] = {}
        for c in cats:
            sel = [r for r in rows if r["category"] == c]
            n = sum(len(r["tokens"]) for r in sel)
            out[m][c] = {
                "tok_s": n / sum(r["s"] for r in sel),
                "tau": statistics.mean(r["tau"] for r in sel),
            }
    return out


def main() -> None:
    from dartcore.cli._common import add_target_weights

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default="smollm2")
    ap.add_argument("--index", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1, help="whole runs; medians reported")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--max-nodes", type=int, default=None, help="every method's node budget (default: each own)"
    )
    ap.add_argument(
        "--weights",
        default=None,
        help="comma-separated λ of the live mix: dart+mix and dart+live once per value",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve", action="store_true", help="also measure through dart-serve")
    add_target_weights(ap)
    args = ap.parse_args()

    import torch

    from bench_int8 import _cpu_model
    from dartcore import DartDecoder
    from dartcore.kernels.linear import int8_kernel, linear_threads, native_linear_isa

    dec = DartDecoder.from_pretrained(
        args.target,
        args.drafter,
        args.index,
        tree="dart",
        quantized=args.quantized,
        numerics=args.numerics,
    )
    drafter = dec.parts.drafter
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if methods[0] != "ar":
        methods.insert(0, "ar")
    if args.weights:
        weights = [float(w) for w in args.weights.split(",") if w.strip()]
        methods = [
            f"{m}@{w:g}" if w is not None else m
            for m in methods
            for w in (weights if m in LIVE_MIXES else [None])
        ]
    runs = []
    identical = True
    for rep in range(max(1, args.repeats)):
        # each run starts the rotation of the methods elsewhere
        rows = run_methods(dec, methods, drafter, args.max_new_tokens, args.max_nodes, turn=rep * 3)
        for m in methods:
            identical &= all(a["tokens"] == b["tokens"] for a, b in zip(rows["ar"], rows[m]))
        runs.append(summarise(rows))
        used = {m: rows[m][0]["max_nodes"] for m in methods}
    cats = list(runs[0]["ar"])
    table = {
        m: {
            c: {
                "tok_s": round(statistics.median(r[m][c]["tok_s"] for r in runs), 1),
                "tau": round(statistics.median(r[m][c]["tau"] for r in runs), 2),
                "vs_ar": round(
                    statistics.median(r[m][c]["tok_s"] / r["ar"][c]["tok_s"] for r in runs), 3
                ),
                "vs_dart": round(
                    statistics.median(r[m][c]["tok_s"] / r["dart"][c]["tok_s"] for r in runs), 3
                )
                if "dart" in methods
                else None,
                "vs_suffix": round(
                    statistics.median(r[m][c]["tok_s"] / r["suffix"][c]["tok_s"] for r in runs), 3
                )
                if "suffix" in methods
                else None,
                # the spread of that ratio over the runs: the machine's noise, which the
                # methods' equal work on repeated questions shows too
                "vs_suffix_range": [
                    round(f(r[m][c]["tok_s"] / r["suffix"][c]["tok_s"] for r in runs), 3)
                    for f in (min, max)
                ]
                if "suffix" in methods
                else None,
            }
            for c in cats
        }
        for m in methods
    }
    sweep = None
    if args.weights and "dart" in methods:
        sweep = {
            m: {
                "repetitive_vs_dart_mean": round(
                    statistics.mean(table[m][c]["vs_dart"] for c in REPETITIVE if c in table[m]), 3
                ),
                "fresh_vs_dart": table[m].get("fresh", {}).get("vs_dart"),
                "repetitive_tau_mean": round(
                    statistics.mean(table[m][c]["tau"] for c in REPETITIVE if c in table[m]), 3
                ),
            }
            for m in methods
            if "@" in m
        }
    mic = micro(dec.parts.index, dec.tokenizer, max(3, args.repeats))
    served = serve_section(args, torch.get_num_threads()) if args.serve else None
    report = {
        "command": "python3 tools/bench_live.py " + " ".join(sys.argv[1:]),
        "machine": {
            "cpu": _cpu_model(),
            "vcpus": os.cpu_count(),
            "isa": native_linear_isa(),
            "int8_kernel": int8_kernel(),
            "threads": linear_threads(),
            "torch_threads": torch.get_num_threads(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "target": args.target,
        "numerics": getattr(dec.target, "numerics", None),
        "drafter": args.drafter,
        "index": args.index,
        "max_new_tokens": args.max_new_tokens,
        "max_nodes": args.max_nodes,
        "max_nodes_used": used,
        "repeats": args.repeats,
        "outputs_identical_to_ar": identical,
        "results": table,
        "weight_sweep": sweep,
        "live_layer": mic,
        "serve": served,
    }
    print(
        f"{report['machine']['cpu']}, {report['machine']['vcpus']} vCPUs, "
        f"{report['machine']['isa']}; {args.target} ({report['numerics']}), median of "
        f"{args.repeats}; tok/s (tau) [x dart]"
    )
    print(f"{'method':<16}" + "".join(f"{c:>26}" for c in cats))
    for m in methods:
        cells = []
        for c in cats:
            t = table[m][c]
            cells.append(f"{t['tok_s']:.1f} ({t['tau']:.2f}) [{t['vs_dart'] or 0:.2f}x]")
        print(f"{m:<16}" + "".join(f"{x:>26}" for x in cells))
    print(f"outputs identical to ar: {identical}")
    if sweep:
        print("weight sweep: " + json.dumps(sweep))
    print(json.dumps(mic))
    if served:
        print("dart-serve, tok/s [x off]: " + json.dumps(served))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()

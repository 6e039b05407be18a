"""dartcore demo: index -> drafter -> DartDecoder vs AR on a handful of prompts.

The target loads the way ``DartDecoder.from_pretrained`` loads it by default, which is what a
CPU user runs: a GGUF target (the built-in ``smollm2``) keeps its quantized blocks, streamed by
the native kernels. ``--fp32`` runs its float32 conversion instead. The exit status is 0 only
when every DART answer equals plain AR's token for token on the same path.

Every step prints what it does; outputs go to artifacts/demo/ (git-ignored): the corpus,
the index (smollm2.idx) and the results next to it (smollm2_demo.json and .md: answers,
τ, tok/s, speedup, identity with AR).
Rerunning reuses the corpus and the index when they are already there.

    python tools/demo.py                 # defaults: ~60 MB of local text, 5 prompts
    python tools/demo.py --corpus-bytes 20M --prompts 2 --max-new-tokens 64
    python tools/demo.py --fp32          # the float32 conversion of the GGUF
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


TARGET_RESPONSES = REPO / "python" / "dartcore" / "assets" / "corpus" / "smollm2_responses.jsonl.gz"
GENERAL_RESPONSES = (
    REPO / "python" / "dartcore" / "assets" / "corpus" / "smollm2_general_responses.jsonl.gz"
)


def write_task_responses(path: Path) -> int:
    """Domain text for the index, as Dolma documents: the responses of the shared training
    sets (GSM8K train solutions, CodeAlpaca answers; never the eval sets) and SmolLM2's own
    greedy responses to training prompts, math/code and general conversation (shipped, made by
    tools/generate_target_responses.py; the general prompts held out for evaluation excluded).
    With it the n-gram-only tree's tau rises from 1.38 to 1.67 on GSM8K and 1.46 to 1.65 on
    CodeAlpaca (3 prompts each, 8 nodes). Written to a temp file, then renamed."""
    import gzip
    import json

    from dartcore.benchmark.datasets import find_data_dir
    from dartcore.training.data import read_documents

    sources = []
    data = find_data_dir()
    if data is not None:
        sources += [("shared-train", f) for f in sorted((data / "train").glob("*.json*"))]
    for source, file in (
        ("smollm2-responses", TARGET_RESPONSES),
        ("smollm2-general-responses", GENERAL_RESPONSES),
    ):
        if file.is_file():
            sources.append((source, file))
    n = 0
    tmp = path.with_suffix(".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for source, file in sources:
            for i, doc in enumerate(read_documents(file)):
                if not doc.messages or doc.messages[-1]["role"] != "assistant":
                    continue
                f.write(
                    json.dumps(
                        {
                            "id": f"{file.name}:{i}",
                            "text": doc.messages[-1]["content"],
                            "source": source,
                            "metadata": {"path": str(file), "record": i},
                        }
                    )
                    + "\n"
                )
                n += 1
    os.replace(tmp, path)
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=str(REPO / "artifacts" / "demo"))
    p.add_argument(
        "--corpus-bytes", default="60M", help="local text for the index (make_local_corpus)"
    )
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="smollm2")
    p.add_argument("--tokenizer", help="tokenizer for the index (default: the target's)")
    p.add_argument("--tree", help="tree builder (default: the decoder's, dart+live on the CPU)")
    p.add_argument(
        "--fp32",
        action="store_true",
        help="run the float32 conversion of a GGUF target instead of its blocks (the default path)",
    )
    p.add_argument(
        "--no-task-text",
        dest="task_text",
        action="store_false",
        help="index only the local text (not the training responses, see write_task_responses)",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    corpus = out / "corpus"
    if not list((corpus / "documents").glob("*.json.gz")):
        step(
            f"1/4 local corpus: {args.corpus_bytes} of text that ships with this machine -> {corpus}"
        )
        subprocess.run(
            [
                sys.executable,
                str(REPO / "tools" / "make_local_corpus.py"),
                "--output",
                str(corpus),
                "--max-bytes",
                args.corpus_bytes,
            ],
            check=True,
        )
    else:
        step(f"1/4 local corpus: reusing {corpus}")

    task_file = corpus / "documents" / "task-responses.json.gz"
    if args.task_text and not task_file.exists():
        n = write_task_responses(task_file)
        step(
            f"1b/4 task-domain text: {n} responses (shared training data + the shipped target responses) -> {task_file}"
        )

    index = out / (Path(args.target).name + ".idx")
    if not index.exists():
        files = [str(corpus / "documents" / "*.json.gz")]
        from dartcore.benchmark.datasets import find_data_dir

        data = find_data_dir()
        if data and (data / "dolma-sample" / "documents").is_dir():
            files.append(str(data / "dolma-sample" / "documents" / "*"))
        step(
            f"2/4 ngram-build: {args.tokenizer or args.target} tokenizer, trigram index -> {index}"
        )
        cmd = [
            sys.executable,
            "-m",
            "dartcore.cli.ngram_build",
            "--corpus",
            "dolma",
            "--tokenizer",
            args.tokenizer or args.target,
            "--output",
            str(index),
            "--memory",
            "4G",
        ]
        for f in files:
            cmd += ["--files", f]
        print("   $ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    else:
        step(f"2/4 ngram-build: reusing {index}")

    # The path a CPU user gets: DartDecoder.from_pretrained's defaults (a GGUF target keeps its
    # blocks, quantized=None); --fp32 asks for the float32 conversion instead.
    from dartcore import DartDecoder
    from dartcore.benchmark.datasets import BUILTIN_PROMPTS

    quantized = False if args.fp32 else None
    dart = DartDecoder.from_pretrained(
        args.target, args.drafter, index, tree=args.tree, quantized=quantized
    )
    args.tree = dart.tree  # the decoder's default where --tree names none
    path = "GGUF blocks" if getattr(dart.target, "blocks", False) else "float32"
    step(f"3/4 loaded target ({args.target}, {path}, CPU), drafter and index")
    st = dart.index.stats()
    print(f"   index: {st.get('nodes')} nodes, {st.get('bytes_per_node', 0):.2f} bytes/node")
    # AR loaded the same way, so that both answers come from one numerical path
    ar = DartDecoder.from_pretrained(args.target, tree="ar", quantized=quantized)

    step(
        f"4/4 generate: {args.prompts} prompts, {args.max_new_tokens} new tokens, greedy; "
        "DART's answer streams as it decodes, then the same prompt with plain AR"
    )
    for m in (dart, ar):  # warm-up
        m.generate("Hi", max_new_tokens=4)
    rows = []
    prompts = BUILTIN_PROMPTS[: args.prompts]
    for i, text in enumerate(prompts):
        messages = [{"role": "user", "content": text}]
        print(f"\n--- prompt {i + 1}/{len(prompts)}: {text}", flush=True)
        r_dart = None
        for chunk in dart.stream(messages, max_new_tokens=args.max_new_tokens):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            r_dart = chunk.result or r_dart
        print(flush=True)
        r_ar = ar.generate(messages, max_new_tokens=args.max_new_tokens)
        same = r_ar.tokens == r_dart.tokens
        speedup = r_dart.stats.tokens_per_s / r_ar.stats.tokens_per_s
        rows.append(
            {
                "prompt": text,
                "answer": r_dart.text,
                "identical": same,
                "tau": r_dart.stats.tau,
                "new_tokens": r_dart.stats.new_tokens,
                "dart_tok_s": r_dart.stats.tokens_per_s,
                "ar_tok_s": r_ar.stats.tokens_per_s,
                "speedup": speedup,
                "dart_s": r_dart.stats.total_s,
                "ar_s": r_ar.stats.total_s,
                "rounds": r_dart.stats.rounds,
                "ar_new_tokens": r_ar.stats.new_tokens,
            }
        )
        print(
            f"[DART τ = {r_dart.stats.tau:.2f}, {r_dart.stats.tokens_per_s:.1f} tok/s | "
            f"AR {r_ar.stats.tokens_per_s:.1f} tok/s | speedup {speedup:.2f}× | "
            f"identical to AR: {'yes' if same else 'NO'}]",
            flush=True,
        )
    import torch

    d_tok = sum(r["new_tokens"] for r in rows)
    d_s = sum(r["dart_s"] for r in rows)
    ar_s = sum(r["ar_s"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    ar_tok = sum(r["ar_new_tokens"] for r in rows)
    summary = {
        "dart_tok_s": d_tok / d_s,
        "ar_tok_s": ar_tok / ar_s,
        "tau": sum(r["tau"] * r["rounds"] for r in rows) / rounds if rounds else 0.0,
        "identical": all(r["identical"] for r in rows),
        "total_s": time.time() - t_start,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    summary["speedup"] = summary["dart_tok_s"] / summary["ar_tok_s"]
    print(
        f"\n== summary: DART {summary['dart_tok_s']:.1f} tok/s (τ = {summary['tau']:.2f}) vs AR "
        f"{summary['ar_tok_s']:.1f} tok/s -> speedup {summary['speedup']:.2f}×; greedy outputs identical: "
        f"{summary['identical']}; total {summary['total_s']:.0f} s (torch threads: {summary['torch_threads']}, "
        f"{summary['cpus']} CPUs)"
    )
    results = {
        "target": args.target,
        "weights": path,
        "drafter": args.drafter,
        "index": str(index),
        "tree": args.tree,
        "max_new_tokens": args.max_new_tokens,
        "summary": summary,
        "prompts": rows,
    }
    json_path, md_path = write_results(results, out / (index.stem + "_demo"))
    print(f"   results: {json_path}, {md_path}")
    return 0 if summary["identical"] else 1


def write_results(results: dict, stem: Path) -> tuple[Path, Path]:
    """The demo's answers and figures as JSON and markdown next to its index (temp file,
    then rename)."""
    import json

    s = results["summary"]
    lines = [
        f"# dartcore demo: {results['target']} ({results['weights']}), tree {results['tree']}, "
        f"{results['max_new_tokens']} new tokens, greedy",
        "",
        f"DART {s['dart_tok_s']:.1f} tok/s (τ = {s['tau']:.2f}) vs AR {s['ar_tok_s']:.1f} tok/s: "
        f"**{s['speedup']:.2f}×**; outputs identical to AR: {'yes' if s['identical'] else 'NO'}; "
        f"{s['torch_threads']} torch threads, {s['cpus']} CPUs; index `{results['index']}`.",
        "",
        "| prompt | τ | DART tok/s | AR tok/s | speedup | identical |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results["prompts"], 1):
        lines.append(
            f"| {i} | {r['tau']:.2f} | {r['dart_tok_s']:.1f} | {r['ar_tok_s']:.1f} | {r['speedup']:.2f}× | "
            f"{'yes' if r['identical'] else 'NO'} |"
        )
    for i, r in enumerate(results["prompts"], 1):
        lines += ["", f"## {i}. {r['prompt']}", "", "```text", r["answer"].strip(), "```"]
    paths = []
    for suffix, text in (
        (".json", json.dumps(results, indent=2, ensure_ascii=False) + "\n"),
        (".md", "\n".join(lines) + "\n"),
    ):
        path = stem.with_suffix(suffix)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]


if __name__ == "__main__":
    sys.exit(main())

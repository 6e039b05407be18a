#!/usr/bin/env python3
"""Benchmark ngram-build end to end on a local Dolma-format corpus.

    python tools/bench_build.py --json                # corpus from make_local_corpus (made if missing)
    python tools/bench_build.py --corpus-dir DIR --memory 2G --max-tokens 100000000 --json

Three measurements:
  e2e       the real CLI (`python -m dartcore.cli.ngram_build`) in a child process:
            wall time, CPU time and peak RSS of that process (getrusage of the child).
  tokenize  the tokenizer alone (encode_batch) on a sample of the corpus.
  count     the index builder alone (add_many + finish: sort, write) on the same
            sample, pre-tokenised.

Rates are M tokens/s per core: tokens / wall seconds / cores used. The machine may be
shared, so the table also gives tokens per CPU-second of the process (the per-core rate
a quiet machine would show when every core is busy). Prints a table; --json prints the
JSON record as well (and --out writes it to a file).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = Path(tempfile.gettempdir()) / "dartcore-local-corpus"


def ensure_corpus(path: Path) -> Path:
    if (path / "documents").is_dir() and any((path / "documents").glob("*.json.gz")):
        return path
    print(f"making a local corpus in {path} (tools/make_local_corpus.py) ...", file=sys.stderr)
    subprocess.run([sys.executable, str(REPO / "tools" / "make_local_corpus.py"), "--output", str(path), "--quiet"],
                   check=True, stdout=subprocess.DEVNULL)
    return path


def sample_texts(corpus: Path, max_bytes: int) -> list[str]:
    texts, size = [], 0
    for shard in sorted((corpus / "documents").glob("*.json.gz")):
        with gzip.open(shard, "rt", encoding="utf-8") as f:
            for line in f:
                t = json.loads(line)["text"]
                texts.append(t)
                size += len(t)
                if size >= max_bytes:
                    return texts
    return texts


def cpu_seconds(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def bench_stages(corpus: Path, tokenizer: str, threads: int, sample_bytes: int) -> dict:
    import numpy as np

    from dartcore.index import IndexBuilder
    from dartcore.tokenizers import load_tokenizer

    tok = load_tokenizer(tokenizer, threads=threads)
    texts = sample_texts(corpus, sample_bytes)
    tok.encode_batch(texts[:50])  # warm up (thread pool, caches)
    u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    arrays = tok.encode_batch(texts)
    t1, u1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    eos = np.array([tok.eos_id], dtype=np.uint32)
    docs = [np.concatenate((a, eos)) for a in arrays]
    n = sum(len(d) for d in docs)
    with tempfile.TemporaryDirectory() as tmp:
        # Counting = buffering keys + sort + writing the index (builder.finish): the
        # whole build from pre-tokenised input.
        builder = IndexBuilder(tok.vocab_size, memory_limit=1 << 30, temp_dir=tmp, threads=threads)
        u2, t2 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for i in range(0, len(docs), 256):
            builder.add_many(docs[i : i + 256])
        builder.finish(os.path.join(tmp, "stage.idx"), {})
        t3, u3 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        del builder
    return {
        "sample_tokens": n,
        "sample_bytes": sum(len(t.encode("utf-8")) for t in texts),
        "tokenize_s": t1 - t0,
        "tokenize_cpu_s": cpu_seconds(u1) - cpu_seconds(u0),
        "count_s": t3 - t2,
        "count_cpu_s": cpu_seconds(u3) - cpu_seconds(u2),
    }


def bench_e2e(corpus: Path, tokenizer: str, threads: int, memory: str, max_tokens: int | None, out_dir: Path) -> dict:
    output = out_dir / "bench.idx"
    cmd = [sys.executable, "-m", "dartcore.cli.ngram_build", "--corpus", "dolma", "--corpus-dir", str(corpus),
           "--tokenizer", tokenizer, "--output", str(output), "--memory", memory, "--threads", str(threads),
           "--json", "--quiet"]
    if max_tokens:
        cmd += ["--max-tokens", str(max_tokens)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "python"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"ngram-build failed ({proc.returncode})")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    summary["process_wall_s"] = wall
    summary["process_cpu_s"] = cpu_seconds(after) - cpu_seconds(before)
    # The child's own VmHWM: RUSAGE_CHILDREN's ru_maxrss is the largest child so far, and
    # Linux carries ru_maxrss across execve (a child forked from this big process inherits it).
    summary["process_peak_rss_bytes"] = summary["peak_rss_bytes"]
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", type=Path, default=DEFAULT_CORPUS,
                    help=f"Dolma-format corpus (default: {DEFAULT_CORPUS}, made by make_local_corpus if missing)")
    ap.add_argument("--tokenizer", default="qwen3")
    ap.add_argument("--memory", default="2G", help="--memory of the build (default 2G)")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads of every stage (default 0: the pool's, i.e. DART_NUM_THREADS or all CPUs)")
    ap.add_argument("--max-tokens", type=int, default=None, help="stop the e2e build after this many tokens")
    ap.add_argument("--sample-mb", type=float, default=32, help="text for the tokenize/count stage benchmarks")
    ap.add_argument("--json", action="store_true", help="print the JSON record")
    ap.add_argument("--out", type=Path, help="also write the JSON record here")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO / "python"))
    from dartcore.index import num_threads, parse_size

    args.threads = args.threads or num_threads()
    corpus = ensure_corpus(args.corpus_dir)
    stages = bench_stages(corpus, args.tokenizer, args.threads, int(args.sample_mb * 1e6))
    with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
        e2e = bench_e2e(corpus, args.tokenizer, args.threads, args.memory, args.max_tokens, Path(tmp))

    cores = args.threads
    tokens = e2e["tokens"]
    rec = {
        "tokens": tokens,
        "documents": e2e["documents"],
        "corpus": str(corpus),
        "tokenizer": args.tokenizer,
        "cores": cores,
        "e2e_wall_s": e2e["process_wall_s"],
        "e2e_mtok_per_s_per_core": tokens / e2e["process_wall_s"] / cores / 1e6,
        "e2e_mtok_per_cpu_s": tokens / e2e["process_cpu_s"] / 1e6,
        "tokenize_mtok_per_s_per_core": stages["sample_tokens"] / stages["tokenize_s"] / cores / 1e6,
        "tokenize_mtok_per_cpu_s": stages["sample_tokens"] / max(stages["tokenize_cpu_s"], 1e-9) / 1e6,
        "count_mtok_per_s_per_core": stages["sample_tokens"] / stages["count_s"] / cores / 1e6,
        "count_mtok_per_cpu_s": stages["sample_tokens"] / max(stages["count_cpu_s"], 1e-9) / 1e6,
        "peak_rss_gb": e2e["process_peak_rss_bytes"] / 2**30,
        "memory_limit_gb": parse_size(args.memory) / 2**30,
        "rss_within_limit_plus_10pct": e2e["process_peak_rss_bytes"] <= 1.1 * parse_size(args.memory),
        "nodes": e2e["nodes"]["total"],
        "nodes_by_level": {k: e2e["nodes"][k] for k in ("unigram", "bigram", "trigram")},
        "file_bytes": e2e["file_bytes"],
        "bytes_per_node": e2e["file_bytes"] / max(e2e["nodes"]["total"], 1),
        "map_s": e2e["map_s"],
        "reduce_s": e2e["reduce_s"],
        "stage_sample_tokens": stages["sample_tokens"],
        "load_average_1m": os.getloadavg()[0],
    }
    rows = [
        ("tokens", f"{tokens:,}"),
        ("e2e M tok/s per core", f"{rec['e2e_mtok_per_s_per_core']:.2f} (per CPU-second: {rec['e2e_mtok_per_cpu_s']:.2f})"),
        ("tokenize M tok/s per core", f"{rec['tokenize_mtok_per_s_per_core']:.2f} (per CPU-second: {rec['tokenize_mtok_per_cpu_s']:.2f})"),
        ("count M tok/s per core", f"{rec['count_mtok_per_s_per_core']:.2f} (per CPU-second: {rec['count_mtok_per_cpu_s']:.2f})"),
        ("peak RSS GB / limit GB", f"{rec['peak_rss_gb']:.2f} / {rec['memory_limit_gb']:.2f}"),
        ("nodes", f"{rec['nodes']:,} ({', '.join(f'{k} {v:,}' for k, v in rec['nodes_by_level'].items())})"),
        ("bytes per node", f"{rec['bytes_per_node']:.2f}"),
        ("wall (map / reduce)", f"{rec['e2e_wall_s']:.1f} s ({rec['map_s']:.1f} / {rec['reduce_s']:.1f})"),
        ("cores / load avg", f"{cores} / {rec['load_average_1m']:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("| metric | value |\n|---|---|", file=sys.stderr if args.json else sys.stdout)
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(rec, indent=2))
    if args.out:
        args.out.write_text(json.dumps(rec, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

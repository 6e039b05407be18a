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

--engine ray (or both) builds the same corpus with the local engine and with
`--engine ray` (a local Ray unless --address), alternating, --repeat times each:
median wall of each, the bytes compared (sha256), peak RSS per Ray worker, and a
model of wall time on N machines fitted from the measured per-shard map tasks and
per-partition reduce tasks (see ``wall_model``).

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
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "make_local_corpus.py"),
            "--output",
            str(path),
            "--quiet",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
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


def bench_e2e(
    corpus: Path,
    tokenizer: str,
    threads: int,
    memory: str,
    max_tokens: int | None,
    out_dir: Path,
    engine: str = "local",
    address: str | None = None,
    partitions: int = 0,
    name: str = "bench",
) -> dict:
    output = out_dir / f"{name}.idx"
    cmd = [
        sys.executable,
        "-m",
        "dartcore.cli.ngram_build",
        "--corpus",
        "dolma",
        "--corpus-dir",
        str(corpus),
        "--tokenizer",
        tokenizer,
        "--output",
        str(output),
        "--memory",
        memory,
        "--json",
        "--quiet",
        "--engine",
        engine,
        "--reduce-partitions",
        str(partitions),
    ]
    # The Ray engine runs one task per CPU, each with one thread (its --threads is per task).
    cmd += ["--threads", str(threads if engine == "local" else 1)]
    if address:
        cmd += ["--address", address]
    if max_tokens:
        cmd += ["--max-tokens", str(max_tokens)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO / "python"), os.environ.get("PYTHONPATH")])
        ),
    )
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
    summary["sha256"] = _sha256(output)
    return summary


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def wall_model(ray: dict, machines=(1, 2, 4, 8, 16, 64), cores_per_machine: int = 2) -> list[dict]:
    """Wall time for N machines of ``cores_per_machine`` cores from the measured Ray run:
    map = the per-shard task times spread over N·cores task slots (longest-first onto the
    least loaded slot, i.e. what a greedy scheduler achieves with these shards); reduce =
    the per-partition times (measured with one partition per core here, so at N machines
    the same work cut into N·cores partitions: Σ partition time / (N·cores)) plus the final
    merge, which is serial; plus the driver's fixed cost (wall − map − reduce)."""
    import heapq

    shards = sorted((t["seconds"] for t in ray["map_tasks"]), reverse=True)
    parts = [p["seconds"] for p in ray["reduce_partitions"]]
    final = ray.get("final_merge_s") or 0.0
    fixed = max(0.0, ray["wall_s"] - ray["map_s"] - ray["reduce_s"])
    rows = []
    for n in machines:
        slots = [0.0] * (n * cores_per_machine)
        for t in shards:
            heapq.heapreplace(slots, slots[0] + t)
        m = max(slots)
        r = sum(parts) / (n * cores_per_machine) + final
        rows.append({"machines": n, "map_s": m, "reduce_s": r, "wall_s": m + r + fixed})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--corpus-dir",
        type=Path,
        default=DEFAULT_CORPUS,
        help=f"Dolma-format corpus (default: {DEFAULT_CORPUS}, made by make_local_corpus if missing)",
    )
    ap.add_argument("--tokenizer", default="qwen3")
    ap.add_argument("--memory", default="2G", help="--memory of the build (default 2G)")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="threads of every stage (default 0: the pool's, i.e. DART_NUM_THREADS or all CPUs)",
    )
    ap.add_argument(
        "--max-tokens", type=int, default=None, help="stop the e2e build after this many tokens"
    )
    ap.add_argument(
        "--sample-mb", type=float, default=32, help="text for the tokenize/count stage benchmarks"
    )
    ap.add_argument(
        "--engine",
        choices=["local", "ray", "both"],
        default="local",
        help="ray / both: also build with --engine ray on the same corpus (bytes compared)",
    )
    ap.add_argument("--address", help="--address of the Ray engine (default: a local Ray)")
    ap.add_argument(
        "--reduce-partitions",
        type=int,
        default=0,
        help="--reduce-partitions of the builds (0: default)",
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="builds per engine, alternating (medians reported)"
    )
    ap.add_argument("--json", action="store_true", help="print the JSON record")
    ap.add_argument("--out", type=Path, help="also write the JSON record here")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO / "python"))
    from dartcore.index import num_threads, parse_size

    args.threads = args.threads or num_threads()
    corpus = ensure_corpus(args.corpus_dir)
    stages = bench_stages(corpus, args.tokenizer, args.threads, int(args.sample_mb * 1e6))
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    engines = ["local"] + (["ray"] if args.engine in ("ray", "both") else [])
    with tempfile.TemporaryDirectory(
        prefix="bench-build-", dir=os.environ.get("BENCH_BUILD_TMP")
    ) as tmp:
        for rep in range(max(1, args.repeat)):
            # alternate the order: shared machine
            for eng in engines if rep % 2 == 0 else engines[::-1]:
                r = bench_e2e(
                    corpus,
                    args.tokenizer,
                    args.threads,
                    args.memory,
                    args.max_tokens,
                    Path(tmp),
                    engine=eng,
                    address=args.address if eng == "ray" else None,
                    partitions=args.reduce_partitions,
                    name=f"{eng}-{rep}",
                )
                Path(tmp, f"{eng}-{rep}.idx").unlink()
                runs[eng].append(r)
                print(
                    f"{eng} build {rep + 1}: {r['process_wall_s']:.1f} s (build {r['wall_s']:.1f} s)",
                    file=sys.stderr,
                )
    e2e = runs["local"][0]

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
        "tokenize_mtok_per_s_per_core": stages["sample_tokens"]
        / stages["tokenize_s"]
        / cores
        / 1e6,
        "tokenize_mtok_per_cpu_s": stages["sample_tokens"]
        / max(stages["tokenize_cpu_s"], 1e-9)
        / 1e6,
        "count_mtok_per_s_per_core": stages["sample_tokens"] / stages["count_s"] / cores / 1e6,
        "count_mtok_per_cpu_s": stages["sample_tokens"] / max(stages["count_cpu_s"], 1e-9) / 1e6,
        "peak_rss_gb": e2e["process_peak_rss_bytes"] / 2**30,
        "memory_limit_gb": parse_size(args.memory) / 2**30,
        "rss_within_limit_plus_10pct": e2e["process_peak_rss_bytes"]
        <= 1.1 * parse_size(args.memory),
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
        (
            "e2e M tok/s per core",
            f"{rec['e2e_mtok_per_s_per_core']:.2f} (per CPU-second: {rec['e2e_mtok_per_cpu_s']:.2f})",
        ),
        (
            "tokenize M tok/s per core",
            f"{rec['tokenize_mtok_per_s_per_core']:.2f} (per CPU-second: {rec['tokenize_mtok_per_cpu_s']:.2f})",
        ),
        (
            "count M tok/s per core",
            f"{rec['count_mtok_per_s_per_core']:.2f} (per CPU-second: {rec['count_mtok_per_cpu_s']:.2f})",
        ),
        ("peak RSS GB / limit GB", f"{rec['peak_rss_gb']:.2f} / {rec['memory_limit_gb']:.2f}"),
        (
            "nodes",
            f"{rec['nodes']:,} ({', '.join(f'{k} {v:,}' for k, v in rec['nodes_by_level'].items())})",
        ),
        ("bytes per node", f"{rec['bytes_per_node']:.2f}"),
        (
            "wall (map / reduce)",
            f"{rec['e2e_wall_s']:.1f} s ({rec['map_s']:.1f} / {rec['reduce_s']:.1f})",
        ),
        ("cores / load avg", f"{cores} / {rec['load_average_1m']:.1f}"),
    ]
    if runs["ray"]:
        import statistics

        med = {
            e: {
                k: statistics.median(r[k] for r in runs[e])
                for k in ("process_wall_s", "wall_s", "map_s", "reduce_s")
            }
            for e in engines
        }
        ray = runs["ray"][len(runs["ray"]) // 2]
        rec["engines"] = {
            e: {
                "median": med[e],
                "runs": [
                    {
                        k: r[k]
                        for k in (
                            "process_wall_s",
                            "wall_s",
                            "map_s",
                            "reduce_s",
                            "peak_rss_bytes",
                            "sha256",
                        )
                    }
                    for r in runs[e]
                ],
            }
            for e in engines
        }
        rec["bytes_identical"] = len({r["sha256"] for e in engines for r in runs[e]}) == 1
        rec["ray_over_local_wall"] = med["ray"]["wall_s"] / med["local"]["wall_s"]
        rec["ray_over_local_process_wall"] = (
            med["ray"]["process_wall_s"] / med["local"]["process_wall_s"]
        )
        rec["ray_map_tasks"] = ray["map_tasks"]
        rec["ray_reduce_partitions"] = ray["reduce_partitions"]
        rec["ray_final_merge_s"] = ray.get("final_merge_s")
        rec["ray_peak_rss_worker_gb"] = ray["peak_rss_worker_bytes"] / 2**30
        rec["ray_peak_rss_driver_gb"] = ray["peak_rss_bytes"] / 2**30
        rec["wall_model"] = wall_model(ray, cores_per_machine=args.threads)
        for e in engines:
            m = med[e]
            rows.append(
                (
                    f"{e}: wall, process (build: map / reduce)",
                    f"{m['process_wall_s']:.1f} s ({m['wall_s']:.1f} s: {m['map_s']:.1f} / {m['reduce_s']:.1f}); "
                    f"{tokens / m['wall_s'] / cores / 1e6:.2f} M tok/s per core",
                )
            )
        rows.append(
            (
                "ray / local wall (build; process)",
                f"{rec['ray_over_local_wall']:.3f}; {rec['ray_over_local_process_wall']:.3f}",
            )
        )
        rows.append(
            (
                "ray peak RSS per worker / driver GB",
                f"{rec['ray_peak_rss_worker_gb']:.2f} / {rec['ray_peak_rss_driver_gb']:.2f}",
            )
        )
        rows.append(("bytes identical (sha256)", str(rec["bytes_identical"])))
        for w in rec["wall_model"]:
            rows.append(
                (
                    f"model: {w['machines']} machines x {args.threads} cores",
                    f"{w['wall_s']:.1f} s (map {w['map_s']:.1f}, reduce {w['reduce_s']:.1f})",
                )
            )
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

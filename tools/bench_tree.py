#!/usr/bin/env python3
"""Benchmark of the Eq. (10) tree search: d = 8, k = 25, w = 20, θ = 59.

Index: built from REAL text that ships with the machine — the Python standard library
(``*.py`` under ``sysconfig.get_paths()["stdlib"]``), site-packages ``*.py``, then text
under /usr/share/doc (plain and .gz) until ``--corpus-mb`` of text — tokenized with the SmolLM2
tokenizer (``dartcore.models.hub.load_hf_tokenizer("smollm2")``, 49,152 ids), one document
per file with EOS appended. Token shards and the index are cached under ``--work``.

Drafter rows (``--rows``): ``real`` (default) takes them from the shipped SmolLM2 drafter
(``load_drafter("smollm2", target)``) on held-out text: prompts + reference
answers of ``--data-dir``/eval (default ``$DARTCORE_DATA``: gsm8k_test.jsonl, code_alpaca_2k.json), teacher-forced
as the decoder runs it: one target forward per document with the drafter's taps, then one
``draft`` call per position (the drafter state advancing by the true next token), the d
rows of logits mapped to target ids and turned into top-k fp32 log-probs by
``dartcore.tree.topk_logprobs`` (as ``dartcore.trees`` does); the search context is the
document up to the position. Positions are cycled to fill ``--searches``.
``synthetic`` rows are anchored in held-out real text of the index corpus. For a held-out position t (context = text up to t, root = x_t), row l
holds the true token x_{t+1+l} with probability 0.8·0.9^l (at rank 0 with probability
0.6, else a geometric rank), the index's top children of the true context (x_{t+l-1},
x_{t+l}) and random ids to fill k = 25; logits are −α_l·ln(rank + 1) + N(0, 0.3²) with α_l
going linearly from 3.0 (peaked: p_top1 ≈ 0.8) at level 0 to 1.2 (flat: p_top1 ≈ 0.3) at
level 7, log-softmaxed inside the top-k in float32.

Timings are taken inside Rust (``_native._bench.bench_beam_search``), one thread, warm (one untimed
pass first): wall time (``search_*_us``) and the thread's CPU time (``search_cpu_*_us``,
which excludes time the thread was descheduled — quote it when the machine is shared; the
load average is recorded). ``ngram_share`` = CPU time to replay every index query the
searches made (``cond_probs``, ``trigram_context``, ``trigram_probs_at``, ``backoff_bound``), in
one tight loop / total search CPU time. ``batch8_us`` = one ``beam_search_batch`` of 8 on
the owned pool (``DART_NUM_THREADS``, default all CPUs). ``python_call_p50_us`` is the
full ``dartcore.tree.beam_search`` call from Python (argument conversion included).
``all_*``: the same searches with ``candidates="all"`` (every expansion a candidate);
``all_same_tree_share``: of 100 searches, the share whose tree tokens equal the beam set's.
``beam_cpu_p50_median_us`` / ``all_cpu_p50_median_us``: both sets alternated ``--repeats``
times on the same inputs, the median of the runs' CPU p50 (``interleaved_p50_us`` has each run).

``--index FILE`` skips the corpus and the index build: both candidate sets alternated on an
existing SmolLM2 index with real rows (JSON): per repeat the p50 and p99 of each clock, and
their medians over the repeats (``beam_cpu_p50_median_us``, ``beam_cpu_p99_median_us``, ...).

    python3 tools/bench_tree.py            # table
    python3 tools/bench_tree.py --json     # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from dartcore.paths import cache_root, data_dir_from_env

D, K = 8, 25


def corpus_files(limit_bytes: int) -> list[tuple[str, str]]:
    """(source label, path) of text files, in a fixed order, until ``limit_bytes``."""
    stdlib = sysconfig.get_paths()["stdlib"]
    site = sysconfig.get_paths()["purelib"]
    groups = [
        (
            "python-stdlib",
            sorted(
                p
                for p in glob.glob(f"{stdlib}/**/*.py", recursive=True)
                if "site-packages" not in p
            ),
        ),
        ("site-packages", sorted(glob.glob(f"{site}/**/*.py", recursive=True))),
        (
            "usr-share-doc",
            sorted(
                p
                for p in glob.glob("/usr/share/doc/**/*", recursive=True)
                if os.path.isfile(p) and not os.path.islink(p)
            ),
        ),
    ]
    out, total = [], 0
    for label, paths in groups:
        for p in paths:
            if total >= limit_bytes:
                return out
            try:
                size = os.path.getsize(p)
            except OSError:
                continue
            if size == 0 or size > 4 << 20:
                continue
            out.append((label, p))
            total += size * (4 if p.endswith(".gz") else 1)
    return out


def read_text(path: str) -> str | None:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read(16 << 20)
        else:
            with open(path, "rb") as f:
                data = f.read()
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if b"\0" in data[:4096]:
        return None  # binary
    return data.decode("utf-8", errors="replace")


def tokenize_corpus(work: Path, corpus_mb: int) -> tuple[list[np.ndarray], dict]:
    tag = work / f"corpus-smollm2-{corpus_mb}mb-v2"
    meta_path = tag / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        data = np.load(tag / "tokens.npy", mmap_mode="r")
        cuts = np.load(tag / "cuts.npy")
        return [np.asarray(data[a:b]) for a, b in zip(cuts[:-1], cuts[1:])], meta
    from tqdm import tqdm

    from dartcore.models.hub import load_hf_tokenizer

    tok = load_hf_tokenizer("smollm2")
    eos = int(tok.eos_token_id)
    backend = tok.backend_tokenizer
    files = corpus_files(corpus_mb << 20)
    docs: list[np.ndarray] = []
    sources: dict[str, int] = {}
    nbytes = 0
    batch: list[str] = []

    def flush():
        for e in backend.encode_batch(batch, add_special_tokens=False):
            docs.append(np.asarray(e.ids + [eos], dtype=np.uint32))
        batch.clear()

    for label, p in tqdm(files, desc="tokenize", unit="file", file=sys.stderr):
        text = read_text(p)
        if not text:
            continue
        batch.append(text)
        nbytes += len(text)
        sources[label] = sources.get(label, 0) + 1
        if len(batch) >= 256:
            flush()
    flush()
    tag.mkdir(parents=True, exist_ok=True)
    cuts = np.concatenate([[0], np.cumsum([d.size for d in docs])]).astype(np.int64)
    np.save(tag / "tokens.npy", np.concatenate(docs))
    np.save(tag / "cuts.npy", cuts)
    meta = {
        "tokenizer": "smollm2",
        "vocab_size": len(tok),
        "eos": eos,
        "documents": len(docs),
        "tokens": int(cuts[-1]),
        "text_bytes": nbytes,
        "files_per_source": sources,
        "sources": ["python stdlib *.py", "site-packages *.py", "/usr/share/doc (text, .gz)"],
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    return docs, meta


def make_inputs(index, held: list[np.ndarray], n: int, vocab: int, seed: int):
    """Contexts and synthetic drafter rows anchored in held-out text (see module docs)."""
    rng = np.random.default_rng(seed)
    long_docs = [d for d in held if d.size > D + 3]
    contexts, toks, lps = [], np.zeros((n, D, K), np.int64), np.zeros((n, D, K), np.float32)
    for i in range(n):
        doc = long_docs[int(rng.integers(len(long_docs)))]
        t = int(rng.integers(1, doc.size - D - 1))
        contexts.append(np.asarray(doc[max(0, t - 63) : t + 1], dtype=np.int64))
        for lvl in range(D):
            true = int(doc[t + 1 + lvl])
            ctx = [int(doc[t - 1 + lvl]), int(doc[t + lvl])]
            kids = [int(x) for x in index.children(ctx, K)[0]]
            present = rng.random() < 0.8 * 0.9**lvl
            others: list[int] = []
            for x in kids:  # plausible continuations get the better ranks, as a drafter would
                if len(others) >= K - present:
                    break
                if x != true and x not in others:
                    others.append(x)
            while len(others) < K - present:
                x = int(rng.integers(vocab))
                if x != true and x not in others:
                    others.append(x)
            if present:
                r = 0 if rng.random() < 0.6 else min(int(rng.geometric(0.5)), K - 1)
                others.insert(r, true)
            row_arr = np.asarray(others, dtype=np.int64)  # rank order
            alpha = 3.0 - 1.8 * lvl / (D - 1)
            logits = np.sort(-alpha * np.log(np.arange(1, K + 1)) + rng.normal(0, 0.3, K))[
                ::-1
            ].astype(np.float32)
            m = logits.max()
            lp = logits - m - np.log(np.exp(logits - m).sum(dtype=np.float32))
            toks[i, lvl] = row_arr
            lps[i, lvl] = lp.astype(np.float32)
    return contexts, toks, lps


def real_inputs(n: int, seed: int, data_dir: Path, positions: int = 200):
    """Contexts and drafter rows from the real drafter on held-out eval text (module docs)."""
    import torch

    from dartcore.models.hub import load_drafter, load_target
    from dartcore.models.transformer import TargetModel
    from dartcore.tree import topk_logprobs

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model, tok = load_target("smollm2", quantized=False)
    target = TargetModel(model)
    drafter = load_drafter("smollm2", model, tok).eval()
    taps = tuple(drafter.taps)
    data = data_dir / "eval"
    texts = [json.loads(line) for line in (data / "gsm8k_test.jsonl").read_text().splitlines()[:64]]
    docs = [f"{d['question']}\n{d['answer']}" for d in texts]
    alpaca = json.loads((data / "code_alpaca_2k.json").read_text())[:64]
    docs += [f"{d['instruction']}\n{d.get('input', '')}\n{d['output']}" for d in alpaca]
    rng = np.random.default_rng(seed)
    docs = [docs[i] for i in rng.permutation(len(docs))]
    contexts, toks, lps = [], [], []
    with torch.inference_mode():
        for text in docs:
            if len(contexts) >= positions:
                break
            ids = tok(text, add_special_tokens=False)["input_ids"][:256]
            if len(ids) < 24:
                continue
            cache = target.new_cache(len(ids) + 1)
            out = target.forward(
                cache,
                torch.tensor(ids, dtype=torch.long),
                torch.arange(len(ids)),
                taps=taps,
                logits_rows=slice(0, 0),
            )
            state = drafter.new_state(len(ids) + 1)
            # Warm the drafter state with the first 8 positions, then one row set per position.
            start = 8
            drafter.draft(
                state, out.taps[:start], torch.tensor(ids[1 : start + 1], dtype=torch.long)
            )
            for t in range(start, len(ids) - 1):
                logits = drafter.draft(
                    state, out.taps[t : t + 1], torch.tensor([ids[t + 1]], dtype=torch.long)
                )
                # After position t's row the root is x_{t+1}: the search context ends with it.
                tk, lp = topk_logprobs(logits, K)
                tk = drafter.to_target_ids(torch.as_tensor(np.asarray(tk, dtype=np.int64))).numpy()
                contexts.append(np.asarray(ids[max(0, t - 62) : t + 2], dtype=np.int64))
                toks.append(tk.astype(np.int64))
                lps.append(np.asarray(lp, dtype=np.float32))
                if len(contexts) >= positions:
                    break
    reps = [i % len(contexts) for i in range(n)]
    return (
        [contexts[i] for i in reps],
        np.stack([toks[i] for i in reps]),
        np.stack([lps[i] for i in reps]),
        len(contexts),
    )


def interleaved(index, flat, offsets, toks, lps, params, repeats: int):
    """Both candidate sets on the same inputs, alternated ``repeats`` times (the machine's load
    drifts between runs): per set and clock (``beam_cpu``, ``all_wall``, ...) each run's p50
    and p99 in µs, the index queries per search, and each set's last result."""
    from dartcore import _native

    p50s: dict[str, list] = {f"{m}_{c}": [] for m in ("beam", "all") for c in ("cpu", "wall")}
    p99s: dict[str, list] = {k: [] for k in p50s}
    queries: dict[str, float] = {}
    last: dict[str, dict] = {}
    for _ in range(repeats):
        for name, prm in (
            ("beam", dict(params, candidates="beam")),
            ("all", dict(params, candidates="all")),
        ):
            res = _native._bench.bench_beam_search(index._inner, flat, offsets, toks, lps, prm, 0)
            for clock, key in (("cpu", "search_cpu_ns"), ("wall", "search_ns")):
                us = np.asarray(res[key], dtype=np.float64) / 1e3
                p50s[f"{name}_{clock}"].append(round(float(np.percentile(us, 50)), 2))
                p99s[f"{name}_{clock}"].append(round(float(np.percentile(us, 99)), 2))
            queries[name] = round(res["ngram_queries"] / (len(offsets) - 1), 1)
            last[name] = res
    return p50s, p99s, queries, last


def medians(runs: dict[str, list], stat: str) -> dict[str, float]:
    """``{set_clock}_{stat}_median_us``: the median over the runs."""
    return {f"{k}_{stat}_median_us": round(float(np.median(v)), 2) for k, v in runs.items()}


def bench_on(args, idx_path: Path) -> int:
    """The candidate sets alternated on an existing index (``--index``), real rows."""
    from dartcore import tree as T
    from dartcore.index import NgramIndex
    from dartcore.models.hub import load_hf_tokenizer

    index = NgramIndex(idx_path)
    eos = int(load_hf_tokenizer("smollm2").eos_token_id)
    contexts, toks, lps, n_pos = real_inputs(args.searches, args.seed, args.data_dir)
    tails = [c[-2:] for c in contexts]
    offsets = np.concatenate([[0], np.cumsum([t.size for t in tails])]).astype(np.int64)
    flat = np.concatenate(tails).astype(np.int64)
    params = T.SearchParams(eos_token_ids=(eos,)).native()
    runs, p99s, queries, _ = interleaved(index, flat, offsets, toks, lps, params, args.repeats)
    result = {
        "index": {"path": str(idx_path), **{k: v for k, v in index.stats().items() if "node" in k}},
        "searches": args.searches,
        "positions": n_pos,
        "repeats": args.repeats,
        "d": D,
        "k": K,
        "w": 20,
        "theta": 59,
        **medians(runs, "p50"),
        **medians(p99s, "p99"),
        "ngram_queries_per_search": queries,
        "interleaved_p50_us": runs,
        "interleaved_p99_us": p99s,
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--work", type=Path, default=cache_root() / "bench_tree")
    ap.add_argument(
        "--data-dir",
        type=Path,
        default=data_dir_from_env(),
        help="data directory with eval/ for --rows real (default: $DARTCORE_DATA)",
    )
    ap.add_argument(
        "--corpus-mb",
        type=int,
        default=240,
        help="text to tokenize (MiB); 240 gives an index of 12.5 M nodes (the target is >= 10 M)",
    )
    ap.add_argument(
        "--rows", choices=("real", "synthetic"), default="real", help="drafter rows (module docs)"
    )
    ap.add_argument("--searches", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs of each candidate set, alternated (beam, all, beam, ...), for the medians",
    )
    ap.add_argument(
        "--index",
        type=Path,
        help="an existing SmolLM2-tokenizer index instead of building one (real rows only; "
        "e.g. artifacts/demo/smollm2.idx): the candidate sets' timings in one run, alternated",
    )
    ap.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    if (args.rows == "real" or args.index is not None) and (
        args.data_dir is None or not (args.data_dir / "eval").is_dir()
    ):
        ap.error(
            "real drafter rows read the evaluation sets: pass --data-dir DIR (with DIR/eval/) or set "
            "DARTCORE_DATA, or use --rows synthetic"
        )

    from dartcore import _native
    from dartcore import tree as T
    from dartcore.index import NgramIndex, build_index, num_threads

    args.work.mkdir(parents=True, exist_ok=True)
    if args.index is not None:
        return bench_on(args, args.index)
    docs, meta = tokenize_corpus(args.work, args.corpus_mb)
    n_held = max(20, len(docs) // 50)
    rng = np.random.default_rng(1234)
    perm = rng.permutation(len(docs))
    held = [docs[i] for i in perm[:n_held]]
    train_ids = np.sort(perm[n_held:])
    idx_path = args.work / f"index-smollm2-{args.corpus_mb}mb-v2.idx"
    if not idx_path.exists():
        t0 = time.perf_counter()
        build_index(
            (docs[i] for i in train_ids),
            idx_path,
            vocab_size=meta["vocab_size"],
            metadata={"corpus": meta, "held_out_documents": n_held},
        )
        print(f"built {idx_path} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    index = NgramIndex(idx_path)
    stats = index.stats()
    nodes = {k: v for k, v in stats.items() if "node" in k and isinstance(v, (int, float))}

    t0 = time.perf_counter()
    if args.rows == "real":
        contexts, toks, lps, n_pos = real_inputs(args.searches, args.seed, args.data_dir)
        rows_desc = (
            f"real: shipped SmolLM2 drafter, teacher-forced on {n_pos} held-out positions of "
            "the GSM8K test and CodeAlpaca-2k prompts + answers, cycled (see tools/bench_tree.py docstring)"
        )
    else:
        contexts, toks, lps = make_inputs(index, held, args.searches, meta["vocab_size"], args.seed)
        rows_desc = "synthetic, anchored in held-out real text (see tools/bench_tree.py docstring)"
    rows_s = time.perf_counter() - t0
    tails = [c[-2:] for c in contexts]
    offsets = np.concatenate([[0], np.cumsum([t.size for t in tails])]).astype(np.int64)
    flat = np.concatenate(tails).astype(np.int64)
    params = T.SearchParams(eos_token_ids=(meta["eos"],)).native()
    r = _native._bench.bench_beam_search(index._inner, flat, offsets, toks, lps, params, 8)
    r0 = _native._bench.bench_beam_search(
        index._inner, flat, offsets, toks, lps, dict(params, ngram_weight=0.0), 0
    )
    runs, _, _, last = interleaved(index, flat, offsets, toks, lps, params, args.repeats)
    ra = last["all"]
    # Full Python call (wrapper + conversion), 300 calls.
    py_us = []
    for i in range(min(300, args.searches)):
        t0 = time.perf_counter()
        T.beam_search(index, contexts[i], toks[i], lps[i], eos_token_ids=(meta["eos"],))
        py_us.append((time.perf_counter() - t0) * 1e6)
    sizes = [T.beam_search(index, contexts[i], toks[i], lps[i]).size - 1 for i in range(100)]
    same_all = sum(
        np.array_equal(
            T.beam_search(
                index, contexts[i], toks[i], lps[i], eos_token_ids=(meta["eos"],), candidates="beam"
            ).tokens,
            T.beam_search(
                index, contexts[i], toks[i], lps[i], eos_token_ids=(meta["eos"],), candidates="all"
            ).tokens,
        )
        for i in range(100)
    )

    us = np.asarray(r["search_ns"], dtype=np.float64) / 1e3
    cpu = np.asarray(r["search_cpu_ns"], dtype=np.float64) / 1e3
    pct = lambda a, q: round(float(np.percentile(a, q)), 2)  # noqa: E731
    result = {
        "search_p50_us": pct(us, 50),
        "search_p99_us": pct(us, 99),
        "search_mean_us": round(float(us.mean()), 2),
        "search_cpu_p50_us": pct(cpu, 50),
        "search_cpu_p99_us": pct(cpu, 99),
        "ngram_share": round(r["ngram_total_cpu_ns"] / max(1, r["search_total_cpu_ns"]), 3),
        "ngram_queries_per_search": round(r["ngram_queries"] / args.searches, 1),
        "ngram_candidates_per_query": round(r["ngram_candidates"] / max(1, r["ngram_queries"]), 1),
        "ngram_us_per_query": round(r["ngram_total_cpu_ns"] / max(1, r["ngram_queries"]) / 1e3, 3),
        "batch8_us": round(float(np.median(r["batch_ns"]) / 1e3), 2)
        if len(r["batch_ns"])
        else None,
        "batch_threads": num_threads(),
        "no_ngram_p50_us": pct(np.asarray(r0["search_ns"]) / 1e3, 50),
        "no_ngram_cpu_p50_us": pct(np.asarray(r0["search_cpu_ns"]) / 1e3, 50),
        "python_call_p50_us": pct(py_us, 50),
        "all_search_p50_us": pct(np.asarray(ra["search_ns"]) / 1e3, 50),
        "all_search_p99_us": pct(np.asarray(ra["search_ns"]) / 1e3, 99),
        "all_search_cpu_p50_us": pct(np.asarray(ra["search_cpu_ns"]) / 1e3, 50),
        "repeats": args.repeats,
        **medians(runs, "p50"),
        "interleaved_p50_us": runs,
        "all_ngram_queries_per_search": round(ra["ngram_queries"] / args.searches, 1),
        "all_same_tree_share": same_all / 100,
        "tree_nodes_mean": round(float(np.mean(sizes)), 1),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "searches": args.searches,
        "d": D,
        "k": K,
        "w": 20,
        "theta": 59,
        "index": {"path": str(idx_path), "bytes": stats.get("bytes"), **nodes},
        "corpus": {
            k: meta[k]
            for k in ("tokenizer", "documents", "tokens", "text_bytes", "files_per_source")
        },
        "rows": args.rows,
        "drafter_rows": rows_desc,
        "rows_prep_s": round(rows_s, 1),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    if args.json:
        print(text)
    else:
        rows = [
            (k, result[k])
            for k in (
                "search_p50_us",
                "search_p99_us",
                "search_mean_us",
                "search_cpu_p50_us",
                "search_cpu_p99_us",
                "ngram_share",
                "ngram_queries_per_search",
                "ngram_candidates_per_query",
                "ngram_us_per_query",
                "batch8_us",
                "batch_threads",
                "no_ngram_p50_us",
                "no_ngram_cpu_p50_us",
                "python_call_p50_us",
                "tree_nodes_mean",
                "load_avg_1min",
                "cpus",
                "all_search_p50_us",
                "all_search_p99_us",
                "all_search_cpu_p50_us",
                "all_ngram_queries_per_search",
                "all_same_tree_share",
                "repeats",
                "beam_cpu_p50_median_us",
                "all_cpu_p50_median_us",
                "beam_wall_p50_median_us",
                "all_wall_p50_median_us",
            )
        ]
        print(f"index: {idx_path.name}, {result['index']}")
        print(f"corpus: {result['corpus']}")
        print("| metric | value |\n|---|---|")
        for k, v in rows:
            print(f"| {k} | {v} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

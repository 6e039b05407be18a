#!/usr/bin/env python3
"""Benchmark ngram-build --from-dart-trie: conversion rate and peak RSS on a synthetic DART
.trie (the official TrieNgram::save format, see tests/data/README.md).

    python tools/bench_trie_convert.py --json                  # 100 M nodes (~3.6 GB, deleted after)
    python tools/bench_trie_convert.py --nodes 10M --memory 1G

The synthetic trie is a valid TrieNgram(3): U unigrams, B bigrams under each, T trigrams under
each bigram, with consistent counts (a parent's count is its children's sum plus a random
document-end count). Node ids interleave the trigrams of all bigrams (id = base + k * n_bigrams
+ j), as a trie grown from running text does: the converter's sort by parent cannot coast on
sorted input. It is written with numpy in fixed-size chunks. The conversion runs as the real
CLI in a child process; its peak RSS is that process's VmHWM (reported by ngram-build --json).
Prints a table; --json prints the JSON record too (--out writes it to a file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151669  # qwen3

# packed: 24 bytes
NODE = np.dtype([("tok", "<i4"), ("par", "<u8"), ("freq", "<i4"), ("nch", "<u8")])
CHILD = np.dtype([("tok", "<i4"), ("id", "<u8")])  # packed: 12 bytes


def _size(text: str) -> int:
    s = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def write_trie(path: Path, nodes: int, seed: int = 0) -> dict:
    """Write a synthetic TrieNgram(3) of about ``nodes`` nodes; returns its shape."""
    rng = np.random.default_rng(seed)
    U, T = 1000, 250
    B = max(1, round(nodes / (U * T)))
    NB = U * B
    base1, base2, base3 = 1, 1 + U, 1 + U + NB
    total = base3 + NB * T
    tok_u = (np.arange(U) * (VOCAB // U)).astype(np.int32)
    tok_b = (np.arange(B) * (VOCAB // B)).astype(np.int32)
    tok_t = (np.arange(T) * (VOCAB // T)).astype(np.int32)

    # trigram counts per (bigram, k): generated per k-chunk from a per-k seed, so their sums
    # per bigram are known before the trigram records are written
    def tri_freq(k: int) -> np.ndarray:
        return np.random.default_rng([seed, k]).integers(1, 100, NB, dtype=np.int64)

    tri_sum = np.zeros(NB, np.int64)
    for k in range(T):
        tri_sum += tri_freq(k)
    bi_freq = tri_sum + rng.integers(0, 3, NB)
    uni_freq = bi_freq.reshape(U, B).sum(1) + rng.integers(0, 3, U)
    if bi_freq.max() >= 2**31 or uni_freq.max() >= 2**31:
        raise SystemExit("counts would overflow int32: use fewer nodes")
    with open(path, "wb") as f:
        f.write(np.array([3, total], "<u8").tobytes())
        root = np.zeros(1, NODE)
        root["freq"], root["nch"] = min(int(uni_freq.sum()), 2**31 - 1), U
        ch = np.zeros(U, CHILD)
        ch["tok"], ch["id"] = tok_u, base1 + np.arange(U)
        f.write(root.tobytes() + ch.tobytes())
        for i in range(U):  # unigram i, then its child list
            rec = np.zeros(1, NODE)
            rec["tok"], rec["par"], rec["freq"], rec["nch"] = tok_u[i], 0, uni_freq[i], B
            ch = np.zeros(B, CHILD)
            ch["tok"], ch["id"] = tok_b, base2 + i * B + np.arange(B)
            f.write(rec.tobytes() + ch.tobytes())
        rec_dt = np.dtype([("node", NODE), ("ch", CHILD, (T,))])
        step = 4096
        for j0 in range(0, NB, step):  # bigrams with their T children each
            j = np.arange(j0, min(NB, j0 + step))
            recs = np.zeros(len(j), rec_dt)
            recs["node"]["tok"] = tok_b[j % B]
            recs["node"]["par"] = base1 + j // B
            recs["node"]["freq"] = bi_freq[j]
            recs["node"]["nch"] = T
            recs["ch"]["tok"] = tok_t[None, :]
            recs["ch"]["id"] = base3 + np.arange(T)[None, :] * NB + j[:, None]
            f.write(recs.tobytes())
        for k in range(T):  # trigram k of every bigram
            recs = np.zeros(NB, NODE)
            recs["tok"], recs["par"], recs["freq"] = tok_t[k], base2 + np.arange(NB), tri_freq(k)
            f.write(recs.tobytes())
    return {
        "nodes": total,
        "unigrams": U,
        "bigrams": NB,
        "trigrams": NB * T,
        "bytes": path.stat().st_size,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=_size, default=_size("100M"), help="trie nodes (default 100M)")
    ap.add_argument("--memory", default="2G", help="ngram-build --memory (default 2G)")
    ap.add_argument(
        "--dir", type=Path, help="where the trie, temp files and index go (default: a temp dir)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the synthetic trie and the index")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-trie-", dir=args.dir))
    trie, index = work / "synthetic.trie", work / "synthetic.idx"
    try:
        t0 = time.monotonic()
        shape = write_trie(trie, args.nodes)
        gen_s = time.monotonic() - t0
        env = dict(
            os.environ,
            PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        cmd = [
            sys.executable,
            "-m",
            "dartcore.cli.ngram_build",
            "--from-dart-trie",
            str(trie),
            "--tokenizer",
            "qwen3",
            "--output",
            str(index),
            "--memory",
            args.memory,
            "--json",
        ]
        t1 = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.monotonic() - t1
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        s = json.loads(proc.stdout.strip().splitlines()[-1])
        record = {
            "trie": shape,
            "generate_s": round(gen_s, 2),
            "memory_limit": args.memory,
            "convert_wall_s": round(wall, 2),
            "convert_s": round(s["wall_s"], 2),
            "read_s": round(s["read_seconds"], 2),
            "join_s": round(s["join_seconds"], 2),
            "write_s": round(s["seconds"] - s["read_seconds"] - s["join_seconds"], 2),
            "nodes_per_s": round(shape["nodes"] / s["wall_s"]),
            "input_mb_per_s": round(shape["bytes"] / s["wall_s"] / 1e6, 1),
            "peak_rss_bytes": s["peak_rss_bytes"],
            "index_bytes": s["bytes"],
            "index_nodes": s["nodes"],
            "cores": len(os.sched_getaffinity(0)),
        }
        # every node but the root
        assert s["trie_nodes"] == shape["nodes"] and s["nodes"] == shape["nodes"] - 1
        print(f"{'trie nodes':<18}{shape['nodes']:>16,}")
        print(f"{'trie file':<18}{shape['bytes'] / 2**30:>13.2f} GiB (written in {gen_s:.1f} s)")
        print(
            f"{'convert':<18}{s['wall_s']:>14.1f} s (read {record['read_s']} s, join {record['join_s']} s, "
            f"write {record['write_s']} s)"
        )
        print(
            f"{'rate':<18}{record['nodes_per_s'] / 1e6:>12.2f} M nodes/s ({record['input_mb_per_s']} MB/s of input)"
        )
        print(f"{'peak RSS':<18}{s['peak_rss_bytes'] / 2**20:>12.0f} MiB (--memory {args.memory})")
        print(
            f"{'index':<18}{s['bytes'] / 2**20:>12.0f} MiB ({s['bytes'] / s['nodes']:.2f} bytes/node)"
        )
        if args.json:
            print(json.dumps(record))
        if args.out:
            args.out.write_text(json.dumps(record, indent=1) + "\n")
    finally:
        if not args.keep:
            for p in (trie, index):
                p.unlink(missing_ok=True)
            try:
                work.rmdir()
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Index lookups with the page cache cold against warm, prefault, and N processes sharing one file.

    python3 tools/bench_index_cache.py --index big.idx [--queries 20000] [--procs 4] [--json]

Contexts (a, b): a drawn from the 1,000 most frequent tokens, b from a's top-25 children,
so every context exists (seed 0). children(top-25) latencies are timed inside Rust, one
thread: "cold" is the first pass after ``posix_fadvise(DONTNEED)`` on the file (every page
evicted, the open included), "warm" the second pass. ``prefault`` opens with
``NgramIndex(prefault=True)`` after evicting (the open reads the file) and then runs the
cold pass. ``procs``: N processes each map the file and run the same queries over
``--touch`` of the contexts; the Pss and Rss of their mappings of the file (``/proc/PID/smaps``) show one shared copy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def contexts(idx, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    top = np.asarray(idx.children([], 1000)[0])
    out = np.empty((n, 2), dtype=np.uint32)
    kids: dict[int, np.ndarray] = {}
    for i in range(n):
        a = int(top[rng.integers(len(top))])
        if a not in kids:
            kids[a] = np.asarray(idx.children([a], 25)[0])
        k = kids[a]
        out[i] = (a, int(k[rng.integers(len(k))]) if len(k) else a)
    return out


def pct(ns: np.ndarray) -> dict:
    us = np.asarray(ns, dtype=np.float64) / 1e3
    return {
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "mean_us": float(us.mean()),
        "total_s": float(us.sum() / 1e6),
    }


def mapped(pid: int, path: str) -> dict:
    """Rss and Pss of the process's mappings of ``path`` (from /proc/PID/smaps), bytes."""
    real = os.path.realpath(path)
    out = {"Rss": 0, "Pss": 0}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                inside = len(parts) >= 6 and parts[5] == real
            elif inside and parts[0].rstrip(":") in out:
                out[parts[0].rstrip(":")] += int(parts[1]) * 1024
    return out


def child(index: str, ctx_file: str, touch: int) -> None:
    from dartcore import _native
    from dartcore.index import NgramIndex

    idx = NgramIndex(index)
    ctx = np.load(ctx_file)[:touch]
    _native._bench.bench_children(idx._inner, np.ascontiguousarray(ctx), 25, 1)
    print(json.dumps(mapped(os.getpid(), index)), flush=True)
    sys.stdin.read()  # stay alive until the parent has read every process's figures


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--index", type=Path, required=True)
    ap.add_argument("--queries", type=int, default=20_000)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument(
        "--touch", type=int, default=20_000, help="contexts each sharing process queries"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        child(args._child[0], args._child[1], int(args._child[2]))
        return 0
    sys.path.insert(0, str(REPO / "python"))
    from dartcore import _native
    from dartcore.index import NgramIndex

    rec: dict = {"index": str(args.index), "file_bytes": args.index.stat().st_size}
    ctx = np.ascontiguousarray(contexts(NgramIndex(args.index), args.queries))
    rec["nodes"] = NgramIndex(args.index).stats()["nodes"]

    evict(args.index)
    t0 = time.perf_counter()
    idx = NgramIndex(args.index)
    rec["open_cold_ms"] = (time.perf_counter() - t0) * 1e3
    rec["cold"] = pct(_native._bench.bench_children(idx._inner, ctx, 25, 0))
    rec["warm"] = pct(_native._bench.bench_children(idx._inner, ctx, 25, 0))
    del idx

    evict(args.index)
    t0 = time.perf_counter()
    try:
        idx = NgramIndex(args.index, prefault=True)
        rec["prefault_open_s"] = time.perf_counter() - t0
        rec["prefault_first_pass"] = pct(_native._bench.bench_children(idx._inner, ctx, 25, 0))
        del idx
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        rec["prefault_error"] = str(e)
    evict(args.index)
    t0 = time.perf_counter()
    try:
        idx = NgramIndex(args.index, prefault=True, hugepages=True)
        rec["hugepages_open_s"] = time.perf_counter() - t0
        rec["hugepages_first_pass"] = pct(_native._bench.bench_children(idx._inner, ctx, 25, 0))
        del idx
    except Exception as e:  # noqa: BLE001
        rec["hugepages_error"] = str(e)

    ctx_file = args.index.with_suffix(".ctx.npy")
    np.save(ctx_file, ctx)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO / "python"), os.environ.get("PYTHONPATH")])
        ),
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--index",
                str(args.index),
                "--_child",
                str(args.index),
                str(ctx_file),
                str(args.touch),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(args.procs)
    ]
    rolls = [json.loads(p.stdout.readline()) for p in procs]
    # Pss is measured after every process has mapped and touched the file: re-read all now.
    final = [mapped(p.pid, str(args.index)) for p in procs]
    for p in procs:
        p.stdin.close()
        p.wait()
    ctx_file.unlink()
    rec["procs"] = {
        "n": args.procs,
        "touch": args.touch,
        "at_own_end": rolls,
        "all_alive": final,
        "pss_sum_bytes": sum(r["Pss"] for r in final),
        "rss_sum_bytes": sum(r["Rss"] for r in final),
    }
    rec["load_average_1m"] = os.getloadavg()[0]
    text = json.dumps(rec, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

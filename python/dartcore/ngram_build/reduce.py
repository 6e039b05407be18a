"""The reduce step: the runs of one or more mapped work dirs -> the index (k-way merge),
and the build's summary."""

from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from dartcore.errors import IndexBuildError
from dartcore.ngram_build.inputs import check_not_an_input, check_output
from dartcore.ngram_build.map import MapOptions, map_threads
from dartcore.ngram_build.workdir import MANIFEST, PARTITION_PREFIX, read_manifest

U64_MAX = (1 << 64) - 1
_RUN_HEADER = 64  # run files: 64-byte header (entries at 24..32), then (key u64, count u64) pairs
_KEY_TOKEN_SHIFT = 42  # key = a << 42 | b << 21 | c


def _check_unchanged(shard: dict, work: Path) -> None:
    """A shard file that changed since it was mapped (size or mtime; no hashing here) makes
    its runs stale. A file that is absent is fine: reduce may run on another machine."""
    rec, path = shard.get("input"), shard.get("file")
    if not rec or not path:
        return
    try:
        st = os.stat(path)
    except OSError:
        return
    if (st.st_size, st.st_mtime_ns) != (rec["size"], rec["mtime_ns"]):
        raise IndexBuildError(
            f"{path} changed since it was mapped into {work}; map again with --resume "
            f"(ngram-build map --resume --work-dir {work} ...) before reduce"
        )


def run_reduce(
    work_dirs: list[Path],
    output: Path,
    *,
    min_count: int = 1,
    threads: int = 0,
    memory: int = 8 << 30,
    temp_dir: str | None = None,
    max_children: int | None = None,
    log=None,
    partitions: int = 1,
    run_partitions=None,
) -> dict:
    """Merge the runs of one or more complete work dirs into the index at ``output``.

    ``partitions`` > 1: the partitioned reduce. The key space is cut into that many ranges
    of first tokens (``partition_bounds``, from a sample of the runs' keys); each range's
    entries of every run are merged into one sorted run (``merge_partition``, several at
    once), and those runs, disjoint and in order, are merged into the index: the same
    sorted stream reaches the writer, so the bytes equal the one-merge reduce.
    ``run_partitions(jobs)``: runs ``merge_partition(*job)`` for every job and returns the
    results in order (the Ray engine passes Ray tasks); default: a thread pool of
    ``threads`` (the merges release the GIL).

    ``log``: called with one line before the merge (what is merged, how many bytes)."""
    from dartcore.index import merge_runs

    output = check_output(output)
    if threads:
        map_threads(threads)
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise IndexBuildError(f"--min-count must be an integer of at least 1, got {min_count!r}")
    if max_children is not None and (
        isinstance(max_children, bool)
        or not isinstance(max_children, int)
        or not 1 <= max_children < 1 << 32
    ):
        raise IndexBuildError(
            f"--max-children must be an integer in 1..{(1 << 32) - 1}, got {max_children!r}"
        )
    for w in work_dirs:
        check_not_an_input(output, [Path(w) / MANIFEST], [w])

    manifests = []
    for w in work_dirs:
        m = read_manifest(Path(w))
        if m is None:
            raise IndexBuildError(f"{w}: no {MANIFEST}; run `ngram-build map --work-dir {w}` first")
        manifests.append((Path(w), m))
    config = manifests[0][1]["config"]
    for w, m in manifests[1:]:
        if m["config"] != config:
            raise IndexBuildError(
                f"{w} was mapped with other settings than {manifests[0][0]}; cannot merge them"
            )
    shards: dict[str, tuple[Path, dict]] = {}
    limit = False
    for w, m in manifests:
        for k, s in m["shards"].items():
            shards.setdefault(k, (w, s))
        limit = limit or any(s.get("limit_reached") for s in m["shards"].values())
    n_files = len(config["corpus"]["files"])
    missing = [i for i in range(n_files) if str(i) not in shards]
    if missing and not limit:
        raise IndexBuildError(
            f"{len(missing)} of {n_files} shards are not mapped yet (first: {config['corpus']['files'][missing[0]]}); "
            "finish the map step (ngram-build map --resume) before reduce"
        )
    runs: list[str] = []
    docs = tokens = 0
    damage = {"bad_lines": 0, "invalid_utf8": 0, "corrupt_streams": 0, "split_documents": 0}
    for k in sorted(shards, key=int):
        w, s = shards[k]
        _check_unchanged(s, w)
        runs += [str(w / r) for r in s["runs"]]
        docs += s["documents"]
        tokens += s["tokens"]
        for d in damage:
            damage[d] += s.get(d, 0)
    for r in runs:
        if not Path(r).is_file():
            raise IndexBuildError(
                f"run file {r} listed in the manifest is missing; map that shard again"
            )
    check_not_an_input(output, runs)
    # Deterministic metadata only (no times, hosts or paths of work dirs): a resumed
    # build must produce the same bytes as an uninterrupted one.
    from dartcore import __version__

    metadata = {
        "tokenizer": config["tokenizer"],
        "corpus": {**config["corpus"], **damage, "shards_mapped": len(shards)},
        "documents": docs,
        "tokens": tokens,
        "build": {
            "tool": "ngram-build",
            "dartcore_version": __version__,
            "eos_appended": True,
            "min_count": min_count,
            "max_children": max_children,
            "max_docs": config["max_docs"],
            "max_tokens": config["max_tokens"],
        },
    }
    kwargs: dict[str, Any] = {
        "vocab_size": config["tokenizer"]["vocab_size"],
        "metadata": metadata,
        "min_count": min_count,
    }
    if max_children is not None:
        kwargs["max_children"] = max_children
    if threads:
        kwargs["threads"] = threads
    if temp_dir:
        kwargs["temp_dir"] = temp_dir
    kwargs["memory_limit"] = memory
    if log is not None:
        size = sum(os.path.getsize(r) for r in runs)
        log(f"ngram-build reduce: merging {len(runs)} runs ({size / 2**20:,.1f} MiB) into {output}")
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise IndexBuildError(
            f"--reduce-partitions must be an integer of at least 1, got {partitions!r}"
        )
    t0 = time.monotonic()
    parts: list[dict] = []
    if partitions == 1:
        summary = merge_runs(runs, str(output), **kwargs)
    else:
        bounds = partition_bounds(runs, partitions)
        pdir = Path(tempfile.mkdtemp(prefix=PARTITION_PREFIX, dir=temp_dir or Path(work_dirs[0])))
        try:
            jobs = [
                (
                    runs,
                    str(pdir / f"partition-{i:05d}.dartrun"),
                    config["tokenizer"]["vocab_size"],
                    lo,
                    hi,
                    memory // max(1, min(partitions, threads or map_threads(0))),
                )
                for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))
            ]
            if run_partitions is None:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(
                    max_workers=max(1, min(len(jobs), threads or map_threads(0)))
                ) as ex:
                    parts = list(ex.map(lambda j: merge_partition(*j), jobs))
            else:
                parts = list(run_partitions(jobs))
            t_parts = time.monotonic() - t0
            summary = merge_runs([j[1] for j in jobs], str(output), **kwargs)
        finally:
            shutil.rmtree(pdir, ignore_errors=True)
    summary = dict(summary) if summary is not None else {}
    summary.setdefault("reduce_seconds", time.monotonic() - t0)
    summary["runs_merged"] = len(runs)
    summary["partitions"] = len(parts) or 1
    if parts:
        summary["partition_seconds"] = [p["seconds"] for p in parts]
        summary["partition_wall_s"] = t_parts
        summary["final_merge_s"] = summary["reduce_seconds"] - t_parts
    return summary


def partition_bounds(runs: list[str], partitions: int, samples: int = 1024) -> list[int]:
    """Key bounds ``[0, b1, ..., u64::MAX]`` of at most ``partitions`` ranges of first
    tokens holding about equal numbers of run entries. Reads ``samples`` keys per partition
    spread over all runs in proportion to their sizes (a few pages of each run); each
    bound is a first token's first key (``a << 42``), so a context never spans two
    partitions, and equal bounds collapse (one very frequent first token)."""
    counts = []
    for r in runs:
        with open(r, "rb") as f:
            counts.append(int.from_bytes(f.read(64)[24:32], "little"))
    total = sum(counts)
    if partitions == 1 or total == 0:
        return [0, U64_MAX]
    want = partitions * samples
    firsts = []
    for r, n in zip(runs, counts):
        if n == 0:
            continue
        k = max(1, min(n, round(want * n / total)))
        keys = np.memmap(r, dtype="<u8", mode="r", offset=_RUN_HEADER, shape=(2 * n,))[0::2]
        firsts.append(
            np.asarray(keys[np.linspace(0, n - 1, k).astype(np.int64)])
            >> np.uint64(_KEY_TOKEN_SHIFT)
        )
        del keys
    a = np.sort(np.concatenate(firsts))
    cuts = {int(a[min(len(a) - 1, (len(a) * j) // partitions)]) for j in range(1, partitions)}
    cuts.discard(0)
    return [0] + [c << _KEY_TOKEN_SHIFT for c in sorted(cuts)] + [U64_MAX]


def merge_partition(
    runs: list[str], output: str, vocab_size: int, lo: int, hi: int, memory: int
) -> dict:
    """One partition of the partitioned reduce (one home for both engines): the entries
    with ``lo <= key < hi`` of every run, merged into one sorted run at ``output``."""
    from dartcore import _native

    t0 = time.monotonic()
    s = dict(
        _native.merge_run_range(
            list(runs),
            output,
            vocab_size=vocab_size,
            lo=lo,
            hi=hi,
            memory_limit=max(memory, 64 << 20),
        )
    )
    s["seconds"] = time.monotonic() - t0
    s["peak_rss_bytes"] = peak_rss_bytes()
    return s


def peak_rss_bytes() -> int:
    """Peak resident set size of this process image.

    /proc's VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across execve, so
    a process spawned by a big parent (pytest, a benchmark driver) would report the
    parent's size at fork time."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def build_summary(
    output: Path,
    manifest: dict,
    reduce: dict,
    *,
    wall: float,
    map_s: float,
    reduce_s: float,
    opts: MapOptions,
) -> dict:
    from dartcore.index import NgramIndex

    stats = NgramIndex(str(output)).stats()
    stats = dict(stats) if not isinstance(stats, dict) else stats
    meta_docs = sum(s["documents"] for s in manifest["shards"].values())
    meta_tokens = sum(s["tokens"] for s in manifest["shards"].values())
    ms = manifest.get("map_stats", {})
    return {
        "output": str(output),
        "documents": meta_docs,
        "tokens": meta_tokens,
        "nodes": {
            "unigram": stats.get("unigram_nodes"),
            "bigram": stats.get("bigram_nodes"),
            "trigram": stats.get("trigram_nodes"),
            "total": stats.get("nodes"),
        },
        "file_bytes": output.stat().st_size,
        "bytes_per_node": stats.get("bytes_per_node"),
        "wall_s": wall,
        "map_s": map_s,
        "reduce_s": reduce_s,
        "tokenize_s": ms.get("tokenize_s"),
        "count_s": ms.get("count_s"),
        "read_wait_s": ms.get("read_wait_s"),
        "threads": ms.get("threads"),
        "memory_limit_bytes": opts.memory,
        "builder_memory_bytes": ms.get("builder_memory_bytes"),
        "peak_rss_bytes": peak_rss_bytes(),
        "corpus_problems": {
            k: sum(s.get(k, 0) for s in manifest["shards"].values())
            for k in ("bad_lines", "invalid_utf8", "corrupt_streams", "split_documents")
        },
        "tokenizer": manifest["config"]["tokenizer"],
    }


def print_summary(s: dict, file=None) -> None:
    n = s["nodes"]
    lines = [
        f"index        {s['output']}",
        f"documents    {s['documents']:,}",
        f"tokens       {s['tokens']:,}",
        f"nodes        {n['total']:,} (unigram {n['unigram']:,}, bigram {n['bigram']:,}, trigram {n['trigram']:,})",
        f"file size    {s['file_bytes'] / 2**20:,.1f} MiB ({s['bytes_per_node'] or 0:.2f} bytes/node)",
        f"wall time    {s['wall_s']:.1f} s (map {s['map_s']:.1f} s: tokenize {s['tokenize_s'] or 0:.1f} s, "
        f"count {s['count_s'] or 0:.1f} s; reduce {s['reduce_s']:.1f} s)",
        f"throughput   {s['tokens'] / max(s['wall_s'], 1e-9) / 1e6:.2f} M tokens/s end to end",
        f"peak RSS     {s['peak_rss_bytes'] / 2**30:.2f} GiB (--memory {s['memory_limit_bytes'] / 2**30:.2f} GiB)",
        f"tokenizer    {s['tokenizer']['name']} (fingerprint {s['tokenizer']['fingerprint']})",
    ]
    p = s["corpus_problems"]
    if any(p.values()):
        lines.append(
            "skipped      " + ", ".join(f"{v:,} {k.replace('_', ' ')}" for k, v in p.items() if v)
        )
    print("\n".join(lines), file=file or sys.stdout)

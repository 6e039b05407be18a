"""The Ray engine of ``ngram-build``: the same map and reduce code, scheduled as Ray tasks.

Ray is the scheduler; nothing here schedules work itself. The driver

* maps every shard as one Ray task: ``run_map`` with ``part=(i, n)`` into its own work dir
  ``W/ray-NNNNN`` (one shard each; a task that dies, e.g. its worker process exits, is run
  again by Ray up to ``MAP_RETRIES`` times and resumes in that dir);
* reduces with the partitioned ``run_reduce``: each key-range partition is one Ray task
  (``merge_partition``), the final merge of the partitions runs in the driver.

The work dir, the corpus and the output must be on storage every worker can read (on one
machine: any path). The index is byte-identical to the local engine's: the same runs are
merged and the metadata holds no engine, host or time. A killed driver resumes with
``--resume``: the shards whose dir holds a complete manifest are kept.

``--memory`` is the budget of each map task (and the reduce's, split over its
partitions running at once), not of the cluster.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from dartcore.errors import DartError, IndexBuildError
from dartcore.ngram_build.inputs import (
    check_not_an_input,
    check_output,
    corpus_inputs,
    is_inside,
    real_path,
)
from dartcore.ngram_build.map import MapOptions, open_inputs, run_map
from dartcore.ngram_build.reduce import (
    build_summary,
    merge_partition,
    peak_rss_bytes,
    run_reduce,
)
from dartcore.ngram_build.workdir import WorkDirLock, read_manifest

MAP_RETRIES = 3
# Fault injection for the tests: the map task of this shard index exits its worker process
# on its first attempt (a marker file in its work dir records the attempt).
FAULT_ENV = "DARTCORE_RAY_FAULT_KILL_MAP"
_PART_PREFIX = "ray-"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise IndexBuildError("--engine ray needs Ray: pip install 'dartcore[ray]'") from None
    return ray


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _probe(address: str, timeout: float = 5.0) -> None:
    """A TCP connect to ``[ray://]HOST:PORT`` first: ``ray.init`` waits minutes on an address
    where nothing listens before it fails."""
    import socket

    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local": Ray resolves those itself
    try:
        socket.create_connection(
            (host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout
        ).close()
    except OSError as e:
        raise IndexBuildError(
            f"cannot start or reach --address {address}: nothing answers at {hostport} "
            f"({e.strerror or e}); start the cluster (ray start --head) or fix the address"
        ) from None


def _connect(ray, address: str | None, num_cpus: int | None) -> bool:
    """Connect to ``address`` or start a local Ray; returns whether this call started it."""
    if ray.is_initialized():
        return False
    if address:
        _probe(address)
    env = {"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}} if address else None
    try:
        if address:
            ray.init(address=address, runtime_env=env, log_to_driver=False, logging_level="ERROR")
        else:
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="ERROR",
            )
    except Exception as e:  # ConnectionError, RuntimeError, ValueError: Ray's own types vary
        where = f"--address {address}" if address else "a local Ray"
        raise IndexBuildError(f"cannot start or reach {where}: {_first_line(e)}") from None
    return True


def _part_dir(work: Path, i: int) -> Path:
    return work / f"{_PART_PREFIX}{i:05d}"


def _map_shard(opts: MapOptions, i: int, n: int, fault: int | None) -> dict:
    """Body of one map task: shard ``i`` of ``n`` into its own work dir."""
    work = Path(opts.work_dir)
    if fault == i:
        work.mkdir(parents=True, exist_ok=True)
        marker = work / "fault-injected"
        if not marker.exists():
            marker.touch()
            os._exit(1)  # the worker dies: Ray retries the task
    t0 = time.monotonic()
    manifest = run_map(opts, log=lambda *a, **k: None)
    s = manifest["shards"].get(str(i), {})
    return {
        "shard": i,
        "documents": s.get("documents", 0),
        "tokens": s.get("tokens", 0),
        "seconds": time.monotonic() - t0,
        "peak_rss_bytes": peak_rss_bytes(),
        "map_stats": manifest.get("map_stats", {}),
    }


def build_ray(
    opts: MapOptions,
    output,
    *,
    address: str | None = None,
    min_count: int = 1,
    max_children: int | None = None,
    keep_work: bool = False,
    partitions: int = 0,
    num_cpus: int | None = None,
    log=print,
) -> dict:
    """map (one Ray task per shard) + partitioned reduce (one Ray task per partition);
    returns the summary of ``build`` plus ``engine``, per-task times and peak RSS."""
    opts.check()
    if opts.max_docs or opts.max_tokens:
        raise IndexBuildError(
            "--max-docs/--max-tokens cannot be combined with --engine ray "
            "(the limit depends on the order of the shards); use the local engine"
        )
    if opts.part != (0, 1):
        raise IndexBuildError(
            "--part cannot be combined with --engine ray (Ray spreads the shards itself)"
        )
    output = check_output(output)
    work = Path(opts.work_dir).expanduser().absolute()
    tok, corpus = open_inputs(opts)
    files, dirs = corpus_inputs(corpus, opts.tokenizer)
    check_not_an_input(output, files, dirs)
    check_not_an_input(work, files, dirs, flag="--work-dir", is_dir=True)
    if is_inside(real_path(output), real_path(work)):
        raise IndexBuildError(
            f"--output {output} lies inside --work-dir {work}, whose files the build removes; "
            "write the index elsewhere or choose another --work-dir"
        )
    n = len(corpus.shards)
    if n == 0:
        raise IndexBuildError("the corpus has no shards")
    ray = _import_ray()
    if work.exists() and not work.is_dir():
        raise IndexBuildError(
            f"--work-dir {work} exists and is not a directory; choose another path"
        )
    work.mkdir(parents=True, exist_ok=True)
    started = _connect(ray, address, num_cpus)
    try:
        with WorkDirLock(work):
            summary = _build(
                ray,
                opts,
                output,
                work,
                n,
                min_count=min_count,
                max_children=max_children,
                keep_work=keep_work,
                partitions=partitions,
                log=log,
            )
        if not keep_work:
            try:
                work.rmdir()
            except OSError:
                pass  # not empty: the user's own files stay
        return summary
    finally:
        if started:
            ray.shutdown()


def _build(
    ray,
    opts: MapOptions,
    output: Path,
    work: Path,
    n: int,
    *,
    min_count,
    max_children,
    keep_work,
    partitions,
    log,
) -> dict:
    done = {i for i in range(n) if (m := read_manifest(_part_dir(work, i))) and m.get("complete")}
    begun = [p for p in work.glob(f"{_PART_PREFIX}*") if p.is_dir()]
    if begun and not opts.resume:
        raise IndexBuildError(
            f"{work} already holds {len(done)} mapped shards: pass --resume to continue "
            "that build, or remove the work dir to start over"
        )
    fault = os.environ.get(FAULT_ENV)
    fault_i = int(fault) if fault and fault.isdigit() else None
    task = ray.remote(num_cpus=1, max_retries=MAP_RETRIES, retry_exceptions=False)(_map_shard)
    threads = opts.threads or 1  # one core per task; Ray runs as many tasks as there are CPUs
    t0 = time.monotonic()
    pending = {}
    for i in range(n):
        if i in done:
            continue
        o = MapOptions(
            **{
                **opts.__dict__,
                "work_dir": _part_dir(work, i),
                "part": (i, n),
                "resume": True,
                "quiet": True,
                "threads": threads,
            }
        )
        pending[task.remote(o, i, n, fault_i)] = i
    results = []
    bar = None
    if not opts.quiet:
        from tqdm import tqdm

        bar = tqdm(
            total=n,
            initial=len(done),
            unit="shard",
            desc="ngram-build map (ray)",
            file=sys.stderr,
            dynamic_ncols=True,
        )
    tokens = 0
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                pending.pop(ref)
                r = ray.get(ref)
                results.append(r)
                tokens += r["tokens"]
                if bar is not None:
                    dt = max(time.monotonic() - t0, 1e-9)
                    bar.update(1)
                    bar.set_postfix_str(f"{tokens / dt:,.0f} tok/s", refresh=False)
    except ray.exceptions.RayTaskError as e:  # the task raised: its own error (not retried)
        cause = getattr(e, "cause", None)
        if isinstance(cause, DartError):
            cause.args = (
                f"{cause} (the finished shards are kept in {work}: fix the problem and rerun "
                "with --resume)",
            )
            raise cause from None
        raise IndexBuildError(
            f"a map task failed: {_first_line(e)}; the finished shards are kept in {work}: "
            "fix the problem and rerun with --resume"
        ) from None
    except ray.exceptions.RayError as e:  # its worker died on every attempt
        raise IndexBuildError(
            f"a map task failed after {MAP_RETRIES} retries ({_first_line(e)}); the finished "
            f"shards are kept in {work}: rerun with --resume"
        ) from None
    finally:
        if bar is not None:
            bar.close()
        for ref in pending:
            ray.cancel(ref, force=True)
    t1 = time.monotonic()
    dirs = [_part_dir(work, i) for i in range(n)]
    if partitions <= 0:
        partitions = max(1, int(ray.cluster_resources().get("CPU", 1)))
    reduce_task = ray.remote(num_cpus=1, max_retries=MAP_RETRIES)(merge_partition)
    part_results: list[dict] = []

    def on_ray(jobs):
        out = ray.get([reduce_task.remote(*j) for j in jobs])
        part_results.extend(out)
        return out

    try:
        reduce = run_reduce(
            dirs,
            output,
            min_count=min_count,
            threads=opts.threads,
            memory=opts.memory,
            temp_dir=opts.temp_dir,
            max_children=max_children,
            partitions=partitions,
            run_partitions=on_ray,
            log=None if opts.quiet else (lambda s: log(s, file=sys.stderr)),
        )
    except Exception as e:
        if isinstance(e, ray.exceptions.RayError):
            first = _first_line(e)
            raise IndexBuildError(
                f"a reduce task failed ({first}); the mapped shards are kept in {work}: "
                "rerun with --resume to retry the reduce"
            ) from None
        e.args = (
            f"{e} (the mapped shards are kept in {work}: rerun with --resume to retry the reduce)",
        )
        raise
    t2 = time.monotonic()
    manifest = {"config": read_manifest(dirs[0])["config"], "shards": {}}
    for d in dirs:
        manifest["shards"].update(read_manifest(d)["shards"])
    ms = [r["map_stats"] for r in results]
    manifest["map_stats"] = {
        k: sum(m.get(k, 0) for m in ms) for k in ("tokenize_s", "count_s", "read_wait_s")
    }
    manifest["map_stats"].update(
        threads=threads,
        builder_memory_bytes=max((m.get("builder_memory_bytes", 0) for m in ms), default=0),
    )
    summary = build_summary(
        output, manifest, reduce, wall=t2 - t0, map_s=t1 - t0, reduce_s=t2 - t1, opts=opts
    )
    summary["engine"] = "ray"
    summary["cluster_cpus"] = int(ray.cluster_resources().get("CPU", 0))
    summary["map_tasks"] = [
        {k: r[k] for k in ("shard", "tokens", "seconds", "peak_rss_bytes")} for r in results
    ]
    summary["reduce_partitions"] = [
        {k: p[k] for k in ("seconds", "peak_rss_bytes")} for p in part_results
    ]
    summary["partition_wall_s"] = reduce.get("partition_wall_s")
    summary["final_merge_s"] = reduce.get("final_merge_s")
    summary["peak_rss_worker_bytes"] = max(
        [r["peak_rss_bytes"] for r in results + part_results] or [0]
    )
    if not keep_work:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return summary

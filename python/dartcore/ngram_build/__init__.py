"""The index build pipeline: corpus -> tokens -> counts -> index, in bounded memory.

``build(opts, output)`` runs two steps that can also be run on their own (``ngram-build``
is the command line over this module):

* ``run_map``: shards -> sorted run files in a work dir + ``manifest.json``;
* ``run_reduce``: the runs of one or more work dirs -> the index (k-way merge; with
  ``partitions`` > 1 several merges of key ranges at once, then one merge of those).

``dartcore.ngram_build.ray_engine.build_ray`` schedules the same two steps as Ray tasks.

The map step handles one shard (file) at a time: it reads and tokenises the shard's
documents in batches (a reader thread decompresses and parses while the tokenizer's
threads encode, GIL released), appends EOS to every document, counts on the index
builder's thread pool, and writes the shard's sorted runs into W/shard-NNNNN/. When
the shard is complete its runs are listed in the manifest (written atomically) with the
shard's size, mtime and SHA-256, so an interrupted map (Ctrl-C, SIGTERM, a crash) loses at
most the shard in progress: ``resume`` skips the finished shards whose file is unchanged,
maps again the ones that changed, and the final index is byte-identical to an
uninterrupted build of the corpus as it is now (the index depends only on the counts and
on deterministic metadata). ``part=(I, N)`` maps every N-th shard, so N machines can map
one corpus into N work dirs; ``run_reduce([W1, W2, ...])`` merges them all.

Safety: no build writes over its inputs. The output and the work dir are checked against
every input (shard files, the scanned corpus directory, a tokenizer file; through
symlinks, hard links and relative paths) before any work; the index is written to a
temporary file and renamed into place. Leftovers of killed builds (spill dirs, half-written
shard dirs, a work dir's lock) are removed by the next run that finds their lock free.

Memory: ``MapOptions.memory`` bounds the whole process. The builder's counting buffer gets
what is left after the process's resident size at start (interpreter, tokenizer) and a
reserve for the batches in flight; everything else streams.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from dartcore.errors import CorpusError, DartError, IndexBuildError
from dartcore.ngram_build.inputs import (
    check_not_an_input,
    check_output,
    corpus_inputs,
    is_inside,
    real_path,
    shard_stamp,
)
from dartcore.ngram_build.map import MapOptions, open_inputs, run_map
from dartcore.ngram_build.reduce import (
    build_summary,
    peak_rss_bytes,
    print_summary,
    run_reduce,
)
from dartcore.ngram_build.workdir import WorkDirLock, read_manifest, remove_work

__all__ = [
    "MapOptions",
    "build",
    "run_map",
    "run_reduce",
    "open_inputs",
    "check_output",
    "check_not_an_input",
    "shard_stamp",
    "print_summary",
    "peak_rss_bytes",
]


def build(
    opts: MapOptions,
    output: str | os.PathLike,
    *,
    min_count: int = 1,
    max_children: int | None = None,
    keep_work: bool = False,
    partitions: int = 1,
    log=print,
) -> dict:
    """map + reduce; returns the summary (see ``build_summary``).

    Everything that can be checked is checked before the map starts: the options, the
    output path, the inputs (tokenizer, shards, npy headers) and that the output is none
    of them. A failed build with no finished shard removes its work dir; one with finished
    shards keeps it for ``resume`` and says so."""
    opts.check()
    output = check_output(output)
    work = Path(opts.work_dir).expanduser()
    fresh = not work.exists()
    tok, corpus = open_inputs(opts)
    files, dirs = corpus_inputs(corpus, opts.tokenizer)
    check_not_an_input(output, files, dirs)
    if is_inside(real_path(output), real_path(work)):
        raise IndexBuildError(
            f"--output {output} lies inside --work-dir {work}, whose files the build removes; "
            "write the index elsewhere or choose another --work-dir"
        )
    t0 = time.monotonic()
    try:
        manifest = run_map(opts, log=log, inputs=(tok, corpus))
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        try:
            m = read_manifest(work) if work.is_dir() else None
        except IndexBuildError:
            m = None
        n = len(m["shards"]) if m else 0
        if n == 0 and work.is_dir() and (fresh or m is not None):
            try:
                with WorkDirLock(work):  # never another live build's dir
                    remove_work(work)
            except (IndexBuildError, OSError):
                pass  # cleaning up must not hide the error itself
        elif isinstance(e, (IndexBuildError, CorpusError)) and n and "--resume" not in str(e):
            e.args = (
                f"{e} ({n} finished shards are kept in {work}: fix the problem and rerun with "
                "--resume, or remove that directory)",
            )
        raise
    if not manifest["complete"]:
        raise IndexBuildError("map did not finish every shard")
    t1 = time.monotonic()
    try:
        reduce = run_reduce(
            [opts.work_dir],
            output,
            min_count=min_count,
            threads=opts.threads,
            memory=opts.memory,
            temp_dir=opts.temp_dir,
            max_children=max_children,
            partitions=partitions,
            log=None if opts.quiet else (lambda s: log(s, file=sys.stderr)),
        )
    except (DartError, ValueError) as e:
        e.args = (
            f"{e} (the mapped shards are kept in {work}: rerun with --resume to retry the reduce)",
        )
        raise
    t2 = time.monotonic()
    summary = build_summary(
        output, manifest, reduce, wall=t2 - t0, map_s=t1 - t0, reduce_s=t2 - t1, opts=opts
    )
    if not keep_work:
        remove_work(work)
    return summary

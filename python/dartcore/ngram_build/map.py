"""The map step: shards -> tokens -> counts -> sorted run files + manifest, one shard at
a time, in bounded memory (see ``dartcore.ngram_build``)."""

from __future__ import annotations

import os
import queue
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dartcore.errors import CorpusError, IndexBuildError
from dartcore.ngram_build.inputs import (
    changed_shards,
    check_not_an_input,
    corpus_inputs,
    shard_stamp,
)
from dartcore.ngram_build.workdir import (
    MANIFEST_FORMAT,
    SPILL_PREFIX,
    WorkDirLock,
    read_manifest,
    remove_leftovers,
    write_manifest,
)
from dartcore.tokenizers import fingerprint


def rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # pragma: no cover - psutil is a dependency
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _release_free_memory() -> None:
    """Hand freed heap back to the OS between shards (glibc keeps it in per-thread
    arenas otherwise, and RSS only grows)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def map_threads(threads: int | None) -> int:
    """Threads for tokenising and counting: ``threads`` if given, else the owned pool's size
    (``dartcore.index.num_threads``: the one reading of ``DART_NUM_THREADS``)."""
    from dartcore.index import check_threads, num_threads

    if threads:
        return check_threads(threads, "threads")
    return num_threads()


# ----------------------------------------------------------------------------- options


@dataclass
class MapOptions:
    corpus: str = "dolma"
    corpus_dir: str | None = None
    files: str | list[str] | None = None
    text_field: str = "text"
    token_dtype: str | None = None
    tokenizer: str = "qwen3"
    work_dir: Path = Path("ngram-work")
    memory: int = 8 << 30
    threads: int = 0  # 0: the owned pool's size
    temp_dir: str | None = None
    max_docs: int | None = None
    max_tokens: int | None = None
    resume: bool = False
    strict: bool = False
    quiet: bool = False
    part: tuple[int, int] = (0, 1)
    batch_bytes: int = 0  # 0: derived from memory
    stop_after_shards: int | None = None  # test hook: behave as if Ctrl-C came after N new shards
    extra: dict = field(default_factory=dict)

    def check(self) -> None:
        """Range checks of every option, before any file is opened (messages name the flag)."""
        from dartcore.corpus import CORPUS_KINDS
        from dartcore.index import MAX_THREADS

        if self.corpus not in CORPUS_KINDS:
            raise CorpusError(
                f"unknown corpus kind {self.corpus!r} (--corpus): valid kinds are "
                f"{', '.join(CORPUS_KINDS)}"
            )
        for flag, v in (("--max-docs", self.max_docs), ("--max-tokens", self.max_tokens)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise IndexBuildError(f"{flag} must be an integer of at least 1, got {v!r}")
        if (
            isinstance(self.threads, bool)
            or not isinstance(self.threads, int)
            or not 0 <= self.threads <= MAX_THREADS
        ):
            raise IndexBuildError(
                f"--threads must be in 0..={MAX_THREADS} (0: all CPUs or DART_NUM_THREADS), "
                f"got {self.threads!r}"
            )
        i, n = self.part
        if not (n >= 1 and 0 <= i < n):
            raise IndexBuildError(f"--part {i}/{n}: need 0 <= I < N")
        if n > 1 and (self.max_docs or self.max_tokens):
            raise IndexBuildError(
                "--max-docs/--max-tokens cannot be combined with --part (the limit is global)"
            )
        if self.temp_dir is not None and not Path(self.temp_dir).expanduser().is_dir():
            raise IndexBuildError(
                f"--temp-dir {self.temp_dir}: no such directory; create it or leave it out"
            )


class _Interrupted(KeyboardInterrupt):
    pass


def _batches(corpus, index: int, batch_bytes: int, batch_docs: int) -> Iterator[list]:
    batch: list = []
    size = 0
    for doc in corpus.read_shard(index):
        batch.append(doc)
        size += len(doc) if isinstance(doc, str) else doc.nbytes
        if size >= batch_bytes or len(batch) >= batch_docs:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class _Prefetch:
    """Read (decompress + JSON-parse) the next batches on a thread while the main
    thread tokenises and counts. Queue depth 2 bounds the text in flight."""

    _DONE = object()

    def __init__(self, source: Iterator[list], depth: int = 2) -> None:
        self._q: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._source = source
        self._t = threading.Thread(target=self._run, name="ngram-build-reader", daemon=True)
        self._t.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for batch in self._source:
                if not self._put(batch):
                    return
            self._put(self._DONE)
        except BaseException as e:  # handed to the consumer
            self._put(e)

    def __iter__(self) -> Iterator[list]:
        while True:
            item = self._q.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)
        close = getattr(self._source, "close", None)
        if close is not None and not self._t.is_alive():
            close()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}" if n < 10 << 20 else f"{n / 2**20:,.0f}"


class _Progress:
    def __init__(self, corpus, opts: MapOptions, done_docs: int, done_tokens: int) -> None:
        self.corpus = corpus
        self.start = time.monotonic()
        self.docs0, self.tokens0 = done_docs, done_tokens
        self.docs, self.tokens = done_docs, done_tokens
        self.bar = None
        if opts.quiet:
            return
        from tqdm import tqdm

        if opts.max_tokens:
            self.mode, total, unit = "tokens", opts.max_tokens, "tok"
        elif opts.max_docs:
            self.mode, total, unit = "docs", opts.max_docs, "doc"
        else:
            self.mode, total, unit = "bytes", corpus.stats.bytes_total, "B"
        self.bar = tqdm(
            total=total,
            unit=unit,
            unit_scale=True,
            unit_divisor=1024 if unit == "B" else 1000,
            file=sys.stderr,
            dynamic_ncols=True,
            smoothing=0.1,
            desc="ngram-build map",
        )
        self._pos = 0
        self.update(done_docs, done_tokens)

    def update(self, docs: int, tokens: int) -> None:
        self.docs, self.tokens = docs, tokens
        if self.bar is None:
            return
        pos = {"tokens": tokens, "docs": docs, "bytes": self.corpus.stats.bytes_read}[self.mode]
        pos = min(pos, self.bar.total or pos)
        if pos > self._pos:
            self.bar.update(pos - self._pos)
            self._pos = pos
        dt = max(time.monotonic() - self.start, 1e-9)
        s = self.corpus.stats
        self.bar.set_postfix_str(
            f"{(docs - self.docs0) / dt:,.0f} docs/s, {(tokens - self.tokens0) / dt / 1e6:.2f} Mtok/s, "
            f"{_mib(s.bytes_read)}/{_mib(s.bytes_total)} MiB read, "
            f"shard {s.files_done}/{s.files}" + (f", {s.problems()} bad" if s.problems() else ""),
            refresh=False,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _config(opts: MapOptions, tok, corpus) -> dict:
    """What must match between runs of map that share a work dir (and across parts)."""
    return {
        "tokenizer": {
            "name": tok.name,
            "fingerprint": fingerprint(tok),
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
        },
        "corpus": corpus.description(),
        "max_docs": opts.max_docs,
        "max_tokens": opts.max_tokens,
        "parts": opts.part[1],
    }


def _same_settings(old: dict, new: dict) -> list[str]:
    """Settings that differ between two configs; the corpus's total size may change (a
    changed shard is mapped again), its kind, files and text field may not."""
    diff = []
    for k in new:
        a, b = old.get(k), new[k]
        if k == "corpus" and isinstance(a, dict):
            a = {x: y for x, y in a.items() if x != "bytes"}
            b = {x: y for x, y in b.items() if x != "bytes"}
        if a != b:
            diff.append(k)
    return sorted(diff)


def open_inputs(opts: MapOptions):
    """The tokenizer and the corpus of a map (shards listed, npy headers checked)."""
    from dartcore.corpus import open_corpus
    from dartcore.tokenizers import load_tokenizer

    # Tokenising is CPU-bound like counting: threads beyond the CPUs only contend.
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    tok = load_tokenizer(opts.tokenizer, threads=min(opts.threads, cpus) if opts.threads else None)
    corpus = open_corpus(
        opts.corpus,
        corpus_dir=opts.corpus_dir,
        files=opts.files,
        text_field=opts.text_field,
        strict=opts.strict,
        eos_id=tok.eos_id,
        vocab_size=tok.vocab_size,
        token_dtype=opts.token_dtype,
    )
    corpus.check_headers()
    return tok, corpus


def run_map(opts: MapOptions, *, log=print, inputs=None) -> dict:
    """Map shards to sorted runs in ``opts.work_dir``; returns the manifest.

    ``inputs``: ``(tokenizer, corpus)`` already opened by ``open_inputs``."""
    from dartcore.index import IndexBuilder

    opts.check()
    threads = map_threads(opts.threads)
    tok, corpus = inputs if inputs is not None else open_inputs(opts)
    part, parts = opts.part
    work = Path(opts.work_dir).expanduser()
    files, dirs = corpus_inputs(corpus, opts.tokenizer)
    check_not_an_input(work, files, dirs, flag="--work-dir", is_dir=True)
    if opts.temp_dir:
        check_not_an_input(opts.temp_dir, files, dirs, flag="--temp-dir", is_dir=True)
    if work.exists() and not work.is_dir():
        raise IndexBuildError(
            f"--work-dir {work} exists and is not a directory; choose another path"
        )
    work.mkdir(parents=True, exist_ok=True)
    config = _config(opts, tok, corpus)

    with WorkDirLock(work):
        manifest = read_manifest(work)
        if manifest is not None and manifest.get("shards"):
            if not opts.resume:
                raise IndexBuildError(
                    f"{work} already holds {len(manifest['shards'])} mapped shards: pass --resume to continue "
                    "that build, or remove the work dir to start over"
                )
            diff = _same_settings(manifest["config"], config)
            if diff:
                raise IndexBuildError(
                    f"cannot resume in {work}: it was mapped with different settings ({', '.join(diff)} differ); "
                    "use the same options or another --work-dir"
                )
            done = manifest["shards"]
            changed = changed_shards(done, corpus, threads, opts.quiet, log)
            if changed:
                # With --max-docs/--max-tokens the later shards' counts depend on this one's
                # documents: they are mapped again too.
                first = int(changed[0])
                drop = (
                    [k for k in done if int(k) >= first]
                    if (opts.max_docs or opts.max_tokens)
                    else changed
                )
                names = ", ".join(
                    str(corpus.shards[int(k)].name)
                    for k in changed[:5]
                    if int(k) < len(corpus.shards)
                )
                log(
                    f"ngram-build: {len(changed)} finished shard(s) changed since they were mapped ({names}"
                    f"{', ...' if len(changed) > 5 else ''}); mapping {len(drop)} shard(s) again",
                    file=sys.stderr,
                )
                for k in drop:
                    shutil.rmtree(work / f"shard-{int(k):05d}", ignore_errors=True)
                    del done[k]
            manifest["config"] = config  # the corpus's size as it is now
            manifest["complete"] = False
        if manifest is None or not manifest.get("shards"):
            manifest = {
                "format": MANIFEST_FORMAT,
                "config": config,
                "part": [part, parts],
                "shards": {},
                "complete": False,
            }
        remove_leftovers(work)
        write_manifest(work, manifest)

        # Budget: whatever the process already holds (interpreter, tokenizer), a
        # reserve for the batches in flight, the rest for the builder's buffer.
        # Four batches are alive at once (two queued, one being read, one being
        # tokenised) and a batch of B UTF-8 bytes costs up to ~8B: the str (up to
        # 4 bytes per character once a document holds an emoji), its cached UTF-8
        # copy, the NFC copy, token arrays with and without EOS. Measured on the
        # local corpus (527 MB of code and docs): 6.5 MB batches pushed RSS ~100
        # MiB above the start, so the reserve is 40 batches plus 48 MiB for
        # allocator slack (batches are memory/256, at most 8 MiB).
        batch_bytes = opts.batch_bytes or int(min(8 << 20, max(256 << 10, opts.memory // 256)))
        reserve = 40 * batch_bytes + (48 << 20)
        builder_bytes = opts.memory - rss_bytes() - reserve
        if builder_bytes < (8 << 20):
            raise IndexBuildError(
                f"--memory {opts.memory / 2**20:.0f} MiB is too small: this process already uses "
                f"{rss_bytes() / 2**20:.0f} MiB and needs {reserve / 2**20:.0f} MiB for batches; "
                f"give at least {(rss_bytes() + reserve + (8 << 20)) / 2**20:.0f} MiB"
            )
        done = manifest["shards"]
        docs_total = sum(s["documents"] for s in done.values())
        tokens_total = sum(s["tokens"] for s in done.values())
        eos = np.array([tok.eos_id], dtype=np.uint32)
        times = {"read_wait_s": 0.0, "tokenize_s": 0.0, "count_s": 0.0, "write_runs_s": 0.0}
        new_shards = 0
        limit_hit = any(s.get("limit_reached") for s in done.values())
        progress = _Progress(corpus, opts, docs_total, tokens_total)
        started = time.monotonic()
        spill: Path | None = None
        partial: Path | None = None
        try:
            for i, path in enumerate(corpus.shards):
                if str(i) in done or i % parts != part or limit_hit:
                    corpus.skip_shard(i)
                    continue
                if opts.stop_after_shards is not None and new_shards >= opts.stop_after_shards:
                    raise _Interrupted()
                before = corpus.stats.as_dict()
                stamp = shard_stamp(path)
                spill = Path(tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=opts.temp_dir or work))
                shard_dir = work / f"shard-{i:05d}"
                partial = work / f"shard-{i:05d}.partial"
                shutil.rmtree(shard_dir, ignore_errors=True)
                shard_docs = shard_tokens = 0
                reader = _Prefetch(_batches(corpus, i, batch_bytes, 16384))
                try:
                    builder = IndexBuilder(
                        tok.vocab_size,
                        memory_limit=builder_bytes,
                        temp_dir=str(spill),
                        threads=threads,
                    )
                    t_wait = time.perf_counter()
                    for batch in reader:
                        t0 = time.perf_counter()
                        times["read_wait_s"] += t0 - t_wait
                        if corpus.kind == "npy":
                            arrays = batch
                        else:
                            arrays = tok.encode_batch(batch)
                        t1 = time.perf_counter()
                        docs = [np.concatenate((a, eos)) for a in arrays]
                        # --max-docs / --max-tokens: whole documents, in corpus order.
                        if opts.max_docs is not None and docs_total + len(docs) >= opts.max_docs:
                            docs = docs[: opts.max_docs - docs_total]
                            limit_hit = True
                        if opts.max_tokens is not None:
                            lengths = np.cumsum([len(d) for d in docs]) + tokens_total
                            # first doc reaching it
                            over = int(np.searchsorted(lengths, opts.max_tokens))
                            if over < len(docs):
                                docs = docs[: over + 1]
                                limit_hit = True
                        builder.add_many(docs)
                        t2 = time.perf_counter()
                        times["tokenize_s"] += t1 - t0
                        times["count_s"] += t2 - t1
                        n_tok = sum(len(d) for d in docs)
                        docs_total += len(docs)
                        tokens_total += n_tok
                        shard_docs += len(docs)
                        shard_tokens += n_tok
                        progress.update(docs_total, tokens_total)
                        if limit_hit:
                            break
                        t_wait = time.perf_counter()
                finally:
                    reader.close()
                t3 = time.perf_counter()
                runs = builder.write_runs(str(partial))
                del builder
                os.replace(partial, shard_dir)
                times["write_runs_s"] += time.perf_counter() - t3
                st = os.stat(path)
                if (st.st_size, st.st_mtime_ns) != (stamp["size"], stamp["mtime_ns"]):
                    raise CorpusError(
                        f"{path} changed while it was being read; rerun with --resume "
                        "once nothing writes to the corpus"
                    )
                after = corpus.stats.as_dict()
                delta = {
                    k: after[k] - before[k]
                    for k in ("bad_lines", "invalid_utf8", "corrupt_streams", "split_documents")
                }
                done[str(i)] = {
                    "file": str(path),
                    "input": stamp,
                    "runs": [str(Path(shard_dir.name) / Path(r).name) for r in runs],
                    "documents": shard_docs,
                    "tokens": shard_tokens,
                    "limit_reached": limit_hit,
                    **delta,
                }
                shutil.rmtree(spill, ignore_errors=True)
                spill = partial = None
                _release_free_memory()
                write_manifest(work, manifest)
                new_shards += 1
            progress.update(docs_total, tokens_total)
        except BaseException:
            # Ctrl-C, SIGTERM or an error: drop the shard in progress (its spill dir and
            # half-written run dir); finished shards stay listed in the manifest.
            progress.close()
            for p in (spill, partial):
                if p is not None:
                    shutil.rmtree(p, ignore_errors=True)
            raise
        progress.close()
        mine = [i for i in range(len(corpus.shards)) if i % parts == part]
        manifest["complete"] = limit_hit or all(str(i) in done for i in mine)
        manifest["map_stats"] = {
            "seconds": time.monotonic() - started,
            "threads": threads,
            "builder_memory_bytes": builder_bytes,
            "batch_bytes": batch_bytes,
            "messages": corpus.stats.messages,
            **times,
        }
        write_manifest(work, manifest)
        for m in corpus.stats.messages:
            log(f"warning: {m}", file=sys.stderr)
        return manifest

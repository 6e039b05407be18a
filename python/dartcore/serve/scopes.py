"""Tenant scopes of dart-serve's live n-gram layers.

A live layer makes a request faster when similar text was served before, so a layer shared
between users is a timing side channel. A worker started with ``--learn`` therefore keeps one
layer per *scope* (``--learn-scope tenant``, the default) or one for all its requests
(``shared``). A request's scope, as an id:

* ``"scope:<name>"`` when the body names one (``"dart": {"scope": "<name>"}``; 1 to
  :data:`MAX_NAME` printable ASCII characters, no space or ``:``). Anyone who sends the same
  name shares the layer: names are for a trusted gateway that sets them per tenant;
* ``"key:<hash>"`` from the API key (``Authorization: Bearer <key>``): a SHA-256 of the key
  (never the key itself, which is neither stored nor logged);
* ``"anonymous"`` otherwise.

:class:`LiveScopes` holds a worker's layers: at most ``max_scopes``, the least recently used
evicted whole (``on_drop`` is told: dart-serve ``--learn-shared`` then removes the worker's
delta of it), each at most ``capacity`` tokens.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from dartcore.live import DEFAULT_CAPACITY, LiveLayer

__all__ = [
    "ANONYMOUS",
    "SHARED",
    "MAX_NAME",
    "SCOPE_MODES",
    "LiveScopes",
    "check_name",
    "clear_target",
    "default_capacity",
    "request_scope",
]

ANONYMOUS = "anonymous"
SHARED = "shared"
MAX_NAME = 64
SCOPE_MODES = ("tenant", "shared")
_KEY_HASH_HEX = 32  # 128 bits of the key's SHA-256: no two tenants' keys meet by chance


def check_name(name) -> str:
    """A request's scope name, checked; ValueError says what is wrong."""
    if not isinstance(name, str):
        raise ValueError(f"scope must be a string, got {type(name).__name__}")
    if not 1 <= len(name) <= MAX_NAME:
        raise ValueError(f"scope must be 1 to {MAX_NAME} characters, got {len(name)}")
    bad = [c for c in name if not ("!" <= c <= "~") or c == ":"]
    if bad:
        raise ValueError(
            f"scope must be printable ASCII without spaces or ':', got {bad[0]!r} in {name!r}"
        )
    return name


def _key_hash(key: str) -> str:
    digest = hashlib.sha256(b"dart-live-scope\0" + key.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:_KEY_HASH_HEX]


def request_scope(name, authorization: str | None) -> str:
    """The scope id of a request: its named scope, else its API key's hash, else anonymous."""
    if name is not None:
        return "scope:" + check_name(name)
    key = (authorization or "").strip()
    scheme, _, rest = key.partition(" ")
    if scheme.lower() == "bearer":
        key = rest.strip()
    return "key:" + _key_hash(key) if key else ANONYMOUS


def clear_target(value) -> str | None:
    """The scope id a clear request names: None (all), an id as a clear's answer lists them
    (``scope:...``, ``key:...``, ``anonymous``, ``shared``) or a name as requests send it."""
    if value is None:
        return None
    if isinstance(value, str) and value in (ANONYMOUS, SHARED):
        return value
    if isinstance(value, str) and value.startswith(("scope:", "key:")):
        prefix, _, rest = value.partition(":")
        if prefix == "key" and (
            len(rest) != _KEY_HASH_HEX or any(c not in "0123456789abcdef" for c in rest)
        ):
            raise ValueError(
                f"scope {value!r}: a key scope is 'key:' and {_KEY_HASH_HEX} hex digits"
            )
        if prefix == "scope":
            check_name(rest)
        return value
    return "scope:" + check_name(value)


def default_capacity(mode: str, max_scopes: int) -> int:
    """Tokens per layer when not given: one layer's default in all, split across the scopes."""
    return DEFAULT_CAPACITY if mode == "shared" else max(1, DEFAULT_CAPACITY // max_scopes)


class LiveScopes:
    """A worker's live layers by scope id (see the module docs); ``mode`` ``"shared"`` maps
    every scope to one layer."""

    def __init__(
        self,
        vocab_size: int,
        *,
        mode: str = "tenant",
        max_scopes: int = 64,
        capacity: int | None = None,
        on_drop=None,
    ):
        if mode not in SCOPE_MODES:
            raise ValueError(f"mode must be one of {SCOPE_MODES}, got {mode!r}")
        if isinstance(max_scopes, bool) or not isinstance(max_scopes, int) or max_scopes < 1:
            raise ValueError(f"max_scopes must be an int >= 1, got {max_scopes!r}")
        if capacity is None:
            capacity = default_capacity(mode, max_scopes)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1 (tokens), got {capacity!r}")
        self.vocab_size = int(vocab_size)
        self.mode = mode
        self.max_scopes = max_scopes
        self.capacity = capacity
        self.evicted = 0
        # called with (scope id, layer) when the least recently used layer is dropped
        self.on_drop = on_drop
        self._layers: OrderedDict[str, LiveLayer] = OrderedDict()

    def _id(self, scope: str) -> str:
        return SHARED if self.mode == "shared" else scope

    def layer(self, scope: str) -> LiveLayer:
        """The scope's layer, made if new (evicting the least recently used past
        ``max_scopes``); marks it the most recently used."""
        sid = self._id(scope)
        live = self._layers.get(sid)
        if live is None:
            while len(self._layers) >= self.max_scopes:
                old_sid, old = self._layers.popitem(last=False)
                old.clear()  # requests still running on it stop drafting from its text
                self.evicted += 1
                if self.on_drop is not None:
                    self.on_drop(old_sid, old)
            live = self._layers[sid] = LiveLayer(self.vocab_size, self.capacity)
        else:
            self._layers.move_to_end(sid)
        return live

    def clear(self, scope: str | None = None) -> dict:
        """Forget one scope's layer (None: all of them); returns the scope ids dropped and the
        tokens they held. Requests still running on a dropped layer find it empty."""
        sids = list(self._layers) if scope is None else [self._id(scope)]
        dropped, tokens = [], 0
        for sid in sids:
            live = self._layers.pop(sid, None)
            if live is not None:
                tokens += len(live)
                live.clear()
                dropped.append(sid)
        return {"scopes": dropped, "tokens": tokens}

    def items(self) -> list[tuple[str, LiveLayer]]:
        """(scope id, layer) pairs held, least recently used first."""
        return list(self._layers.items())

    def scopes(self) -> list[str]:
        """Scope ids held, least recently used first."""
        return list(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def nbytes(self) -> int:
        return sum(live.nbytes() for live in self._layers.values())

"""The two directories dartcore reads from outside the repository, each named by one
environment variable:

- ``DARTCORE_DATA``: the full evaluation and training sets (``eval/``, ``train/``,
  ``dolma-sample/``) for benchmarks and training. Optional: the tests read the small fixtures in
  the repository's ``tests/data``; with neither this variable nor ``--data-dir``, the datasets
  that need it say so and the ``builtin`` prompts still work.
- ``DARTCORE_CACHE``: converted models and measured verify-cost curves; default
  ``~/.cache/dartcore``.

``DARTCORE_SHARED_DATA`` and ``DARTCORE_CACHE_DIR`` are the deprecated spellings of the same two
directories: still read (after the new names) with a ``DeprecationWarning``, and to be removed
in the next release.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

__all__ = ["CACHE_ENV", "DATA_ENV", "cache_root", "data_dir_from_env"]

DATA_ENV = "DARTCORE_DATA"
CACHE_ENV = "DARTCORE_CACHE"
_DEPRECATED = {DATA_ENV: "DARTCORE_SHARED_DATA", CACHE_ENV: "DARTCORE_CACHE_DIR"}


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    if value:
        return value
    old = _DEPRECATED[name]
    value = os.environ.get(old)
    if value:
        warnings.warn(
            f"{old} is deprecated and will be removed in the next release: set {name} instead",
            DeprecationWarning,
            stacklevel=3,
        )
        return value
    return None


def data_dir_from_env() -> Path | None:
    """The data directory ``$DARTCORE_DATA`` names, or None when unset (no default: the data
    sets are optional and never looked for beside the checkout)."""
    value = _env(DATA_ENV)
    return Path(value).expanduser() if value else None


def cache_root() -> Path:
    """``$DARTCORE_CACHE``, default ``~/.cache/dartcore`` (not created here)."""
    value = _env(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "dartcore"

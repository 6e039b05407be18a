"""The one sampler: temperature / top-k / top-p warpers and the token draw.

Both the plain autoregressive path and tree verification call
:meth:`Sampler.choose` on a row of target logits, so a sampled DART run and a
sampled AR run draw from exactly the same distribution at every step -- and,
because every committed token costs exactly one uniform from the generator,
they even produce the same tokens for the same seed (up to float noise in the
logits of the two forwards).

Warper order and semantics follow Hugging Face ``generate``: temperature, then
top-k (keep the k largest; 0 = off), then top-p (keep the smallest set of most
probable tokens whose mass reaches p, at least one; 1.0 = off).
``temperature == 0`` is greedy (argmax) and ignores top-k / top-p.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch and numpy are imported where a token is drawn, not here: the HTTP front builds
# SamplingParams and never loads either.

__all__ = [
    "SamplingParams",
    "DEFAULTS",
    "Sampler",
    "warp_probs",
    "draw",
    "check_seed",
    "MAX_SEED",
    "check_stops",
    "is_integer",
]


def is_integer(value) -> bool:
    """An integer that is not a bool (numpy integers included, numpy bools not)."""
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and type(value).__name__ != "bool_"
    )


def _is_real(value) -> bool:
    """A real number that is not a bool (numpy floats and integers included)."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and type(value).__name__ != "bool_"
    )


def check_stops(stop) -> tuple[str, ...]:
    """``stop`` (None, one string, or a sequence of strings) as a tuple of non-empty strings."""
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
    return tuple(stops)


def _number(name: str, value) -> float:
    """``value`` as a float; bools, strings and other types are a TypeError naming ``name``."""
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


# Seeds the generator takes: torch.Generator.manual_seed reads an unsigned 64-bit integer.
MAX_SEED = 2**64 - 1


def check_seed(seed) -> int | None:
    """``seed`` as an int in [0, MAX_SEED] (or None), else a clear error naming it."""
    if seed is None:
        return None
    if not is_integer(seed):
        raise TypeError(
            f"seed must be an integer in [0, 2**64 - 1] or None, got {seed!r} ({type(seed).__name__})"
        )
    if not 0 <= int(seed) <= MAX_SEED:
        raise ValueError(f"seed = {seed} is out of range: must be an integer in [0, 2**64 - 1]")
    return int(seed)


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding parameters, checked once, here: ``temperature`` >= 0 (0 =
    greedy), ``top_p`` in (0, 1], ``top_k`` >= 0 (0 = off), ``max_new_tokens`` >= 0,
    ``seed`` (None or an integer in [0, 2**64 - 1]), ``stop`` strings (non-empty), ``learn``
    (whether the finished request goes into the decoder's live n-gram layer, where it has
    one; :mod:`dartcore.live`). The decoder, the batched engine and the HTTP layer all build
    this one class."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int | None = None
    stop: Sequence[str] = ()
    learn: bool = True

    def __post_init__(self):
        put = object.__setattr__  # frozen: normalise once here
        put(self, "temperature", _number("temperature", self.temperature))
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        put(self, "top_p", _number("top_p", self.top_p))
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_integer(self.top_k):
            raise TypeError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        put(self, "top_k", int(self.top_k))
        n = self.max_new_tokens
        if not is_integer(n):
            raise TypeError(
                f"max_new_tokens must be a non-negative integer, got {n!r} ({type(n).__name__})"
            )
        if n < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {n!r}")
        put(self, "max_new_tokens", int(n))
        put(self, "seed", check_seed(self.seed))
        put(self, "stop", check_stops(self.stop))
        if not isinstance(self.learn, bool):
            raise TypeError(f"learn must be true or false, got {self.learn!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sampler(self, seed: int | None = None) -> Sampler:
        """A fresh :class:`Sampler` for these parameters (seeded with ``seed``, else ``self.seed``)."""
        return Sampler(self, self.seed if seed is None else seed)


# Every request default, written once (the fields above): the decoder, the engine, the CLIs and
# the server read them from here.
DEFAULTS = SamplingParams()


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (float32, last dim) after temperature, top-k and top-p."""
    import torch

    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution (temperature = 0)")
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # the mass already reached p before this token
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw of one token from a 1-D distribution, consuming exactly
    one uniform (float64) from ``generator``."""
    import torch

    u = torch.rand((), dtype=torch.float64, generator=generator).item()
    cdf = probs.detach().to("cpu", torch.float64).cumsum(0)
    idx = int(
        torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)
    )
    # Guard the top end against rounding; skip zero-probability tokens.
    idx = min(idx, probs.shape[0] - 1)
    while float(probs[idx]) == 0.0 and idx > 0:
        idx -= 1
    return idx


class Sampler:
    """Chooses the next token from a row of logits: argmax when greedy, else a
    draw from the warped distribution with a seeded CPU generator."""

    def __init__(self, params: SamplingParams, seed: int | None = None):
        import numpy as np
        import torch

        self.params = params
        self._argmax = np.argmax
        self._numpy_floats = (torch.float32, torch.float64, torch.float16)
        seed = check_seed(seed)
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def choose(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            if logits.device.type == "cpu" and logits.dtype in self._numpy_floats:
                # numpy's argmax: the same index (the first maximum; a NaN wins), ~5 us a
                # 49k-entry row where torch's took ~75 on one thread
                return int(self._argmax(logits.detach().numpy()))
            return int(logits.argmax())
        return draw(warp_probs(logits, self.params), self.generator)

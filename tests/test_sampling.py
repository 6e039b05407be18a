"""The warpers against brute-force definitions, and the draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dartcore.sampling import Sampler, SamplingParams, draw, warp_probs


def brute_warp(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """HF semantics: temperature, keep the top_k largest (ties at the k-th kept),
    then the smallest prefix of the sorted distribution whose mass reaches top_p."""
    s = logits.astype(np.float64) / temperature
    keep = np.ones(len(s), dtype=bool)
    if 0 < top_k < len(s):
        kth = np.sort(s)[::-1][top_k - 1]
        keep &= s >= kth
    p = np.where(keep, np.exp(s - s[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass = 0.0
        kept = np.zeros(len(s), dtype=bool)
        for idx in order:
            if mass >= top_p:
                break
            kept[idx] = True
            mass += p[idx]
        p = np.where(kept, p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 10, 0.5), (2.0, 1, 1.0), (1.0, 0, 0.01)],
)
def test_warpers_match_brute_force(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=30) * 3
        got = warp_probs(
            torch.tensor(logits, dtype=torch.float32), SamplingParams(temperature, top_p, top_k)
        )
        want = brute_warp(logits, temperature, top_k, top_p)
        assert np.allclose(got.numpy(), want, atol=1e-5)


def test_bad_params():
    for kw in (
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
    for kw in (
        {"temperature": True},
        {"temperature": "0.5"},
        {"top_p": None},
        {"top_k": 1.5},
        {"top_k": True},
    ):
        with pytest.raises(TypeError, match=next(iter(kw))):
            SamplingParams(**kw)


def test_draw_frequencies_and_one_uniform_per_token():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    g = torch.Generator().manual_seed(0)
    counts = np.bincount([draw(probs, g) for _ in range(20000)], minlength=4)
    assert counts[1] == 0
    # binomial 5-sigma bounds
    for i, p in enumerate([0.1, 0.0, 0.6, 0.3]):
        assert abs(counts[i] - 20000 * p) <= 5 * np.sqrt(20000 * p * (1 - p)) + 1e-9
    # exactly one uniform consumed per draw: the generator state matches torch.rand
    g1 = torch.Generator().manual_seed(5)
    g2 = torch.Generator().manual_seed(5)
    draw(probs, g1)
    torch.rand((), dtype=torch.float64, generator=g2)
    assert torch.rand(1, generator=g1).item() == torch.rand(1, generator=g2).item()


def test_greedy_sampler_is_argmax():
    s = Sampler(SamplingParams(0.0, top_p=0.5, top_k=3), seed=1)
    x = torch.tensor([0.1, 3.0, -2.0, 2.9])
    assert s.choose(x) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_greedy_choice_is_torchs_argmax_on_ties_infinities_and_nans(dtype):
    s = Sampler(SamplingParams(0.0), seed=1)
    nan, inf = float("nan"), float("inf")
    rows = [[2.0, 5.0, 5.0, 1.0], [1.0, nan, 3.0, nan], [-inf, -inf, -inf], [inf, 1.0, inf], [0.5]]
    for row in rows:
        x = torch.tensor(row, dtype=dtype)
        assert s.choose(x) == int(torch.argmax(x)), row
    big = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0)).to(dtype)
    for r in big:  # strided rows of a logits matrix, as the verification reads them
        assert s.choose(r) == int(torch.argmax(r))
    assert s.choose(big[:, 7]) == int(torch.argmax(big[:, 7]))

"""Sampling is lossless: on a tiny 8-token model, the joint distribution of the
first three sampled tokens (512 cells) under DART tree verification matches the
exact target distribution, computed by brute force from the Hugging Face model
(and the independent numpy warpers of test_sampling.py), and so does the AR
sampler's.

Statistical test: Pearson chi-square goodness of fit over the 512 cells, cells
with expected count < 5 pooled into one, p-value from the chi-square survival
function; reject at p < 1e-3. Three such tests run here, so the false-alarm
rate of this file is at most 3e-3 (Bonferroni) over the choice of seeds; the
seeds are fixed, so the outcome is deterministic.

Because every committed token costs exactly one uniform from the generator, a
DART run and an AR run with the same seed produce the same tokens unless a
uniform lands within float noise of a CDF boundary: checked for >= 99% of seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore import DartDecoder
from dartcore.trees import register_tree_builder
from test_decoder import CharTokenizer, random_tree
from test_sampling import brute_warp

torch.set_num_threads(1)

VOCAB = 8
PROMPT = [1, 3, 4]
ALPHA = 1e-3


@dataclass
class RandomTrees:
    """Random trees over the 8-token vocabulary from their own RNG (never the
    target's draws): dense enough that many drafted tokens get accepted."""

    seed: int = 0
    nodes: int = 14
    depth: int = 3
    max_nodes: int = 14
    needs_drafter: bool = False
    needs_hidden: bool = False
    needs_index: bool = False

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, inputs):
        return random_tree(self.rng, int(inputs.context[-1]), VOCAB, self.nodes, self.depth)


register_tree_builder("test-random-small", lambda **kw: RandomTrees(**kw), replace=True)


def exact_joint(model, temperature, top_k, top_p) -> np.ndarray:
    """p(x1, x2, x3 | PROMPT) after the warpers, by brute force: [8, 8, 8]."""
    seqs = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    with torch.no_grad():
        logits = model(seqs).logits.double().numpy()
    n = len(PROMPT)
    p1 = brute_warp(logits[0, n - 1], temperature, top_k, top_p)
    joint = np.zeros((VOCAB,) * 3)
    for a in range(VOCAB):
        p2 = brute_warp(logits[a * VOCAB, n], temperature, top_k, top_p)
        for b in range(VOCAB):
            p3 = brute_warp(logits[a * VOCAB + b, n + 1], temperature, top_k, top_p)
            joint[a, b] = p1[a] * p2[b] * p3
    return joint


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    counts = counts.reshape(-1).astype(np.float64)
    expected = probs.reshape(-1) * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    assert np.all(obs[exp == 0] == 0) if np.any(exp == 0) else True
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def sample_counts(decoder, seeds, **kw):
    counts = np.zeros((VOCAB,) * 3, dtype=np.int64)
    outs = []
    rounds = committed = 0
    for s in seeds:
        res = decoder.generate(PROMPT, max_new_tokens=3, seed=s, **kw)
        assert len(res.tokens) == 3
        counts[tuple(res.tokens)] += 1
        outs.append(res.tokens)
        rounds += res.stats.rounds
        committed += sum((a + 1) * c for a, c in enumerate(res.stats.accept_hist))
    return counts, outs, committed / max(rounds, 1)


@pytest.mark.parametrize("temperature,top_k,top_p,n", [(1.0, 0, 1.0, 1000), (0.8, 5, 0.9, 600)])
def test_sampled_distribution_matches_target(temperature, top_k, top_p, n):
    model = tiny_model("llama", vocab_size=VOCAB, seed=1)
    exact = exact_joint(model, temperature, top_k, top_p)
    assert abs(exact.sum() - 1) < 1e-9
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    dart = DartDecoder(model, CharTokenizer(), tree="test-random-small", eos_token_ids=())
    counts, dart_out, tau = sample_counts(dart, range(n), **kw)
    assert tau > 1.1, "random trees should get drafted tokens accepted (measured ~1.2)"
    assert chi_square_p(counts, exact) > ALPHA
    if top_k == 0:
        ar = DartDecoder(model, CharTokenizer(), tree="ar", eos_token_ids=())
        ar_counts, ar_out, ar_tau = sample_counts(ar, range(n), **kw)
        assert ar_tau == 1.0
        assert chi_square_p(ar_counts, exact) > ALPHA
        same = sum(a == b for a, b in zip(dart_out, ar_out))
        assert same >= 0.99 * n
    # tokens outside the warped support never appear
    assert np.all(counts[exact == 0] == 0)

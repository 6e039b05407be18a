"""Sampling stays lossless per sequence in a batch: the batch-1 statistical test of
test_decoder_sampling.py (the joint distribution of the first three sampled tokens on an
8-token model against the exact one by brute force, Pearson chi-square, reject at
p < 1e-3) run on sequences decoded 16 at a time by the engine, requests joining as others
leave. One uniform per committed token: a batched run and a batch-1 run with the same
seed give the same tokens but for float-noise boundary cases (>= 99% of seeds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import test_decoder_sampling  # noqa: F401 -- registers the test-random-small builder
from conftest import tiny_model
from dartcore import DartDecoder
from dartcore.engine import Engine, SamplingParams
from test_decoder import CharTokenizer
from test_decoder_sampling import ALPHA, PROMPT, VOCAB, chi_square_p, exact_joint

torch.set_num_threads(1)


@pytest.mark.parametrize("temperature,top_k,top_p,n", [(1.0, 0, 1.0, 1000), (0.8, 5, 0.9, 600)])
def test_batched_sampling_matches_target(temperature, top_k, top_p, n):
    model = tiny_model("llama", vocab_size=VOCAB, seed=1)
    exact = exact_joint(model, temperature, top_k, top_p)
    dec = DartDecoder(model, CharTokenizer(), tree="test-random-small", eos_token_ids=())
    engine = Engine(dec, max_batch=16, max_seq_len=32, budget=14)
    ids = {
        engine.add_request(
            PROMPT,
            SamplingParams(
                max_new_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p, seed=s
            ),
        ): s
        for s in range(n)
    }
    tokens: dict[int, list[int]] = {}
    rounds = committed = 0
    max_running = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[ids[out.request_id]] = out.tokens
                rounds += out.stats["rounds"]
                committed += sum((a + 1) * c for a, c in enumerate(out.stats["accept_hist"]))
        max_running = max(max_running, engine.num_running())
    assert max_running == 16 and len(tokens) == n
    counts = np.zeros((VOCAB,) * 3, dtype=np.int64)
    for t in tokens.values():
        assert len(t) == 3
        counts[tuple(t)] += 1
    assert committed / rounds > 1.1, "random trees get drafted tokens accepted"
    assert chi_square_p(counts, exact) > ALPHA
    assert np.all(counts[exact == 0] == 0)
    if top_k == 0:
        single = [
            dec.generate(PROMPT, max_new_tokens=3, seed=s, temperature=temperature).tokens
            for s in range(n)
        ]
        assert sum(single[s] == tokens[s] for s in range(n)) >= 0.99 * n

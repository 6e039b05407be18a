"""DARTree / hybrid / DDTree trees through DartDecoder: greedy output is exactly the
target's (reference: Hugging Face ``generate(do_sample=False)``), and trees do get accepted."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore import DartDecoder
from dartcore.dartree.head import CorrectionHead
from dartcore.errors import TreeError


class _Tok:
    eos_token_id = 2

    def __call__(self, text):
        return {"input_ids": [1] + [ord(c) % 61 + 3 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


class _CountIndex:
    """Brute-force trigram model with the index's ``cond_probs`` signature."""

    def __init__(self, text):
        self.c3 = Counter(zip(text, text[1:], text[2:]))
        self.c2 = Counter(zip(text, text[1:]))
        self.c1 = Counter(text)
        self.n = len(text)

    def cond_probs(self, context, candidates_sorted, unigram_backoff=True):
        out = []
        for v in candidates_sorted.tolist():
            ctx = tuple(context[-2:])
            if len(ctx) == 2 and self.c3[ctx + (v,)]:
                tot = sum(c for k, c in self.c3.items() if k[:2] == ctx)
                out.append(self.c3[ctx + (v,)] / tot)
            elif ctx and self.c2[(ctx[-1], v)]:
                tot = sum(c for k, c in self.c2.items() if k[0] == ctx[-1])
                out.append(self.c2[(ctx[-1], v)] / tot)
            else:
                out.append(self.c1[v] / self.n if unigram_backoff else 0.0)
        return np.asarray(out)


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def setup():
    from dartcore.drafter import DartDrafter

    model = tiny_model("llama", layers=6)
    model.generation_config.eos_token_id = None
    torch.manual_seed(0)
    drafter = DartDrafter.from_target(model, d=4).eval()
    torch.manual_seed(1)
    head = CorrectionHead(drafter.config.hidden_size, 32, rank=16)
    with torch.no_grad():
        head.down.weight.normal_(std=0.3)
    rng = np.random.default_rng(3)
    prompts = [[1] + rng.integers(3, 64, size=int(rng.integers(2, 20))).tolist() for _ in range(3)]
    refs = [_hf_greedy(model, p, 20) for p in prompts]
    return model, drafter, head.eval(), prompts, refs


@pytest.mark.parametrize(
    "tree,params",
    [
        ("dartree", {"max_nodes": 24}),
        ("dartree", {"head": "untrained", "max_nodes": 8, "width": 3, "k": 16}),
        ("hybrid", {"max_nodes": 24}),
        ("ddtree", {"max_nodes": 24}),
    ],
)
def test_greedy_output_is_the_targets(setup, tree, params):
    model, drafter, head, prompts, refs = setup
    if tree in ("dartree", "hybrid") and "head" not in params:
        params = {**params, "head": head}
    index = (
        _CountIndex([int(t) for p, r in zip(prompts, refs) for t in p + r])
        if tree == "hybrid"
        else None
    )
    dec = DartDecoder(model, _Tok(), drafter, index, tree=tree, **params)
    dec.eos_token_ids = ()
    accepted = 0
    for prompt, ref in zip(prompts, refs):
        res = dec.generate(prompt, max_new_tokens=20)
        assert res.tokens == ref
        accepted += sum(a * c for a, c in enumerate(res.stats.accept_hist))
    assert accepted > 0, "no drafted token was ever accepted: the test would prove nothing"


def test_builder_parameters_are_checked(setup):
    model, drafter, head, _, _ = setup
    with pytest.raises(TreeError):
        DartDecoder(model, _Tok(), drafter, tree="dartree", beta=0.5, head=head)
    with pytest.raises(ValueError):
        DartDecoder(model, _Tok(), drafter, tree="dartree", ngram_weight=0.5)
    with pytest.raises(ValueError):
        DartDecoder(model, _Tok(), drafter, tree="dartree", widht=3)
    with pytest.raises(ValueError):  # hybrid needs the index
        DartDecoder(model, _Tok(), drafter, tree="hybrid", head=head)
    wrong = CorrectionHead(drafter.config.hidden_size + 1, 32, rank=4)
    dec = DartDecoder(model, _Tok(), drafter, tree="dartree", head=wrong)
    from dartcore.errors import DrafterMismatchError

    with pytest.raises(DrafterMismatchError):
        dec.generate([1, 5, 6], max_new_tokens=3)

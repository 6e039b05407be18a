"""DARTree on the real SmolLM2-135M-Instruct with the built-in drafter and correction head:
greedy output equals Hugging Face greedy decoding, and the built-in head is picked up by
default and fits the drafter."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def drafter(request):
    from dartcore.drafter import BUILTIN_DRAFTERS, DartDrafter

    if not (BUILTIN_DRAFTERS["smollm2"] / "config.json").is_file():
        pytest.skip("the built-in SmolLM2 drafter is not in this checkout")
    model, tok = request.getfixturevalue("smollm2")
    return DartDrafter.from_pretrained("smollm2", model, tokenizer=tok)


def test_builtin_head_fits_the_builtin_drafter(drafter):
    from dartcore.dartree.builders import resolve_head

    head = resolve_head(None, drafter)
    assert head.hidden_size == drafter.config.hidden_size
    assert head.num_parameters() < 5_000_000 // 4  # ≤ 5 MB in fp32


@pytest.mark.parametrize("tree", ["dartree", "ddtree"])
def test_greedy_equals_hf_on_smollm2(smollm2, drafter, tree):
    from dartcore import DartDecoder

    model, tok = smollm2
    msgs = [
        {
            "role": "user",
            "content": "Natalia sold clips to 48 of her friends in April, and then she sold "
            "half as many clips in May. How many clips did she sell altogether?",
        }
    ]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    x = torch.tensor([ids])
    ref = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=40,
        do_sample=False,
        pad_token_id=tok.eos_token_id,
    )[0, len(ids) :].tolist()
    dec = DartDecoder(model, tok, drafter, tree=tree)
    res = dec.generate(ids, max_new_tokens=40)
    assert res.tokens == ref
    assert res.stats.tau >= 1.0

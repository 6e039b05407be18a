"""Real-model batched decoding (slow): SmolLM2-135M-Instruct, fp32, the shipped drafter
(or an untrained one), an index of the shipped target responses, five eval prompts of
different lengths decoded together by the engine -- fixed budget and the controller --
each identical to its own batch-1 ``DartDecoder.generate`` greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

torch.set_num_threads(1)  # the shared 2-core box: see test_decoder_smollm2.py

MAX_NEW = 32
RESPONSES = (
    Path(__file__).resolve().parents[1]
    / "python"
    / "dartcore"
    / "assets"
    / "corpus"
    / "smollm2_responses.jsonl.gz"
)


@pytest.fixture(scope="module")
def decoder(smollm2, tmp_path_factory):
    import numpy as np

    from dartcore import DartDecoder
    from dartcore.drafter import DartDrafter
    from dartcore.index import NgramIndex, build_index
    from dartcore.tokenizers import fingerprint
    from dartcore.training.data import read_documents

    model, tok = smollm2
    try:
        drafter = DartDrafter.from_pretrained("smollm2", model, tokenizer=tok)
    except FileNotFoundError:
        drafter = DartDrafter.from_target(model, d=8)
    docs = [
        np.asarray(tok(d.messages[-1]["content"])["input_ids"] + [tok.eos_token_id], dtype=np.int64)
        for d in read_documents(RESPONSES)[:600]
        if d.messages and d.messages[-1]["role"] == "assistant"
    ]
    path = tmp_path_factory.mktemp("smollm2-batch-index") / "responses.idx"
    build_index(
        docs,
        path,
        vocab_size=len(tok),
        metadata={"tokenizer": {"name": "smollm2", "fingerprint": fingerprint(tok)}},
    )
    return DartDecoder(model, tok, drafter, NgramIndex(path), tree="dart")


def test_batched_greedy_equals_batch1(smollm2, test_data, decoder, tmp_path, monkeypatch):
    from dartcore.benchmark.datasets import load_prompts

    monkeypatch.setenv("DARTCORE_CACHE", str(tmp_path))  # the cost curve of this test only
    _, tok = smollm2
    prompts = []
    for name, k in (("humaneval", 2), ("gsm8k", 2), ("code_alpaca", 1)):
        for messages in load_prompts(name, k, test_data):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert max(map(len, prompts)) > 2 * min(map(len, prompts))
    single = [decoder.generate(p, max_new_tokens=MAX_NEW) for p in prompts]
    for budget in (None, "adaptive"):
        batch = decoder.generate_batch(prompts, max_new_tokens=MAX_NEW, budget=budget)
        assert [r.tokens for r in batch] == [r.tokens for r in single], budget
    assert sum(r.stats.tau for r in single) / len(single) > 1.2

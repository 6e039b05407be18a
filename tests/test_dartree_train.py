"""Training the correction head: the cached examples are what the decoder's drafter calls
produce (recomputed independently from scratch per anchor), and training lowers the loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore.dartree.head import CorrectionHead
from dartcore.dartree.train import HeadTrainConfig, collect_examples, evaluate_head, train_head


@pytest.fixture(scope="module")
def setup():
    from dartcore.drafter import DartDrafter

    target = tiny_model("llama", layers=6)
    torch.manual_seed(0)
    drafter = DartDrafter.from_target(target, d=4).eval()
    rng = np.random.default_rng(0)
    docs = []
    for n in (20, 27, 9):
        ids = rng.integers(3, 64, n)
        respond = np.zeros(n, dtype=bool)
        respond[n // 3 :] = True
        docs.append((ids, respond))
    return target, drafter, docs


def test_collected_examples_match_fresh_drafter_calls(setup):
    target, drafter, docs = setup
    k = 8
    ex = collect_examples(target, drafter, docs[:1], k=k, stride=2)
    ids, respond = docs[0]
    n = len(ids)
    anchors = [p for p in range(n - 1) if respond[p + 1]][::2]
    with torch.no_grad():
        out = target(input_ids=torch.as_tensor(ids)[None], output_hidden_states=True)
        taps = torch.cat([out.hidden_states[t][0] for t in drafter.taps], -1)
        probs = torch.softmax(out.logits[0].float(), -1)
    row = 0
    for p in anchors:
        state = drafter.new_state(n)
        logits, hidden = drafter.draft(
            state, taps[: p + 1], torch.as_tensor(ids[1 : p + 2]), return_hidden=True
        )
        for j in range(min(drafter.d, n - 1 - p)):
            vals, cand = torch.topk(logits[j], k)
            assert ex.depth[row] == j
            assert ex.parent[row] == ids[p + 1 + j]
            assert torch.equal(ex.cand[row], cand)
            torch.testing.assert_close(ex.base[row], vals, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ex.hidden[row].float(), hidden[j], atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(
                ex.teacher[row], probs[p + 1 + j][cand], atol=1e-5, rtol=1e-4
            )
            am = int(probs[p + 1 + j].argmax())
            want = int((cand == am).nonzero()[0]) if (cand == am).any() else -1
            assert ex.argmax_pos[row] == want
            row += 1
    assert row == len(ex)


def test_training_lowers_the_candidate_loss(setup):
    target, drafter, docs = setup
    ex = collect_examples(target, drafter, docs, k=16, stride=1)
    embed = drafter.embed
    torch.manual_seed(0)
    head = CorrectionHead(drafter.config.hidden_size, 32, rank=32)
    before = evaluate_head(head, embed, ex, drafter.d)
    cfg = HeadTrainConfig(
        rank=32, lr=3e-3, batch_size=64, max_steps=150, warmup_steps=5, eval_every=1000
    )
    train_head(head, embed, ex, cfg, d=drafter.d)
    after = evaluate_head(head, embed, ex, drafter.d)
    # An untrained head is the renormalised marginal: both metrics start equal.
    np.testing.assert_allclose(before["ce_head"], before["ce_base"], rtol=1e-5)
    assert np.mean(after["ce_head"]) < 0.9 * np.mean(before["ce_head"])
    assert after["hit1_head_mean"] >= before["hit1_head_mean"]


def test_drafter_fingerprint_survives_fp16_export(setup, tmp_path):
    from dartcore.dartree.train import drafter_fingerprint
    from dartcore.drafter import DartDrafter

    target, drafter, _ = setup
    drafter.save_pretrained(tmp_path / "fp16", dtype=torch.float16)
    again = DartDrafter.from_pretrained(tmp_path / "fp16", target)
    assert drafter_fingerprint(again) == drafter_fingerprint(drafter)
    other = DartDrafter.from_target(target, d=4)
    assert drafter_fingerprint(other) != drafter_fingerprint(drafter)

"""dart-train pieces: the prefix-shared mask against a brute-force construction, leakage,
the loss gradient, packing, anchors and teacher targets, evaluation against plain drafting,
checkpoint/resume."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore.drafter import DartDrafter
from dartcore.errors import DartError
from dartcore.training.data import pack_documents
from dartcore.training.forward import train_forward
from dartcore.training.loss import gamma_kl_loss, teacher_logprobs
from dartcore.training.mask import (
    brute_force_mask,
    build_layout,
    dense_mask,
    prefix_shared_attention,
)
from dartcore.training.trainer import (
    EvalSet,
    TrainConfig,
    Trainer,
    build_draft_vocab,
    evaluate,
    group_targets,
    make_batch,
    next_tokens_of,
    sample_anchors,
    teacher_forward,
)

# -- mask -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_dense_mask_equals_brute_force(seed):
    rng = random.Random(seed)
    N, d = rng.randint(4, 14), rng.randint(2, 5)
    cuts = sorted(rng.sample(range(1, N), rng.randint(0, 2)))
    doc = [sum(i >= c for c in cuts) for i in range(N)]
    A = rng.randint(1, 5)
    anchors = [rng.randrange(N) for _ in range(A)]
    full = brute_force_mask(anchors, doc, d)
    layout = build_layout(torch.tensor([anchors]), torch.tensor([doc]), torch.arange(N)[None], d)
    got = dense_mask(layout)[0]
    want = full[layout.query_rows[0]]
    assert torch.equal(got, want)
    # the query rows are the anchors' clean rows followed by their MASK rows
    q = layout.query_rows[0].view(A, d)
    assert q[:, 0].tolist() == anchors
    assert q[:, 1:].flatten().tolist() == list(range(N, N + A * (d - 1)))
    # positions of MASK j of anchor t are t + j
    pos = layout.positions[0]
    for a, t in enumerate(anchors):
        assert pos[q[a, 1:]].tolist() == [t + j for j in range(1, d)]


def test_brute_force_mask_spot_checks():
    # two docs [0,0,0 | 1,1], anchors 1 and 3, d = 3
    m = brute_force_mask([1, 3], [0, 0, 0, 1, 1], 3)
    # clean rows: causal inside the document
    assert m[2, :5].tolist() == [True, True, True, False, False]
    assert m[4, :5].tolist() == [False, False, False, True, True]
    assert not m[:5, 5:].any()  # clean rows never see MASK rows
    # group of anchor 1 (rows 5, 6): clean 0..1, then causal inside the group
    assert m[5].tolist() == [True, True, False, False, False, True, False, False, False]
    assert m[6].tolist() == [True, True, False, False, False, True, True, False, False]
    # group of anchor 3 (rows 7, 8): only its own document up to 3
    assert m[8].tolist() == [False, False, False, True, False, False, False, True, True]


def test_chunked_dense_attention_equals_single_chunk(monkeypatch):
    import dartcore.training.mask as mask_mod

    target = tiny_model("llama", layers=6)
    dr = DartDrafter.from_target(target, d=4)
    torch.manual_seed(0)
    N = 30
    taps = torch.randn(2, N, 96)
    nxt = torch.randint(0, 64, (2, N))
    anchors = torch.randint(0, N - 1, (2, 9))
    with torch.no_grad():
        ref = train_forward(dr, taps, nxt, anchors)
        monkeypatch.setattr(mask_mod, "_DENSE_CHUNK", 5)
        got = train_forward(dr, taps, nxt, anchors)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention path needs CUDA")
def test_flex_attention_equals_dense_on_cuda():
    target = tiny_model("qwen3", layers=6).cuda()
    dr = DartDrafter.from_target(target, d=4).cuda()
    torch.manual_seed(0)
    N = 200
    taps = torch.randn(2, N, 96, device="cuda")
    nxt = torch.randint(0, 64, (2, N), device="cuda")
    anchors = torch.randint(0, N - 1, (2, 40), device="cuda")
    doc = (torch.arange(N, device="cuda") >= 120).long().expand(2, N)
    with torch.no_grad():
        a = train_forward(dr, taps, nxt, anchors, doc_ids=doc, backend="flex")
        b = train_forward(dr, taps, nxt, anchors, doc_ids=doc, backend="dense")
    torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


def test_flex_block_mask_equals_dense_mask_on_cpu():
    """The FlexAttention block mask of the training path, run through torch's (eager, CPU)
    FlexAttention, attends exactly where the dense mask does: two documents, random anchors,
    padding groups, GQA-free heads."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from dartcore.training.mask import _flex_block_mask

    torch.manual_seed(0)
    B, N, d, A, H, hd = 2, 40, 4, 9, 2, 16
    doc = (torch.arange(N) >= 25).long().expand(B, N)
    anchors = torch.randint(0, N - 1, (B, A))
    anchors[1, -2:] = -1  # padding groups
    layout = build_layout(anchors, doc, torch.arange(N).expand(B, N), d)
    R = layout.positions.shape[1]
    q, k, v = torch.randn(B, H, A * d, hd), torch.randn(B, H, R, hd), torch.randn(B, H, R, hd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        got = flex_attention(q, k, v, block_mask=_flex_block_mask(layout, H))
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_mask(layout)[:, None]
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_flex_backend_refused_on_cpu():
    layout = build_layout(
        torch.tensor([[1]]), torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], 2
    )
    with pytest.raises(RuntimeError, match="CUDA"):
        prefix_shared_attention(None, torch.zeros(1, 1, 2, 4), None, None, layout, backend="flex")


# -- leakage ----------------------------------------------------------------------------


def _pipeline(target, dr, ids, doc, anchors):
    """Teacher taps on the packed clean sequence -> training forward (group logits)."""
    pos = torch.cat([torch.arange(int((doc == k).sum())) for k in doc.unique()])
    seq = make_batch([_packed(ids.numpy(), pos.numpy(), doc.numpy())])
    taps, _ = teacher_forward(target, seq, dr.taps)
    with torch.no_grad():
        return train_forward(
            dr,
            taps,
            next_tokens_of(seq),
            anchors[None],
            doc_ids=seq.doc_ids,
            position_ids=seq.position_ids,
        )[0]


def _packed(ids, pos, doc):
    from dartcore.training.data import PackedSequence

    end = np.array([np.nonzero(doc == doc[i])[0].max() for i in range(len(ids))])
    return PackedSequence(ids, pos, doc, np.ones(len(ids), bool), end)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_leakage(family):
    """Group t reads tokens x_0..x_{t+1} of its own document (x_{t+1} is the token the target
    already chose, the row's input): changing any later token, or any token of another packed
    document, leaves its logits unchanged; changing x_s for s <= t+1 changes them."""
    target = tiny_model(family, layers=6)
    dr = DartDrafter.from_target(target, d=4)
    torch.manual_seed(0)
    N = 20
    ids = torch.randint(3, 64, (N,))
    doc = (torch.arange(N) >= 14).long()  # documents [0, 14) and [14, 20)
    anchors = torch.tensor([2, 7, 12, 16])
    base = _pipeline(target, dr, ids, doc, anchors)
    for s in range(N):
        changed = ids.clone()
        changed[s] = (ids[s] + 17) % 61 + 3
        out = _pipeline(target, dr, changed, doc, anchors)
        for a, t in enumerate(anchors.tolist()):
            same_doc = doc[s] == doc[t]
            visible = bool(same_doc and s <= t + 1)
            diff = (out[a] - base[a]).abs().max().item()
            if visible:
                assert diff > 1e-6, (s, t)
            else:
                assert diff == 0.0, (s, t, diff)


def test_teacher_isolates_packed_documents():
    target = tiny_model("qwen3", layers=6)
    torch.manual_seed(0)
    a, b = torch.randint(3, 64, (9,)), torch.randint(3, 64, (7,))
    ids = torch.cat((a, b))
    doc = torch.cat((torch.zeros(9), torch.ones(7))).long()
    pos = torch.cat((torch.arange(9), torch.arange(7)))
    taps, logits = teacher_forward(
        target, make_batch([_packed(ids.numpy(), pos.numpy(), doc.numpy())]), (2, 3, 4)
    )
    with torch.no_grad():
        ob = target(b[None], output_hidden_states=True)
    torch.testing.assert_close(logits[0, 9:], ob.logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(taps[0, 9:, :32], ob.hidden_states[2][0], atol=1e-4, rtol=1e-4)
    # restricted head: the same columns of the full logits
    cols = torch.tensor([0, 5, 63])
    _, sub = teacher_forward(
        target, make_batch([_packed(ids.numpy(), pos.numpy(), doc.numpy())]), (2, 3, 4), cols
    )
    torch.testing.assert_close(sub, logits[..., cols], atol=1e-5, rtol=1e-5)


# -- loss -------------------------------------------------------------------------------


def test_loss_gradient_is_gamma_k_times_p_minus_q():
    torch.manual_seed(0)
    d, V, gamma = 4, 7, 0.6
    logits = torch.randn(2, 3, d, V, requires_grad=True)
    logq = torch.log_softmax(torch.randn(2, 3, d, V), -1)
    valid = torch.rand(2, 3, d) > 0.3
    loss, _ = gamma_kl_loss(logits, logq, valid, gamma=gamma, reduction="sum")
    loss.backward()
    p = torch.softmax(logits.detach(), -1)
    q = logq.exp()
    for b in range(2):
        for a in range(3):
            for k in range(d):
                want = gamma**k * (p[b, a, k] - q[b, a, k]) if valid[b, a, k] else torch.zeros(V)
                torch.testing.assert_close(logits.grad[b, a, k], want, atol=1e-6, rtol=1e-5)
    # and the value is sum_k gamma^k KL(q || p) by the definition
    ref = sum(
        gamma**k
        * sum(float(q[b, a, k, v] * (logq[b, a, k, v] - p[b, a, k, v].log())) for v in range(V))
        for b in range(2)
        for a in range(3)
        for k in range(d)
        if valid[b, a, k]
    )
    assert abs(loss.item() - ref) < 1e-4


def test_loss_mean_reduction_and_teacher_renormalisation():
    torch.manual_seed(1)
    logits = torch.randn(1, 2, 3, 5)
    logq = torch.log_softmax(torch.randn(1, 2, 3, 5), -1)
    valid = torch.tensor([[[True, True, False], [False, False, False]]])
    s, _ = gamma_kl_loss(logits, logq, valid, reduction="sum")
    m, _ = gamma_kl_loss(logits, logq, valid, reduction="mean")
    assert abs(m.item() - s.item()) < 1e-6  # one group with valid predictions
    target_logits = torch.randn(4, 10)
    ids = torch.tensor([1, 4, 7])
    want = torch.softmax(target_logits[:, ids], -1)
    torch.testing.assert_close(teacher_logprobs(target_logits, ids).exp(), want)


# -- data, anchors, targets -------------------------------------------------------------


def test_pack_documents():
    docs = [
        (np.arange(10, 16), np.array([0, 0, 1, 1, 1, 1], bool)),
        (np.arange(20, 24), np.array([0, 1, 1, 1], bool)),
        (np.arange(30, 39), np.array([0] * 3 + [1] * 6, bool)),
        (np.arange(40, 43), np.zeros(3, bool)),
    ]  # no response: dropped
    seqs = pack_documents(docs, 12, pad_id=0)
    assert len(seqs) == 2
    s = seqs[0]
    assert s.input_ids.tolist() == list(range(10, 16)) + list(range(20, 24)) + [0, 0]
    assert s.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1]
    assert s.doc_ids.tolist() == [0] * 6 + [1] * 4 + [2, 2]
    # t is an anchor iff x_{t+1} is a response token of the same document
    assert s.anchor_ok.tolist() == [
        False,
        True,
        True,
        True,
        True,
        False,
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    assert s.doc_end.tolist() == [5] * 6 + [9] * 4 + [11, 11]
    assert seqs[1].input_ids[:9].tolist() == list(range(30, 39))


def test_sample_anchors_and_group_targets():
    ok = torch.zeros(2, 30, dtype=torch.bool)
    ok[0, 5:25] = True
    ok[1, [3, 8]] = True
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(ok, 6, g)
    assert a.shape == (2, 6)
    assert set(a[0].tolist()) <= set(range(5, 25)) and len(set(a[0].tolist())) == 6
    assert a[0].tolist() == sorted(a[0].tolist())
    assert a[1].tolist() == [3, 8, -1, -1, -1, -1]
    assert sample_anchors(ok, 0).shape == (2, 20)
    doc_end = torch.tensor([[29] * 30, [10] * 11 + [29] * 19])
    pos, valid = group_targets(a, doc_end, 4)
    for b in range(2):
        for i, t in enumerate(a[b].tolist()):
            for k in range(4):
                if t < 0:
                    assert not valid[b, i, k]
                else:
                    assert pos[b, i, k] == t + 1 + k
                    assert valid[b, i, k] == (t + 1 + k <= doc_end[b, t])


def test_build_draft_vocab():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 50, size=rng.integers(5, 40)) for _ in range(20)]
    counts = {}
    for arr in arrays:
        for x in arr.tolist():
            counts[x] = counts.get(x, 0) + 1
    ranked = sorted(range(50), key=lambda i: (-counts.get(i, 0), i))
    got = build_draft_vocab(arrays, 10, 50, always=[49])
    assert got.tolist() == sorted(set([49] + [i for i in ranked if i != 49][:9]))
    assert build_draft_vocab(arrays, 60, 50).tolist() == list(range(50))


# -- evaluation and the loop ------------------------------------------------------------


def _tiny_seqs(n, N=24, seed=0):
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        L = int(rng.integers(6, 14))
        base = rng.integers(3, 20)
        ids = (base + np.arange(L) * 3) % 60 + 3  # learnable arithmetic progressions
        resp = np.zeros(L, bool)
        resp[2:] = True
        docs.append((ids.astype(np.int64), resp))
    return pack_documents(docs, N)


def test_evaluate_matches_plain_drafting():
    target = tiny_model("llama", layers=6)
    dr = _random(target)
    seqs = _tiny_seqs(4)
    ev = EvalSet.build(target, seqs, dr.taps)
    res = evaluate(dr, ev)
    d = dr.d
    hit, cov, n = np.zeros(d), np.zeros(d), np.zeros(d)
    for s in seqs:  # reference: draft() per anchor on each document alone, full-precision taps
        for doc in np.unique(s.doc_ids):
            idx = np.nonzero(s.doc_ids == doc)[0]
            ids = torch.as_tensor(s.input_ids[idx])
            with torch.no_grad():
                out = target(ids[None], output_hidden_states=True)
            taps = torch.cat([out.hidden_states[t] for t in dr.taps], -1)[0]
            greedy = out.logits[0].argmax(-1)
            for t in range(len(idx) - 1):
                if not s.anchor_ok[idx[t]]:
                    continue
                logits = dr.draft(dr.new_state(64), taps[: t + 1], ids[1 : t + 2])
                top = dr.to_target_ids(logits.topk(10, -1).indices)
                for k in range(d):
                    if t + 1 + k < len(idx):
                        n[k] += 1
                        hit[k] += int(top[k, 0] == greedy[t + 1 + k])
                        cov[k] += int((top[k] == greedy[t + 1 + k]).any())
    assert res["count"] == n.tolist()
    # taps are cached in fp16 by EvalSet: allow a rare flipped near-tie
    assert np.allclose(res["hit1"], hit / n, atol=0.03)
    assert np.allclose(res["top10"], cov / n, atol=0.03)


def _random(target):
    torch.manual_seed(5)
    dr = DartDrafter.from_target(target, d=3, draft_vocab=list(range(0, 64, 2)))
    with torch.no_grad():
        for p in dr.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return dr


def _trainer(target, out, steps, seqs):
    torch.manual_seed(0)
    dr = DartDrafter.from_target(target, d=3, draft_vocab=list(range(64)))
    cfg = TrainConfig(
        ctx_len=24,
        batch_size=2,
        anchors_per_seq=6,
        d=3,
        lr=3e-3,
        warmup_steps=3,
        max_steps=steps,
        eval_every=0,
        checkpoint_every_minutes=1e9,
    )
    return Trainer(dr, target, seqs, cfg, out, progress=False)


def test_training_reduces_loss_and_resume_is_exact(tmp_path):
    target = tiny_model("qwen3", layers=6)
    seqs = _tiny_seqs(12)
    # uninterrupted: 8 steps
    full = _trainer(target, tmp_path / "full", 8, seqs)
    full.run()
    # interrupted after 4, resumed for 4 more
    part = _trainer(target, tmp_path / "part", 8, seqs)
    part.cfg.max_steps = 4
    part.run()
    resumed = _trainer(target, tmp_path / "part", 8, seqs)
    resumed.load_checkpoint()
    assert resumed.step == 4 and resumed.cursor == 8
    resumed.run()
    for (k, a), b in zip(full.drafter.state_dict().items(), resumed.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=k)
    # the exported drafter loads
    back = DartDrafter.from_pretrained(tmp_path / "full" / "drafter", target)
    assert back.config.d == 3
    # learning: a longer run lowers the loss
    long = _trainer(target, tmp_path / "long", 60, seqs)
    long.run()
    import json

    losses = [json.loads(line)["loss"] for line in open(tmp_path / "long" / "log.jsonl")]
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:5])


def test_with_draft_vocab_keeps_rows_and_starts_new_ids_from_the_target(tmp_path):
    target = tiny_model("qwen3", layers=6)
    dr = _random(target)  # draft vocabulary: the even ids
    head = target.get_output_embeddings().weight
    new = dr.with_draft_vocab([0, 1, 2, 3, 4, 9, 62], target)
    assert new.config.draft_vocab_size == 7 and new.draft_to_target.tolist() == [
        0,
        1,
        2,
        3,
        4,
        9,
        62,
    ]
    old_row = {t: i for i, t in enumerate(dr.draft_to_target.tolist())}
    for j, t in enumerate(new.draft_to_target.tolist()):
        expect = dr.lm_head.weight[old_row[t]] if t in old_row else head[t]
        assert torch.equal(new.lm_head.weight[j], expect.float())
    for name, p in dr.state_dict().items():
        if name not in ("lm_head.weight", "draft_to_target"):
            assert torch.equal(new.state_dict()[name], p), name
    # the same hidden state gives the same logits for the ids both vocabularies hold
    h = torch.randn(2, dr.config.hidden_size)
    a, b = dr.head(h), new.head(h)
    for j, t in enumerate(new.draft_to_target.tolist()):
        if t in old_row:
            assert torch.allclose(b[:, j], a[:, old_row[t]])
    # saved and loaded with its map; the full vocabulary needs no map
    new.save_pretrained(tmp_path / "d")
    again = DartDrafter.from_pretrained(tmp_path / "d", target)
    assert again.draft_to_target.tolist() == new.draft_to_target.tolist()
    full = dr.with_draft_vocab(range(target.config.vocab_size), target)
    assert (
        full.config.draft_vocab_size == target.config.vocab_size
        and "draft_to_target" not in full.state_dict()
    )
    for bad, msg in (([], "target ids"), ([1, 1], "duplicate"), ([0, 10_000], "target ids")):
        with pytest.raises(DartError, match=msg):
            dr.with_draft_vocab(bad, target)

"""DartDrafter: the decoder layer against the Hugging Face layer, incremental drafting vs one
call vs the training forward, save/load, target mismatch."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import tiny_model
from dartcore.drafter import DartDrafter, DrafterConfig
from dartcore.errors import DartError, DrafterMismatchError
from dartcore.tokenizers import fingerprint as tokenizer_fingerprint
from dartcore.training.forward import train_forward


class FakeTokenizer:
    def __init__(self, vocab):
        self._vocab = vocab

    def get_vocab(self):
        return dict(self._vocab)


def _taps(target, ids, taps):
    with torch.no_grad():
        out = target(ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[t] for t in taps], -1)[0]


def _random_drafter(target, **kw):
    torch.manual_seed(3)
    dr = DartDrafter.from_target(target, **kw)
    with torch.no_grad():  # not just the init: make every parameter matter
        for p in dr.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return dr.eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_layer_matches_hf_decoder_layer(family):
    """With the token half of q/k/v zeroed and the hidden norm set to the HF layer's input
    norm, our layer computes HF's decoder layer on g (rope, GQA, q/k-norm, SwiGLU)."""
    target = tiny_model(family, layers=6)
    dr = DartDrafter.from_target(target, d=4)
    hf = target.model.layers[1]
    H = target.config.hidden_size
    lay = dr.layer
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(lay, name).weight
            w.zero_()
            w[:, H:] = getattr(hf.self_attn, name).weight
        lay.o_proj.weight.copy_(hf.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(lay, name).weight.copy_(getattr(hf.mlp, name).weight)
        lay.post_attention_layernorm.weight.copy_(hf.post_attention_layernorm.weight)
        dr.hidden_norm.weight.copy_(hf.input_layernorm.weight)
        if family == "qwen3":
            lay.q_norm.weight.copy_(hf.self_attn.q_norm.weight)
            lay.k_norm.weight.copy_(hf.self_attn.k_norm.weight)
    T = 9
    torch.manual_seed(0)
    g = torch.randn(1, T, H)
    e = torch.randn(1, T, H)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        cos, sin = target.model.rotary_emb(g, pos)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
        want = hf(g, attention_mask=causal, position_ids=pos, position_embeddings=(cos, sin))
        want = want[0] if isinstance(want, tuple) else want
        rows = torch.cat((dr.emb_norm(e), dr.hidden_norm(g)), -1)
        c, s = dr.rope(pos[0])
        q, k, v = lay.q(rows, c, s), *lay.kv(rows, c, s)
        got = lay.mlp_block(g + lay.attend(q, k, v, causal[0, 0]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_incremental_draft_equals_one_call_and_training_forward(family):
    target = tiny_model(family, layers=6)
    dr = _random_drafter(target, d=4, draft_vocab=list(range(0, 64, 3)))
    torch.manual_seed(1)
    N = 23
    ids = torch.randint(3, 64, (N + 1,))
    taps = _taps(target, ids[:N], dr.taps)
    nxt = ids[1:]  # x_{i+1}; the last one plays the bonus token
    one = dr.draft(dr.new_state(64), taps, nxt)
    st = dr.new_state(64)
    for a, b in ((0, 5), (5, 6), (6, 17), (17, N)):
        inc, hid = dr.draft(st, taps[a:b], nxt[a:b], return_hidden=True)
    assert st.length == N
    assert one.shape == (4, 22) and hid.shape == (4, target.config.hidden_size)
    torch.testing.assert_close(inc, one, atol=1e-5, rtol=1e-5)
    # the training forward's group for anchor t equals drafting after positions 0..t
    anchors = torch.tensor([[N - 1, 4, 11]])
    with torch.no_grad():
        train = train_forward(dr, taps[None], nxt[None], anchors)
    torch.testing.assert_close(train[0, 0], one, atol=1e-5, rtol=1e-5)
    for a, t in ((1, 4), (2, 11)):
        ref = dr.draft(dr.new_state(64), taps[: t + 1], nxt[: t + 1])
        torch.testing.assert_close(train[0, a], ref, atol=1e-5, rtol=1e-5)


def _torch_product(w, b):
    """A fused projection's product in torch: the native layer ops run on any CPU, the
    native small-batch kernel only with AVX-512F or AVX2 + FMA + F16C."""
    return lambda x: torch.nn.functional.linear(x, w, b)


NATIVE_PRODUCTS = pytest.param(
    "native",
    marks=pytest.mark.skipif(
        not __import__("dartcore.kernels.linear", fromlist=["x"]).native_linear_available(),
        reason="the native kernels need AVX-512F or AVX2 + FMA + F16C",
    ),
)


@pytest.mark.parametrize("products", [NATIVE_PRODUCTS, "torch"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_native_draft_equals_the_torch_draft(family, products):
    # The decoder's native CPU backend drafts through NativeDraft: blocks of <= 16 rows
    # through the native layer ops, longer ones (the prompt) through the drafter's torch path.
    from dartcore.kernels.native_draft import NativeDraft

    target = tiny_model(family, layers=6)
    ref = _random_drafter(target, d=4, draft_vocab=list(range(0, 64, 3)))
    dr = _random_drafter(target, d=4, draft_vocab=list(range(0, 64, 3)))
    with torch.no_grad():  # fp16-exact weights, as shipped: the native products stream them as fp16
        for a, b in zip(ref.parameters(), dr.parameters()):
            a.copy_(a.half().float()), b.copy_(a)
    if products == "native":
        nat = NativeDraft.adopt(dr, threads=1)
        assert nat is not None
    else:
        nat = NativeDraft(dr, threads=1, product=_torch_product)
    native_blocks = []
    inner = nat.block

    def counted(*args):
        out = inner(*args)
        native_blocks.append(out is not None)
        return out

    nat.block = counted
    torch.manual_seed(2)
    N = 30
    ids = torch.randint(3, 64, (N + 1,))
    taps = _taps(target, ids[:N], ref.taps)
    nxt = ids[1:]
    s_ref, s_nat = ref.new_state(40), dr.new_state(40)
    for a, b, rows in ((0, 20, 4), (20, 21, 4), (21, 24, 2), (24, 29, 1), (29, 30, 3)):
        want, want_h = ref.draft(s_ref, taps[a:b], nxt[a:b], rows=rows, return_hidden=True)
        got, got_h = nat.draft(s_nat, taps[a:b], nxt[a:b], rows=rows, return_hidden=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)
        assert s_nat.length == s_ref.length == b
    assert native_blocks == [False, True, True, True, True]  # the 20-row prompt block: torch
    torch.testing.assert_close(s_nat.k[:, :N], s_ref.k[:, :N], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_nat.v[:, :N], s_ref.v[:, :N])
    # the native path's derived copies (normed MASK rows, fused gate|up, RoPE table) follow
    # in-place weight changes
    with torch.no_grad():
        for m in (ref, dr):
            m.mask_emb.mul_(0.5), m.layer.up_proj.weight.mul_(2.0), m.emb_norm.weight.add_(0.25)
    s_ref, s_nat = ref.new_state(40), dr.new_state(40)
    ref.draft(s_ref, taps[:20], nxt[:20]), nat.draft(s_nat, taps[:20], nxt[:20])
    torch.testing.assert_close(
        nat.draft(s_nat, taps[20:23], nxt[20:23]),
        ref.draft(s_ref, taps[20:23], nxt[20:23]),
        atol=1e-5,
        rtol=1e-5,
    )
    # near the end of the state the torch path takes over (the MASK rows' scratch keys would not fit)
    s = dr.new_state(N + 1)
    nat.draft(s, taps[: N - 1], nxt[: N - 1])
    torch.testing.assert_close(
        nat.draft(s, taps[N - 1 :], nxt[N - 1 :], rows=4),
        ref.draft(ref.new_state(N + 1), taps, nxt, rows=4),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.skipif(
    not __import__("dartcore.kernels.linear", fromlist=["x"]).native_linear_available(),
    reason="the native kernels need AVX-512F or AVX2 + FMA + F16C",
)
def test_native_drafts_follow_replaced_parameters_and_modules_and_hooks():
    # the native draft's arrays are checked in one cheap pass a draft: a parameter replaced
    # (or its .data), a module replaced or a forward hook added makes the draft the
    # drafter's own again
    from dartcore.kernels.native_draft import NativeDraft

    target = tiny_model("llama", layers=6)
    ref = _random_drafter(target, d=3, draft_vocab=list(range(0, 64, 3)))
    dr = _random_drafter(target, d=3, draft_vocab=list(range(0, 64, 3)))
    with torch.no_grad():
        for a, b in zip(ref.parameters(), dr.parameters()):
            a.copy_(a.half().float()), b.copy_(a)
    nat = NativeDraft.adopt(dr, threads=1)
    assert nat is not None
    torch.manual_seed(4)
    ids = torch.randint(3, 64, (13,))
    taps, nxt = _taps(target, ids[:12], ref.taps), ids[1:]

    def check(lean: bool):
        s_ref, s_nat = ref.new_state(16), dr.new_state(16)
        ref.draft(s_ref, taps[:10], nxt[:10]), nat.draft(s_nat, taps[:10], nxt[:10])
        torch.testing.assert_close(
            nat.draft(s_nat, taps[10:12], nxt[10:12]),
            ref.draft(s_ref, taps[10:12], nxt[10:12]),
            atol=1e-5,
            rtol=1e-5,
        )
        assert (nat._derived["lean"][1] is not None) == lean

    check(lean=True)
    with torch.no_grad():
        w = (ref.layer.o_proj.weight * 0.5).half().float()
    for m in (ref, dr):
        m.layer.o_proj.weight = torch.nn.Parameter(w.clone())
    check(lean=True)
    with torch.no_grad():
        for m in (ref, dr):
            m.mask_hidden.data = m.mask_hidden.data * 2.0
    check(lean=True)
    calls = []

    def hook(module, args, out):
        calls.append(1)
        return out * 1.5

    hooks = [m.layer.down_proj.register_forward_hook(hook) for m in (ref, dr)]
    check(lean=False)
    assert len(calls) >= 4  # the native draft's block called the hooked module too
    for h in hooks:
        h.remove()
    check(lean=True)
    # a module replaced: a plain torch layer, the native draft's tensor path around it
    new = torch.nn.Linear(dr.layer.up_proj.in_features, dr.layer.up_proj.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(ref.layer.up_proj.weight * 0.75)
    dr.layer.up_proj = new
    ref.layer.up_proj = copy.deepcopy(new)
    check(lean=True)


def test_state_truncate_and_overflow():
    target = tiny_model("llama", layers=6)
    dr = _random_drafter(target, d=3)
    ids = torch.randint(3, 64, (12,))
    taps = _taps(target, ids[:11], dr.taps)
    st = dr.new_state(16)
    dr.draft(st, taps[:6], ids[1:7])
    ref = dr.draft(st, taps[6:8], ids[7:9])
    dr.draft(st, taps[8:11], ids[9:12])
    st.truncate(6)
    assert st.length == 6
    torch.testing.assert_close(dr.draft(st, taps[6:8], ids[7:9]), ref)
    with pytest.raises(DartError):
        st.truncate(9)
    with pytest.raises(DartError, match="overflows"):
        dr.draft(st, taps.repeat(2, 1), ids[1:].repeat(2)[:22])
    with pytest.raises(DartError):
        dr.draft(st, taps[:0], ids[:0])


def test_to_target_ids_and_lm_head_init():
    target = tiny_model("qwen3", layers=6)
    vocab = [5, 9, 2, 40]
    dr = DartDrafter.from_target(target, d=2, draft_vocab=vocab)
    assert dr.to_target_ids(torch.tensor([0, 3, 2])).tolist() == [5, 40, 2]
    torch.testing.assert_close(dr.lm_head.weight, target.lm_head.weight[torch.tensor(vocab)])
    full = DartDrafter.from_target(target, d=2)
    assert full.to_target_ids(torch.tensor([7])).tolist() == [7]
    with pytest.raises(DartError):
        DartDrafter.from_target(target, draft_vocab=[1, 1])
    with pytest.raises(DartError):
        DartDrafter.from_target(target, draft_vocab=[64])


def test_embedding_is_shared_not_a_parameter():
    target = tiny_model("llama", layers=6)
    dr = DartDrafter.from_target(target)
    assert dr.target_embedding is target.get_input_embeddings()
    emb = target.get_input_embeddings().weight
    assert all(p.data_ptr() != emb.data_ptr() for p in dr.parameters())
    assert not any("embed" in k for k in dr.state_dict())
    assert dr.taps == (2, 3, 3) and dr.d == 8


@pytest.mark.parametrize("vocab", [None, list(range(10, 50))])
def test_save_load_round_trip(tmp_path, vocab):
    target = tiny_model("qwen3", layers=6)
    tok = FakeTokenizer({f"t{i}": i for i in range(64)})
    dr = _random_drafter(target, d=4, draft_vocab=vocab, tokenizer=tok, target_name="tiny")
    dr.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_target_layers"] == 6 and cfg["hidden_size"] == 32 and cfg["vocab_size"] == 64
    assert cfg["taps"] == [2, 3, 3] and cfg["d"] == 4
    assert cfg["tokenizer_fingerprint"] == tokenizer_fingerprint(tok)
    back = DartDrafter.from_pretrained(tmp_path, target, tokenizer=tok)
    ids = torch.randint(3, 64, (10,))
    taps = _taps(target, ids[:9], dr.taps)
    torch.testing.assert_close(
        back.draft(back.new_state(16), taps, ids[1:]), dr.draft(dr.new_state(16), taps, ids[1:])
    )
    assert torch.equal(back.draft_to_target, dr.draft_to_target)
    # half precision storage
    dr.save_pretrained(tmp_path / "half", dtype=torch.float16)
    half = DartDrafter.from_pretrained(tmp_path / "half", target)
    torch.testing.assert_close(
        half.draft(half.new_state(16), taps, ids[1:]),
        dr.draft(dr.new_state(16), taps, ids[1:]),
        atol=5e-2,
        rtol=5e-2,
    )


def test_mismatched_target_is_refused(tmp_path):
    target = tiny_model("llama", layers=6)
    tok = FakeTokenizer({f"t{i}": i for i in range(64)})
    DartDrafter.from_target(target, tokenizer=tok, target_name="tiny-6").save_pretrained(tmp_path)
    with pytest.raises(DrafterMismatchError, match="layer count 6 vs target 7"):
        DartDrafter.from_pretrained(tmp_path, tiny_model("llama", layers=7))
    with pytest.raises(DrafterMismatchError, match="hidden size"):
        DartDrafter.from_pretrained(tmp_path, tiny_model("llama", layers=6, hidden=64, heads=4))
    with pytest.raises(DrafterMismatchError, match="vocabulary size"):
        DartDrafter.from_pretrained(tmp_path, tiny_model("llama", layers=6, vocab_size=80))
    with pytest.raises(DrafterMismatchError, match="family"):
        DartDrafter.from_pretrained(tmp_path, tiny_model("qwen3", layers=6))
    other = FakeTokenizer({f"u{i}": i for i in range(64)})
    with pytest.raises(DrafterMismatchError, match="tokenizer fingerprint"):
        DartDrafter.from_pretrained(tmp_path, target, tokenizer=other)
    DartDrafter.from_pretrained(tmp_path, target, tokenizer=tok)  # the right one loads
    with pytest.raises(FileNotFoundError):
        DartDrafter.from_pretrained(tmp_path / "missing", target)
    (tmp_path / "config.json").write_text('{"format_version": 1}')
    with pytest.raises(DartError, match="not a valid drafter config"):
        DartDrafter.from_pretrained(tmp_path, target)


def test_unsupported_target_family():
    from transformers import GPT2Config

    with pytest.raises(DartError, match="families"):
        DrafterConfig.from_target_config(
            GPT2Config(n_layer=6),
            d=8,
            taps=None,
            draft_vocab_size=None,
            target_name=None,
            fingerprint=None,
        )


@pytest.mark.slow
def test_shipped_smollm2_drafter_loads(smollm2):
    model, tok = smollm2
    dr = DartDrafter.from_pretrained("smollm2", model, tokenizer=tok)
    L = model.config.num_hidden_layers
    assert dr.taps == (2, L // 2, L - 3) and dr.d == 8
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_tensors="pt",
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[t] for t in dr.taps], -1)[0]
    bonus = out.logits[0, -1].argmax()
    nxt = torch.cat((ids[0, 1:], bonus[None]))
    logits = dr.draft(dr.new_state(ids.shape[1] + 8), taps, nxt)
    assert logits.shape == (8, dr.config.draft_vocab_size)
    assert torch.isfinite(logits).all()


def test_draft_fewer_rows_equals_the_first_rows_of_the_full_draft():
    """``draft(rows=r)`` (the decoder asks for min(d, node budget) rows) computes the same
    first r rows as the full draft; bad ``rows`` is refused."""
    target = tiny_model("llama", layers=6)
    dr = _random_drafter(target, d=5, draft_vocab=list(range(0, 64, 2)))
    torch.manual_seed(2)
    ids = torch.randint(3, 64, (18,))
    taps = _taps(target, ids[:17], dr.taps)
    full, full_h = dr.draft(dr.new_state(64), taps, ids[1:], return_hidden=True)
    for r in (1, 2, 4, 5):
        part, part_h = dr.draft(dr.new_state(64), taps, ids[1:], return_hidden=True, rows=r)
        assert part.shape == (r, full.shape[1])
        torch.testing.assert_close(part, full[:r], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(part_h, full_h[:r], atol=1e-5, rtol=1e-5)
    for bad in (0, 6):
        with pytest.raises(DartError, match="rows must be in"):
            dr.draft(dr.new_state(64), taps, ids[1:], rows=bad)

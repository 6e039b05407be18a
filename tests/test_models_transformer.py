"""The lean target forward against the Hugging Face model it wraps.

References: the HF forward (logits, ``hidden_states``), HF ``generate(do_sample=False)``,
and recomputing a sequence from scratch (for KV compaction).
Tolerances: fp32 logits within 1e-4 relative to their scale (the tiny models'
weights are sharpened x4, logits reach ~+-50; measured differences ~2e-5), bf16
within 5% of the logit scale.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore import ContextLengthError
from dartcore.acceptance import ancestor_mask
from dartcore.models.transformer import TargetModel

torch.set_num_threads(1)  # tiny models: see tests/test_decoder.py


def _hf_forward(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor([ids]), output_hidden_states=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefill_logits_and_taps_match_hf(family):
    model = tiny_model(family, layers=5)
    target = TargetModel(model)
    ids = torch.randint(3, 64, (23,), generator=torch.Generator().manual_seed(0))
    ref = _hf_forward(model, ids.tolist())
    cache = target.new_cache(40)
    out = target.forward(cache, ids, torch.arange(23), taps=(0, 2, 5))
    scale = ref.logits.abs().max()
    assert torch.allclose(out.logits, ref.logits[0], atol=1e-4 * scale, rtol=0)
    want = torch.cat([ref.hidden_states[i][0] for i in (0, 2, 5)], dim=-1)
    assert torch.allclose(out.taps, want, atol=1e-4 * want.abs().max(), rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_incremental_blocks_match_full_forward(family):
    model = tiny_model(family)
    target = TargetModel(model)
    ids = torch.randint(3, 64, (30,), generator=torch.Generator().manual_seed(1))
    ref = _hf_forward(model, ids.tolist()).logits[0]
    cache = target.new_cache(30)
    got = []
    for a, b in ((0, 7), (7, 8), (8, 20), (20, 30)):
        out = target.forward(cache, ids[a:b], torch.arange(a, b))
        cache.commit(b - a)
        got.append(out.logits)
    assert torch.allclose(torch.cat(got), ref, atol=1e-4 * ref.abs().max(), rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_loop_equals_hf_generate(family):
    model = tiny_model(family)
    target = TargetModel(model)
    for prompt in ([1, 4], [1] + list(range(10, 40))):
        ids = torch.tensor([prompt])
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=25,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert target.greedy_generate(prompt, 25) == ref


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_forward_equals_each_path_run_alone(family):
    """Every tree node's logits equal a plain causal run of prefix + its path."""
    model = tiny_model(family)
    target = TargetModel(model)
    rng = np.random.default_rng(2)
    prefix = [1] + rng.integers(3, 64, size=12).tolist()
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6]
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    tokens = rng.integers(3, 64, size=len(parents)).tolist()
    cache = target.new_cache(64)
    target.forward(cache, torch.tensor(prefix[:-1]), torch.arange(len(prefix) - 1))
    cache.commit(len(prefix) - 1)
    tokens[0] = prefix[-1]  # the root is the last committed token, not yet in the cache
    L = cache.length
    out = target.forward(
        cache,
        torch.tensor(tokens),
        torch.tensor(depths) + L,
        torch.from_numpy(ancestor_mask(np.array(parents))),
    )
    for node in range(len(parents)):
        path = []
        j = node
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        seq = prefix[:-1] + path[::-1]
        ref = _hf_forward(model, seq).logits[0, -1]
        assert torch.allclose(out.logits[node], ref, atol=1e-4 * ref.abs().max(), rtol=0), node


def test_kv_compaction_equals_recomputing_the_prefix():
    model = tiny_model("qwen3")
    target = TargetModel(model)
    rng = np.random.default_rng(3)
    prefix = [1] + rng.integers(3, 64, size=9).tolist()
    parents = np.array([-1, 0, 0, 1, 2, 3, 3, 4, 6])
    depths = np.zeros(len(parents), dtype=np.int64)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    tokens = [prefix[-1]] + rng.integers(3, 64, size=len(parents) - 1).tolist()
    cache = target.new_cache(40)
    target.forward(cache, torch.tensor(prefix[:-1]), torch.arange(len(prefix) - 1))
    cache.commit(len(prefix) - 1)
    L = cache.length
    target.forward(
        cache,
        torch.tensor(tokens),
        torch.from_numpy(depths + L),
        torch.from_numpy(ancestor_mask(parents)),
    )
    path = [0]  # accept root -> ... -> node 8 (8 <- 6 <- 3 <- 1 <- 0)
    node = 8
    chain = []
    while node > 0:
        chain.append(node)
        node = int(parents[node])
    path += chain[::-1]
    cache.compact(path)
    seq = prefix[:-1] + [tokens[i] for i in path]
    assert cache.length == len(seq)
    fresh = target.new_cache(40)
    target.forward(fresh, torch.tensor(seq), torch.arange(len(seq)))
    fresh.commit(len(seq))
    n = len(seq)
    # The tree forward and the fresh forward sum in different orders (other GEMM shapes): fp32
    # noise up to ~5e-6 of the largest entry under AVX2 MKL, so the tolerance scales with it.
    for got, ref in ((cache.k, fresh.k), (cache.v, fresh.v)):
        ref = ref[:, :, :n]
        assert torch.allclose(got[:, :, :n], ref, atol=1e-5 * ref.abs().max(), rtol=1e-5)
    # and the next step's logits agree with a from-scratch forward
    nxt = torch.tensor([7])
    a = target.forward(cache, nxt, torch.tensor([n])).logits
    b = _hf_forward(model, seq + [7]).logits[0, -1:]
    assert torch.allclose(a, b, atol=1e-4 * b.abs().max(), rtol=0)


def test_compacting_a_chain_prefix_keeps_the_block_in_place():
    from dartcore.models.cache import KVCache

    a, b = (KVCache(2, 3, 4, 16, dtype=torch.float32, device="cpu") for _ in range(2))
    for c in (a, b):
        c.commit(5)
        c.k.copy_(torch.arange(c.k.numel(), dtype=torch.float32).view_as(c.k))
        c.v.copy_(-c.k)
    a.compact([0, 1, 2])  # rows already in place: nothing moves
    b.compact(torch.tensor([0, 1, 2]))  # the general gather
    assert a.length == b.length == 8
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_cache_refuses_to_write_past_its_end():
    target = TargetModel(tiny_model("llama"))
    cache = target.new_cache(10)
    target.forward(cache, torch.arange(3, 11), torch.arange(8))
    cache.commit(8)
    before = cache.k.clone()
    with pytest.raises(ContextLengthError):
        target.forward(cache, torch.tensor([3, 4, 5]), torch.tensor([8, 9, 10]))
    assert torch.equal(cache.k, before)
    target.forward(cache, torch.tensor([3, 4]), torch.tensor([8, 9]))  # exactly fits
    cache.commit(2)
    with pytest.raises(ContextLengthError):
        cache.commit(1)


def test_cache_capacity_is_capped_by_the_context():
    target = TargetModel(tiny_model("llama", max_positions=32))
    assert target.new_cache(1000).capacity == 32


def test_bf16_logits_close_to_fp32():
    model = tiny_model("llama")
    ids = torch.randint(3, 64, (16,), generator=torch.Generator().manual_seed(4))
    ref = _hf_forward(model, ids.tolist()).logits[0]
    target = TargetModel(model.to(torch.bfloat16))
    cache = target.new_cache(16)
    out = target.forward(cache, ids, torch.arange(16))
    assert out.logits.dtype == torch.float32
    assert (out.logits - ref).abs().max() < 0.05 * ref.abs().max()
    assert cache.k.dtype == torch.bfloat16


def test_unsupported_family_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    from dartcore import DartError

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(DartError, match="unsupported target family"):
        TargetModel(model)


def test_long_prefill_uses_fused_causal_path_and_matches_hf():
    from dartcore.kernels import tree_attention as ta

    model = tiny_model("qwen3", max_positions=512)
    target = TargetModel(model)
    n = ta._SDPA_CAUSAL_MIN + 44
    ids = torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(5))
    ref = _hf_forward(model, ids.tolist()).logits[0]
    cache = target.new_cache(n)
    out = target.forward(cache, ids, torch.arange(n))
    assert torch.allclose(out.logits, ref, atol=1e-4 * ref.abs().max(), rtol=0)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3", "llama-bias"])
def test_fused_cpu_weights_keep_values_memory_and_outputs(family, native):
    """The CPU relayout (fused q|k|v, o, gate|up, down: column-major for MKL, row-major for
    the native kernel) changes no value, shares one copy with the HF modules, and both
    forwards agree with an untouched twin model."""
    import copy

    from dartcore.kernels.linear import native_linear_available
    from dartcore.models.transformer import column_major_linears_

    if native and not native_linear_available():
        pytest.skip("the native small-batch kernel needs AVX-512F or AVX2 + FMA + F16C")
    model = tiny_model("llama" if family == "llama-bias" else family, layers=3)
    if family == "llama-bias":  # Qwen2-style q/k/v/o biases
        for layer in model.model.layers:
            for proj in (
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.self_attn.o_proj,
            ):
                proj.bias = torch.nn.Parameter(torch.randn(proj.out_features))
    twin = copy.deepcopy(model)
    fused = TargetModel(model, native_linear=native)  # CPU: fused by default
    plain = TargetModel(twin, fuse_cpu_weights=False)
    assert fused._fused is not None and plain._fused is None and fused.native_linear is native
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name
    attn = model.model.layers[0].self_attn
    assert (
        attn.q_proj.weight.untyped_storage().data_ptr()
        == attn.v_proj.weight.untyped_storage().data_ptr()
    )
    if native:
        assert attn.q_proj.weight.is_contiguous() and attn.o_proj.weight.is_contiguous()
    else:
        assert not attn.q_proj.weight.is_contiguous() and attn.o_proj.weight.t().is_contiguous()
    ids = torch.randint(3, 64, (19,), generator=torch.Generator().manual_seed(3))
    mask = torch.from_numpy(ancestor_mask(np.array([-1, 0, 0, 1, 1, 2])))
    outs = []
    for target in (fused, plain):
        cache = target.new_cache(32)
        target.forward(cache, ids[:13], torch.arange(13))
        cache.commit(13)
        outs.append(
            target.forward(cache, ids[13:], torch.tensor([13, 14, 14, 15, 15, 15]), mask).logits
        )
    scale = outs[1].abs().max()
    assert torch.allclose(outs[0], outs[1], atol=1e-5 * scale, rtol=0)
    ref, got = _hf_forward(twin, ids.tolist()).logits, _hf_forward(model, ids.tolist()).logits
    assert torch.allclose(got, ref, atol=1e-5 * ref.abs().max(), rtol=0)
    # the generic helper (used for the drafter) likewise keeps values and outputs
    lin = torch.nn.Linear(8, 5)
    x = torch.randn(6, 8)
    before, w = lin(x), lin.weight.detach().clone()
    column_major_linears_(lin)
    assert torch.equal(lin.weight, w) and lin.weight.t().is_contiguous()
    assert torch.allclose(lin(x), before, atol=1e-6)


def test_native_layer_stack_refuses_bad_arguments_and_writes_nothing():
    """The one-call layer stack (``_native.LayerStack``) behind the native forward: wrong
    dtypes, shapes, formats and segments are ValueErrors before any cache slot is written,
    and a model whose MLP is not SiLU-gated keeps the torch path."""
    from dartcore.kernels.linear import native_linear_available
    from dartcore.models.transformer import NativeLayerOps

    if not native_linear_available():
        pytest.skip("the native layer stack needs AVX-512F or AVX2 + FMA + F16C")
    from dartcore import _native

    model = tiny_model("qwen3", layers=2)
    target = TargetModel(model)
    assert isinstance(target._ops, NativeLayerOps)
    stack = target._ops.stack
    assert len(stack) == 2
    H, D = target.hidden_size, target.head_dim
    cache = target.new_cache(8)
    cache.k.zero_()  # a new CPU cache is left as allocated: zeros, to see any write
    cache.v.zero_()
    k, v = cache.k.numpy(), cache.v.numpy()
    h = np.zeros((3, H), np.float32)
    cs = np.ones((3, D), np.float32)
    out = np.zeros_like(h)
    bad = [
        # 3 rows after 6 of 8 slots
        ((h, cs, cs, [(k, v, 6, 0, 3, None)], [], None, out), "exceed"),
        ((h, cs, cs, [(k, v, 0, 0, 2, None)], [], None, out), "cover"),
        ((h, cs, cs, [(k, v, 0, 0, 3, np.ones((2, 2), bool))], [], None, out), "mask"),
        ((h, cs, cs, [(k, v, 0, 0, 3, None)], [2], np.zeros((1, 3, H), np.float32), out), "taps"),
        ((h, cs[:, :4], cs, [(k, v, 0, 0, 3, None)], [], None, out), "cos"),
        ((h, cs, cs, [(k.astype(np.float64), v, 0, 0, 3, None)], [], None, out), "k_cache"),
        (
            (
                np.zeros((17, H), np.float32),
                np.ones((17, D), np.float32),
                np.ones((17, D), np.float32),
                [(k, v, 0, 0, 17, None)],
                [],
                None,
                np.zeros((17, H), np.float32),
            ),
            "rows",
        ),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            stack.forward(*args)
        assert not cache.k.any() and not cache.v.any(), match
    with pytest.raises(TypeError):
        stack.forward(h, cs, cs, "segments", [], None, out)

    norm = np.ones(H, np.float32)
    w = np.zeros((4, H), np.float32)
    layer = (
        norm,
        norm,
        None,
        None,
        (w, "f32", None),
        (w, "f32", None),
        (w, "f32", None),
        (w, "f32", None),
    )
    for layers, match in [
        ([layer], "qkv is"),
        ([(norm[:3], *layer[1:])], "norm weights"),
        ([(*layer[:4], (w, "q5_k", None), *layer[5:])], "unknown weight format"),
        ([(*layer[:4], (w.astype(np.float64), "f32", None), *layer[5:])], "float32"),
        ([(norm, norm, norm, None, *layer[4:])], "both q_norm and k_norm"),
    ]:
        with pytest.raises(ValueError, match=match):
            _native.LayerStack(layers, norm, 2, 1, H // 2, 8, 1e-6, 0.1)

    gelu = tiny_model("llama", layers=2)
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    assert TargetModel(gelu)._ops is None

"""The Gated DeltaNet tree kernels (dartcore.kernels.triton_delta) against the torch reference:
Hugging Face's one-token ``causal_conv1d_update`` and ``torch_recurrent_gated_delta_rule``
applied node by node from the parent's states.

Under ``TRITON_INTERPRET=1`` on CPU (tiny shapes: chains, random trees up to 16 nodes, several
roots, grouped heads), then a hybrid target's whole tree forward and greedy decoding through the
kernels; on CUDA the ``gpu`` tests (``tools/device_check.sh``) take Qwen3-Next's head shapes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

_REFERENCE = r"""
import numpy as np, torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf
from dartcore.kernels.triton_delta import tree_conv_triton, tree_delta_rule_triton


def reference(x, parents, c0, w, b, split, g, beta, s0):
    convs, conv_out = [], []
    for i, p in enumerate(parents):
        cs = (c0 if p < 0 else convs[p]).clone()[None]
        conv_out.append(hf.causal_conv1d_update(x[i][None, :, None], cs, w, b, "silu")[0, :, 0])
        convs.append(cs[0])
    conv_out = torch.stack(conv_out)
    q, k, v = split(conv_out)
    recs, outs = [], []
    for i, p in enumerate(parents):
        o, s = hf.torch_recurrent_gated_delta_rule(
            q[i][None, None], k[i][None, None], v[i][None, None], g=g[i][None, None],
            beta=beta[i][None, None], initial_state=(s0 if p < 0 else recs[p])[None],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        recs.append(s[0])
        outs.append(o[0, 0])
    return conv_out, torch.stack(convs), torch.stack(outs), torch.stack(recs)


def compare(parents, hk, hv, dk, dv, K, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    m, C = len(parents), 2 * hk * dk + hv * dv
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)
    x, c0, w, b = rnd(m, C).to(dtype), rnd(C, K).to(dtype), rnd(C, K).to(dtype), rnd(C).to(dtype)
    g = -torch.rand(m, hv, generator=gen, device=device)
    beta = torch.rand(m, hv, generator=gen, device=device).to(dtype)
    s0 = rnd(hv, dk, dv)

    def split(co):
        a, bb, c = torch.split(co, [hk * dk, hk * dk, hv * dv], -1)
        return a.reshape(m, hk, dk), bb.reshape(m, hk, dk), c.reshape(m, hv, dv)

    co, cs = tree_conv_triton(x, parents, c0, w, b, "silu")
    q, k, v = split(co)
    o, rs = tree_delta_rule_triton(q, k, v, g, beta, parents, s0)
    want = reference(x, parents, c0, w, b, split, g, beta, s0)
    scale = [max(1.0, float(t.float().abs().max())) for t in want]
    return max(float((a.float() - b.float()).abs().max()) / s
               for a, b, s in zip((co, cs, o, rs), want, scale))


def random_parents(rng, m, roots=False):
    low = -1 if roots else 0
    return np.array([-1] + [int(rng.integers(low, i)) for i in range(1, m)])
"""

_INTERPRETER_SCRIPT = (
    _REFERENCE
    + r"""
import sys
from dartcore.kernels.tree_attention import force_backend
from dartcore.models.hybrid import HybridTarget
from dartcore.tree import ancestor_mask
rng = np.random.default_rng(0)
worst = 0.0
trees = [np.arange(-1, 7), np.array([-1]), random_parents(rng, 16), random_parents(rng, 16),
         random_parents(rng, 9, roots=True), np.array([-1, 0, 1, 2, 0, 4, 5, 1, 7, 3])]
for i, parents in enumerate(trees):
    for hk, hv, dk, dv, K in [(2, 4, 8, 8, 4), (1, 1, 16, 8, 3)]:
        worst = max(worst, compare(parents, hk, hv, dk, dv, K, seed=i))
print("OPS", worst)
# a hybrid target's tree forward through the kernels equals the torch recurrent form's
sys.path.insert(0, "tests")
from test_models_hybrid import tiny_next
from test_decoder import random_tree
model = tiny_next(1)
prompt = [1] + rng.integers(3, 64, size=9).tolist()
logits, states = [], []
for backend in ("triton", "reference"):
    target = HybridTarget(model, tree_form="recurrent")
    cache = target.new_cache(64)
    with force_backend(backend):
        out = target.forward(cache, torch.tensor(prompt), torch.arange(len(prompt)))
        cache.commit(len(prompt))
        tree = random_tree(np.random.default_rng(5), int(out.logits[-1].argmax()), 64, nodes=16,
                           depth=5)
        out = target.forward(cache, torch.from_numpy(tree.tokens),
                             torch.from_numpy(tree.depths + len(prompt)),
                             torch.from_numpy(ancestor_mask(tree.parents)))
        leaf = int(np.flatnonzero(tree.depths == tree.depths.max())[0])
        path, j = [], leaf
        while j >= 0:
            path.append(j)
            j = int(tree.parents[j])
        cache.compact(path[::-1])
    logits.append(out.logits)
    states.append(torch.cat([cache.conv.flatten(), cache.rec.flatten()]))
worst = max(worst, float((logits[0] - logits[1]).abs().max()))
worst = max(worst, float((states[0] - states[1]).abs().max()))
print("MODEL", worst)
# greedy decoding with trees through the kernels: HF generate's tokens
from dartcore import DartDecoder
from test_decoder import CharTokenizer, hf_greedy
model.generation_config.eos_token_id = None
ref = hf_greedy(model, prompt, 16)
dec = DartDecoder(model, CharTokenizer(), tree="test-oracle", reference=prompt + ref, vocab=64,
                  seed=0, nodes=12, depth=5, max_nodes=12)
dec.eos_token_ids = ()
dec.target.tree_form = "recurrent"
with force_backend("triton"):
    res = dec.generate(prompt, max_new_tokens=16)
print("GREEDY", res.tokens == ref)
"""
)


def test_tree_kernels_match_reference_in_interpreter():
    pytest.importorskip("triton")
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert float(lines["OPS"]) < 1e-5
    assert float(lines["MODEL"]) < 1e-4
    assert lines["GREEDY"] == "True"


def test_tree_kernels_reject_bad_input():
    pytest.importorskip("triton")
    from dartcore.errors import DartError, TreeError
    from dartcore.kernels.triton_delta import tree_conv_triton, tree_delta_rule_triton

    x, state, w = torch.zeros(3, 8), torch.zeros(8, 4), torch.zeros(8, 4)
    with pytest.raises(TreeError, match="after their parents"):
        tree_conv_triton(x, [-1, 2, 0], state, w, None, "silu")
    with pytest.raises(DartError, match="activation"):
        tree_conv_triton(x, [-1, 0, 1], state, w, None, "gelu")
    q = torch.zeros(3, 2, 4)
    with pytest.raises(DartError, match="g \\(3, 3\\)"):
        tree_delta_rule_triton(
            q, q, q, torch.zeros(3, 3), torch.zeros(3, 2), [-1, 0, 1], torch.zeros(2, 4, 4)
        )


@pytest.mark.gpu
def test_tree_kernels_match_reference_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    scope: dict = {}
    exec(_REFERENCE, scope)
    rng = np.random.default_rng(1)
    # Qwen3-Next's DeltaNet heads (16 key, 32 value heads of 128), conv kernel 4
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        for parents in (np.arange(-1, 8), scope["random_parents"](rng, 16)):
            err = scope["compare"](parents, 16, 32, 128, 128, 4, dtype=dtype, device="cuda")
            assert err < tol, (dtype, parents, err)


@pytest.mark.gpu
def test_hybrid_greedy_through_the_kernels_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from dartcore import DartDecoder
    from test_decoder import CharTokenizer, hf_greedy
    from test_models_hybrid import tiny_next

    for family in ("qwen3_next", "qwen3_5"):
        model = tiny_next(0, family=family).cuda()
        model.generation_config.eos_token_id = None
        prompt = [1, 9, 33, 4, 17, 60]
        ref = hf_greedy(model, prompt, 24)
        dec = DartDecoder(
            model,
            CharTokenizer(),
            tree="test-oracle",
            reference=prompt + ref,
            vocab=64,
            seed=0,
            nodes=16,
            depth=6,
            max_nodes=16,
        )
        dec.eos_token_ids = ()
        dec.target.tree_form = "recurrent"
        assert dec.generate(prompt, max_new_tokens=24).tokens == ref

"""The batched engine's packed verify forward through the Triton tree-attention kernel:
under the Triton interpreter on the CPU (``TRITON_INTERPRET=1``, in a subprocess so the
flag is set before Triton is imported) and on CUDA (``gpu``). Every sequence of the batch
equals Hugging Face ``generate(do_sample=False)``, and a step of several sequences runs as
one kernel launch per layer over all of them (``PackedAttention``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
import numpy as np, torch
torch.set_num_threads(1)
from conftest import tiny_model
from dartcore import DartDecoder
from dartcore.kernels import tree_attention as ta
from test_decoder import CharTokenizer, hf_greedy
import test_engine  # registers test-batch-oracle

calls = []
model = tiny_model("qwen3", layers=2)
model.generation_config.eos_token_id = None
rng = np.random.default_rng(0)
prompts = [[1] + rng.integers(3, 64, size=k).tolist() for k in (2, 30, 9)]
refs = [hf_greedy(model, p, 12) for p in prompts]
import dartcore.kernels.triton_tree as tt
launch = tt.tree_attention_triton
def counting(*a, **kw):
    calls.append(a[0].shape[1])
    return launch(*a, **kw)
tt.tree_attention_triton = counting
packed_calls = []
packed_launch = tt.PackedAttention.__call__
def packed_counting(self, q, layer, **kw):
    packed_calls.append(int(self.seg.numel() // 7))
    return packed_launch(self, q, layer, **kw)
tt.PackedAttention.__call__ = packed_counting
dec = DartDecoder(model, CharTokenizer(), tree="test-batch-oracle", references=[p + r for p, r in zip(prompts, refs)])
dec.eos_token_ids = ()
with ta.force_backend("triton"):
    out = dec.generate_batch(prompts, max_new_tokens=12, budget=4)
assert [r.tokens for r in out] == refs, ([r.tokens for r in out], refs)
assert calls, "the kernel ran"
# steps with several sequences ran as one launch per layer over all of them
assert packed_calls and max(packed_calls) == len(prompts), packed_calls
print("OK", len(calls), len(packed_calls))
"""


def test_packed_verify_through_triton_in_interpreter():
    pytest.importorskip("triton")
    # Native CPU kernels off: a CUDA forward never has them, and with them on the CPU the
    # verify forwards of <= 16 rows would run the native attention instead of the kernel.
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        DARTCORE_LINEAR_ISA="none",
        PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(tests=str(REPO / "tests"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if (
        proc.returncode != 0
        and "interpret" in proc.stderr.lower()
        and "not supported" in proc.stderr.lower()
    ):
        pytest.skip(f"Triton interpreter cannot run this kernel here: {proc.stderr[-500:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith("OK")


@pytest.mark.gpu
def test_packed_verify_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    sys.path.insert(0, str(REPO / "tests"))
    import numpy as np

    import test_engine  # noqa: F401
    from conftest import tiny_model
    from dartcore import DartDecoder
    from test_decoder import CharTokenizer, hf_greedy

    model = tiny_model("llama").cuda()
    model.generation_config.eos_token_id = None
    rng = np.random.default_rng(1)
    prompts = [[1] + rng.integers(3, 64, size=k).tolist() for k in (1, 50, 17, 90)]
    refs = [hf_greedy(model, p, 30) for p in prompts]
    dec = DartDecoder(
        model,
        CharTokenizer(),
        tree="test-batch-oracle",
        references=[p + r for p, r in zip(prompts, refs)],
    )
    dec.eos_token_ids = ()
    for budget in (0, 8, "adaptive"):
        assert [
            r.tokens for r in dec.generate_batch(prompts, max_new_tokens=30, budget=budget)
        ] == refs

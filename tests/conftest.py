"""Shared fixtures: tiny random Llama / Qwen3 targets for unit tests, the real
SmolLM2-135M-Instruct for the few integration tests (marked ``slow``), and the
fixture data that ships in ``tests/data`` (provenance in tests/data/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_DATA = REPO / "tests" / "data"


@pytest.fixture(scope="session")
def test_data() -> Path:
    """The repository's fixtures in the data-directory layout (``eval/``, ``train/``,
    ``dolma-sample/``, ``official-dart/``): a ``data_dir`` for ``load_prompts`` too."""
    return TEST_DATA


def tiny_config(
    family: str = "llama",
    *,
    vocab_size: int = 64,
    layers: int = 4,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 256,
):
    """A tiny random Hugging Face config of the Llama or Qwen3 family."""
    if family == "llama":
        from transformers import LlamaConfig as Config
    elif family == "qwen3":
        from transformers import Qwen3Config as Config
    else:
        raise ValueError(family)
    return Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=(family == "llama"),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def tiny_model(family: str = "llama", seed: int = 0, **kw):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kw), dtype=torch.float32)
    # Random init gives near-uniform logits; sharpen them so greedy decoding is
    # not decided by float noise (ties would make exact-match tests flaky).
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model.eval()


@pytest.fixture(params=["llama", "qwen3"])
def tiny_target(request):
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, fp32, CPU."""
    from dartcore.models.hub import load_target

    return load_target("smollm2", quantized=False)


def dolma_sample_index(tok, data_dir: Path, out_dir: Path, files: int = 4):
    """An index of the first ``files`` documents files of the Dolma sample fixture, built
    with ``tok`` (each document ends with its EOS) and recording its fingerprint."""
    import gzip
    import json

    import numpy as np

    from dartcore.index import NgramIndex, build_index
    from dartcore.tokenizers import fingerprint

    docs = []
    for path in sorted((data_dir / "dolma-sample" / "documents").glob("*.gz"))[:files]:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                text = json.loads(line).get("text", "")
                if text:
                    ids = tok(text)["input_ids"] + [tok.eos_token_id]
                    docs.append(np.asarray(ids, dtype=np.int64))
    path = out_dir / "dolma-sample.idx"
    build_index(
        docs,
        path,
        vocab_size=len(tok),
        metadata={"tokenizer": {"name": "smollm2", "fingerprint": fingerprint(tok)}},
    )
    return NgramIndex(path)

"""The README's main command and dart-bench, on a tiny random target.

The tiny target is a real Hugging Face model directory (random Llama weights, a
byte-level BPE tokenizer with a chat template), so every step runs exactly as it
does for SmolLM2: local corpus -> ngram-build -> drafter -> DartDecoder vs AR, and
dart-bench's JSON, markdown table and plots.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The tiny tokenizer's training text and the tiny index's corpus: test sources only, so that
# editing the README cannot change which drafts a random model happens to accept.
_TEXT = Path(__file__).read_text() + (REPO / "tests" / "conftest.py").read_text()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """(target dir, drafter dir) of a tiny random Llama with a real tokenizer."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dartcore.drafter import DartDrafter

    root = tmp_path_factory.mktemp("tiny-target")
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = _TEXT.splitlines()
    bpe.train_from_iterator(text, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    target = root / "tiny-llama"
    tok.save_pretrained(target)
    model = tiny_model("llama", vocab_size=len(tok), layers=6, max_positions=1024)
    model.config.eos_token_id = tok.eos_token_id
    model.config.bos_token_id = tok.bos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(target)
    drafter = DartDrafter.from_target(model, d=4, target_name="tiny-llama", tokenizer=tok)
    drafter_dir = root / "drafter"
    drafter.save_pretrained(drafter_dir)
    return target, drafter_dir


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_demo_steps_end_to_end(tiny_dirs, tmp_path, capsys):
    target, drafter = tiny_dirs
    demo = _load_tool("demo")
    out = tmp_path / "demo"
    code = demo.main(
        [
            "--out",
            str(out),
            "--corpus-bytes",
            "300K",
            "--target",
            str(target),
            "--drafter",
            str(drafter),
            "--prompts",
            "2",
            "--max-new-tokens",
            "12",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed  # 0 only when every DART output equals the AR output
    assert list((out / "corpus" / "documents").glob("*.json.gz"))
    assert (out / "tiny-llama.idx").stat().st_size > 0
    for step in ("1/4", "1b/4", "2/4", "3/4", "4/4", "== summary"):
        assert step in printed
    assert "greedy outputs identical: True" in printed
    assert "--- prompt 1/2" in printed and "--- prompt 2/2" in printed
    results = json.loads((out / "tiny-llama_demo.json").read_text())
    assert results["summary"]["identical"] is True and len(results["prompts"]) == 2
    for r in results["prompts"]:
        assert r["answer"].strip() and r["answer"].strip() in printed  # streamed as it decoded
        assert r["tau"] >= 1.0 and r["dart_tok_s"] > 0 and r["ar_tok_s"] > 0
        assert abs(r["speedup"] - r["dart_tok_s"] / r["ar_tok_s"]) < 1e-9
    md = (out / "tiny-llama_demo.md").read_text()
    assert "| prompt | τ |" in md and md.count("\n## ") == 2


def _tiny_index(target, tmp_path):
    """An index of the test sources' lines in the tiny target's tokenizer."""
    from dartcore.index import build_index
    from dartcore.tokenizers import fingerprint, load_tokenizer

    tok = load_tokenizer(str(target))
    docs = [tok.encode(line) for line in _TEXT.splitlines() if line.strip()]
    index = tmp_path / "tiny.idx"
    build_index(
        [__import__("numpy").append(d, tok.eos_id).astype("uint32") for d in docs],
        index,
        vocab_size=tok.vocab_size,
        metadata={
            "tokenizer": {
                "name": "tiny",
                "fingerprint": fingerprint(tok),
                "vocab_size": tok.vocab_size,
                "eos_id": tok.eos_id,
            }
        },
    )
    return index


def test_dart_bench_json_table_and_plots(tiny_dirs, tmp_path, capsys):
    from dartcore.cli.dart_bench import main

    target, drafter = tiny_dirs
    index = _tiny_index(target, tmp_path)
    out = tmp_path / "bench"
    methods = "ar,dart,dart-no-ngram,dart-chain,ngram-only,hf-generate,hf-prompt-lookup"
    code = main(
        [
            "--target",
            str(target),
            "--drafter",
            str(drafter),
            "--index",
            str(index),
            "--datasets",
            "builtin",
            "--n",
            "2",
            "--methods",
            methods,
            "--temperatures",
            "0,1",
            "--max-new-tokens",
            "8",
            "--verify-cost",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    assert set(report) >= {"config", "machine", "results", "greedy_identical", "verify_cost"}
    assert report["greedy_identical"] is True
    rows = report["results"]
    assert {(r["method"], r["temperature"]) for r in rows} == {
        (m, t) for m in methods.split(",") for t in (0.0, 1.0)
    }
    for r in rows:
        assert r["dataset"] == "builtin"
        assert r["tok_per_s"] > 0 and r["speedup"] > 0
        if r["method"].startswith("hf-"):
            assert r["tau"] is None
        else:
            assert r["tau"] >= 1.0
            assert sum(r["accept_hist"]) == r["rounds"]
            for stage in ("draft", "search", "verify", "accept"):
                assert r[f"{stage}_ms_per_round"] >= 0.0
        if r["method"] == "ar":
            assert r["tau"] == 1.0 and r["speedup"] == 1.0
        if r["temperature"] == 0.0 and r["method"] != "ar":
            assert r["greedy_identical"] is True
    vc = report["verify_cost"]
    assert [c["nodes"] for c in vc["curve"]][:3] == [1, 2, 4]
    assert vc["budget"] in [c["nodes"] for c in vc["curve"]]
    table = (out / "bench.md").read_text()
    assert table.count("\n") == len(rows) + 2
    for png in ("stage_times.png", "speedup.png", "acceptance.png", "verify_cost.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_sim_tau_replay_equals_the_decoder(tiny_dirs, tmp_path):
    """tools/sim_tau.py: replaying a builder along a recorded greedy output gives the same
    acceptance histogram as running DartDecoder with that builder. (A random tiny model
    repeats itself, so dart+ctx's context chain gets accepted: the comparison is not vacuous.)"""
    from dartcore.benchmark.datasets import load_prompts
    from dartcore.decoder import DartDecoder
    from dartcore.drafter import DartDrafter
    from dartcore.index import NgramIndex
    from dartcore.models.hub import load_target
    from dartcore.trees import make_tree_builder

    sim = _load_tool("sim_tau")
    target, drafter_dir = tiny_dirs
    model, tok = load_target(str(target))
    drafter = DartDrafter.from_pretrained(str(drafter_dir), model, tokenizer=tok)
    prompts = [("builtin", m) for m in load_prompts("builtin", 3)]
    recs = sim.record(DartDecoder, model, tok, drafter, prompts, max_new_tokens=24, keep=32)
    accepted_some = False
    index = NgramIndex(_tiny_index(target, tmp_path))
    for tree, params in (
        ("dart+ctx", {}),
        ("dart", {"max_nodes": 6}),
        ("dart-no-ngram", {"max_nodes": 3}),
    ):
        dec = DartDecoder(model, tok, drafter, index, tree=tree, **params)
        builder = make_tree_builder(tree, **params)
        for rec in recs:
            real = dec.generate(rec["ids"], max_new_tokens=24)
            assert real.tokens == rec["tokens"]
            replayed, _ = sim.replay(builder, rec, drafter, index, dec.eos_token_ids)
            hist = list(real.stats.accept_hist)
            assert replayed[: len(hist)] == hist and not any(replayed[len(hist) :])
            accepted_some = accepted_some or any(hist[1:])
    assert accepted_some, "no round accepted a drafted token: the comparison would be vacuous"
    assert sim.parse_config("dart:max_nodes=3,ngram_weight=1.5,ngram_first_level=False") == (
        "dart",
        {"max_nodes": 3, "ngram_weight": 1.5, "ngram_first_level": False},
    )

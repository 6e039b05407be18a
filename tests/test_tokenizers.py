"""Tokenizers: Qwen3 reference vectors, NFC, special tokens, batch = single,
fingerprints that agree across representations and differ across tokenizers."""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest

from dartcore.errors import TokenizerError
from dartcore.tokenizers import FINGERPRINT_PROBE, HFTokenizer, fingerprint, load_tokenizer


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("qwen3")


# Vectors from the reference Qwen3 tokenizer.
@pytest.mark.parametrize(
    "text, special, ids",
    [
        ("Hello world", False, [9707, 1879]),
        ("<|im_start|>user\nhi<|im_end|>", True, [151644, 872, 198, 6023, 151645]),
        ("你好，世界", False, [108386, 3837, 99489]),
    ],
)
def test_qwen3_reference_vectors(qwen3, text, special, ids):
    out = qwen3.encode(text, allow_special=special)
    assert out.dtype == np.uint32
    assert out.tolist() == ids


def test_qwen3_shape(qwen3):
    assert qwen3.name == "qwen3"
    assert qwen3.vocab_size == 151669  # 151643 BPE ranks + 26 special tokens
    assert qwen3.eos_id == 151643
    assert qwen3.encode("<think>", allow_special=True).tolist() == [151667]
    assert qwen3.encode("</think>", allow_special=True).tolist() == [151668]


def test_qwen3_specials_are_text_unless_allowed(qwen3):
    plain = qwen3.encode("<|endoftext|>")
    assert len(plain) > 1 and qwen3.eos_id not in plain.tolist()
    assert qwen3.decode(plain) == "<|endoftext|>"


def test_qwen3_nfc(qwen3):
    decomposed = "cafe\u0301 A\u030angstro\u0308m"
    composed = unicodedata.normalize("NFC", decomposed)
    assert composed != decomposed
    assert qwen3.encode(decomposed).tolist() == qwen3.encode(composed).tolist()


def test_qwen3_roundtrip_and_batch(qwen3):
    texts = [FINGERPRINT_PROBE, "", "x", "  leading spaces\n\n\ttabs", "emoji 👨‍👩‍👧 and 中文"] * 3
    batch = qwen3.encode_batch(texts)
    assert [b.tolist() for b in batch] == [qwen3.encode(t).tolist() for t in texts]
    for t, ids in zip(texts, batch):
        assert qwen3.decode(ids) == unicodedata.normalize("NFC", t)


def test_lone_surrogate_becomes_replacement_char(qwen3):
    assert qwen3.encode("a\udc80b").tolist() == qwen3.encode("a\ufffdb").tolist()


def test_huge_document(qwen3):
    # One long letter run is a single pre-tokenizer piece: BPE must stay fast.
    ids = qwen3.encode("a" * 200_000)
    assert qwen3.decode(ids) == "a" * 200_000


def test_unknown_tokenizer_lists_valid_names():
    with pytest.raises(TokenizerError, match="qwen3.*smollm2"):
        load_tokenizer("no-such-tokenizer")


def _tiny_tokenizer_json(tmp_path, with_config=True, eos="<eos>"):
    """A word-level tokenizer.json (+ tokenizer_config.json naming its EOS)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, eos: 1, "hello": 2, "world": 3, "the": 4, ".": 5}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([eos])
    d = tmp_path / "tiny-tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    if with_config:
        (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return d, tok


def test_hf_tokenizer_json_file_and_directory(tmp_path):
    d, raw = _tiny_tokenizer_json(tmp_path)
    by_dir = load_tokenizer(d)
    by_file = load_tokenizer(d / "tokenizer.json")
    assert isinstance(by_dir, HFTokenizer)
    assert by_dir.eos_id == 1 and by_dir.vocab_size == 6
    assert by_dir.encode("hello the world .").tolist() == [2, 4, 3, 5]
    assert by_dir.fingerprint == by_file.fingerprint == fingerprint(raw)
    # A special-token string in a document is text unless allowed.
    assert by_dir.encode("hello <eos>").tolist() != [2, 1]
    assert by_dir.encode("hello <eos>", allow_special=True).tolist() == [2, 1]
    assert [a.tolist() for a in by_dir.encode_batch(["hello", "the world"])] == [[2], [4, 3]]


def test_fingerprint_of_transformers_object_matches(tmp_path):
    from transformers import PreTrainedTokenizerFast

    d, raw = _tiny_tokenizer_json(tmp_path)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="[UNK]")
    assert fingerprint(hf) == load_tokenizer(d).fingerprint


def test_fingerprint_definition(qwen3):
    # Independent recomputation of the documented definition.
    import hashlib

    payload = json.dumps(
        [qwen3.vocab_size, qwen3.encode(FINGERPRINT_PROBE).tolist()], separators=(",", ":")
    )
    assert qwen3.fingerprint == hashlib.sha256(payload.encode()).hexdigest()[:16]
    assert fingerprint(qwen3) == qwen3.fingerprint
    assert 1500 <= len(FINGERPRINT_PROBE.encode()) <= 4096


def test_eos_guess_without_config(tmp_path):
    d, _ = _tiny_tokenizer_json(tmp_path, with_config=False)
    assert load_tokenizer(d).eos_id == 1  # "<eos>" is a known EOS spelling
    (tmp_path / "tiny-tok").rename(tmp_path / "old")
    d, _ = _tiny_tokenizer_json(tmp_path, with_config=False, eos="<END>")
    with pytest.raises(TokenizerError, match="end-of-sequence"):
        load_tokenizer(d)


def test_bad_tokenizer_file(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError):
        load_tokenizer(bad)
    with pytest.raises(TokenizerError):
        load_tokenizer(tmp_path / "missing.json")
    empty = tmp_path / "emptydir"
    empty.mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(empty)


@pytest.mark.slow
def test_smollm2_agrees_across_representations(qwen3):
    """smollm2 by name, by its GGUF, by the converted directory and as the HF
    object the decoder holds: one fingerprint; and it differs from qwen3."""
    from dartcore.models.targets import (
        BUILTIN_TARGETS,
        load_hf_tokenizer,
        package_dir,
        resolve_target,
    )

    ours = load_tokenizer("smollm2")
    hf = load_hf_tokenizer("smollm2")
    assert fingerprint(hf) == ours.fingerprint
    assert ours.vocab_size == len(hf) and ours.eos_id == hf.eos_token_id
    assert load_tokenizer(resolve_target("smollm2")).fingerprint == ours.fingerprint
    spec = BUILTIN_TARGETS["smollm2"]
    gguf = load_tokenizer(package_dir(spec.module) / spec.gguf)
    assert gguf.fingerprint == ours.fingerprint
    text = "def f(x):\n    return x ** 2  # café 你好"
    assert ours.encode(text).tolist() == hf.encode(text, add_special_tokens=False)
    assert ours.fingerprint != qwen3.fingerprint


@pytest.mark.slow
def test_qwen3_as_hf_tokenizer_json_agrees(qwen3, tmp_path):
    """The same Qwen3 tokenizer in Hugging Face form (BPE merges derived from the
    tiktoken ranks by transformers' converter, NFC normaliser, Qwen2 split regex,
    ByteLevel, the 26 special tokens) -- the shape of Qwen3's own tokenizer.json --
    has the same fingerprint as the tiktoken-backed built-in, loaded from disk."""
    import tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from dartcore.tokenizers import QWEN2_PATTERN, QWEN3_SPECIAL_TOKENS, _qwen_ranks_path

    conv = TikTokenConverter(
        vocab_file=str(_qwen_ranks_path()),
        pattern=QWEN2_PATTERN,
        extra_special_tokens=list(QWEN3_SPECIAL_TOKENS),
    )
    tok = conv.converted()
    tok.normalizer = tokenizers.normalizers.NFC()
    d = tmp_path / "qwen3-hf"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    hf = load_tokenizer(d)
    assert hf.vocab_size == qwen3.vocab_size and hf.eos_id == qwen3.eos_id
    for text in (FINGERPRINT_PROBE, "Hello world", "你好，世界", "cafe\u0301 \t\t  x\r\n\r\n  y"):
        assert hf.encode(text).tolist() == qwen3.encode(text).tolist()
    assert hf.fingerprint == qwen3.fingerprint

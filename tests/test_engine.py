"""The batched engine on tiny random Llama / Qwen3 targets (fp32): every sequence of a
batch gives exactly its own batch-1 ``DartDecoder.generate`` output and Hugging Face
``generate(do_sample=False)`` -- prompts of very different lengths, one finishing while
others continue, a request joining mid-way, one hitting the context limit, abort,
more requests than KV slots -- and bad input gets clear errors.

Trees come from an oracle builder that knows every prompt's reference continuation
(random trees, sometimes with the true path inserted), so acceptance of whole paths,
partial paths and nothing all occur inside one batch; a real untrained drafter with a
real index covers the batched draft and ``beam_search_batch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore import ContextLengthError, DartDecoder, DartError
from dartcore.engine import Engine, RequestOutput, SamplingParams, UnknownRequestError
from dartcore.trees import register_tree_builder
from test_decoder import CharTokenizer, hf_greedy, random_tree

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path, monkeypatch):
    """Verify-cost curves of the tiny models go to a temp directory, not ~/.cache."""
    monkeypatch.setenv("DARTCORE_CACHE", str(tmp_path))


@dataclass
class BatchOracle:
    """Random trees, sometimes with the true continuation (or a wrong-ended prefix of it)
    inserted as a path; ``references`` holds prompt + HF greedy output of every prompt."""

    references: list
    vocab: int = 64
    seed: int = 0
    nodes: int = 8
    depth: int = 4
    max_nodes: int = 8
    needs_drafter: bool = False
    needs_hidden: bool = False
    needs_index: bool = False

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, inputs):
        ctx = [int(t) for t in inputs.context]
        refs = [r for r in self.references if r[: len(ctx)] == ctx]
        assert refs, "the engine committed a token no reference has"
        truth = refs[0][len(ctx) : len(ctx) + min(self.depth, inputs.max_depth)]
        mode = self.rng.integers(0, 3)
        path = None
        if mode == 1:
            path = truth
        elif mode == 2 and len(truth) > 1:
            cut = int(self.rng.integers(1, len(truth)))
            path = truth[:cut] + [(truth[cut] + 1) % self.vocab]
        return random_tree(
            self.rng, ctx[-1], self.vocab, max(self.nodes, 1 + len(path or [])), self.depth, path
        )


register_tree_builder("test-batch-oracle", lambda **kw: BatchOracle(**kw), replace=True)


def prompts_and_refs(model, n: int, new: int, seed: int = 0, lengths=None):
    rng = np.random.default_rng(seed)
    lengths = lengths or [int(rng.integers(1, 90)) for _ in range(n)]
    prompts = [[1] + rng.integers(3, 64, size=k).tolist() for k in lengths]
    return prompts, [hf_greedy(model, p, new) for p in prompts]


def oracle_decoder(model, prompts, refs, **kw):
    dec = DartDecoder(
        model,
        CharTokenizer(),
        tree="test-batch-oracle",
        references=[p + r for p, r in zip(prompts, refs)],
        **kw,
    )
    dec.eos_token_ids = ()
    return dec


def cached_oracle(tmp_path, monkeypatch, n: int, new: int, seed: int):
    """An oracle decoder over ``n`` prompts of the tiny llama (one thread, cost curves cached
    under ``tmp_path``), the prompts and their greedy references."""
    monkeypatch.setenv("DARTCORE_CACHE", str(tmp_path))
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=2)
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, n, new, seed=seed)
    return oracle_decoder(model, prompts, refs), prompts, refs


def run(engine: Engine) -> dict[str, list[RequestOutput]]:
    seen: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_greedy_equals_batch1_and_hf(family):
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    # very different lengths: 2 to 121 prompt tokens
    prompts, refs = prompts_and_refs(model, 5, 30, lengths=[1, 120, 7, 60, 33])
    dec = oracle_decoder(model, prompts, refs)
    batch = dec.generate_batch(prompts, max_new_tokens=30)
    hist = np.zeros(10, dtype=np.int64)
    for p, ref, res in zip(prompts, refs, batch):
        assert res.tokens == ref
        assert dec.generate(p, max_new_tokens=30).tokens == ref
        assert res.stats.new_tokens == 30 and res.stats.finish_reason == "length"
        hist[: len(res.stats.accept_hist)] += res.stats.accept_hist
    assert hist[0] > 0 and hist[2:].sum() > 0, "both rejections and multi-token acceptances happen"


def test_continuous_batching_leave_join_and_queue():
    model = tiny_model("llama", seed=2)
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, 5, 40, seed=3)
    engine = Engine(oracle_decoder(model, prompts, refs), max_batch=3, max_seq_len=160, budget=6)
    lengths = [4, 40, 25, 40, 12]
    ids = [
        engine.add_request(p, SamplingParams(max_new_tokens=n))
        for p, n in zip(prompts[:3], lengths[:3])
    ]
    assert engine.num_waiting() == 3 and engine.num_running() == 0
    seen: dict[str, list[RequestOutput]] = {}
    finished_while_running = False
    steps = 0
    while engine.has_unfinished():
        if steps == 3:  # requests join mid-way; one waits for a slot (max_batch 3)
            ids += [
                engine.add_request(p, SamplingParams(max_new_tokens=n))
                for p, n in zip(prompts[3:], lengths[3:])
            ]
            assert engine.num_waiting() == 2
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
            if out.finished and engine.num_running() > 0:
                finished_while_running = True
        assert engine.num_running() <= 3
        steps += 1
    assert finished_while_running
    for rid, ref, n in zip(ids, refs, lengths):
        outs = seen[rid]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert [t for o in outs for t in o.new_tokens] == ref[:n]
        assert outs[-1].tokens == ref[:n]
        assert all(not o.finished for o in outs[:-1])
    assert engine.pool.free == 3


def test_context_limit_in_a_batch():
    model = tiny_model("llama", max_positions=40)
    model.generation_config.eos_token_id = None
    long = [1] + list(range(3, 30))  # 28 tokens: 12 more fill the context
    short = [1, 5, 9]
    refs = [hf_greedy(model, long, 12), hf_greedy(model, short, 20)]
    dec = oracle_decoder(model, [long, short], refs)
    engine = Engine(dec, max_batch=2, budget=8)
    a = engine.add_request(long, SamplingParams(max_new_tokens=100))
    b = engine.add_request(short, SamplingParams(max_new_tokens=20))
    seen = run(engine)
    assert seen[a][-1].tokens == refs[0] and seen[a][-1].finish_reason == "length"
    assert seen[a][-1].stats["finish_detail"] == "context"
    assert seen[b][-1].tokens == refs[1] and seen[b][-1].stats["finish_detail"] == "length"
    with pytest.raises(ContextLengthError, match="no room"):
        engine.add_request([1] * 40)


def test_abort_leaves_the_others_alone():
    model = tiny_model("qwen3", seed=4)
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, 3, 30, seed=5)
    engine = Engine(oracle_decoder(model, prompts, refs), max_batch=2, budget=4)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_new_tokens=30), request_id=f"r{i}")
    seen: dict[str, list[RequestOutput]] = {}
    for _ in range(3):
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    out = engine.abort("r0")  # running
    assert (
        out.finished and out.finish_reason == "abort" and out.tokens == refs[0][: len(out.tokens)]
    )
    assert engine.abort("r2").finish_reason == "abort"  # still queued
    with pytest.raises(UnknownRequestError, match="no request 'r0'"):
        engine.abort("r0")
    with pytest.raises(DartError):
        engine.abort("nope")
    for o in run(engine).get("r1", []):
        seen.setdefault("r1", []).append(o)
    assert seen["r1"][-1].tokens == refs[1] and seen["r1"][-1].finish_reason == "length"
    assert "r0" not in {o.request_id for o in seen.get("r0", []) if o.finished}
    assert engine.pool.free == 2 and not engine.has_unfinished()


def test_eos_and_stop_strings_end_one_sequence():
    model = tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = None
    prompt = [1, 17, 23, 5, 40]
    free = hf_greedy(model, prompt, 20)
    other = [1, 9, 9, 30]
    free_other = hf_greedy(model, other, 20)
    eos = free[8]
    model.generation_config.eos_token_id = eos
    refs = [hf_greedy(model, prompt, 20), hf_greedy(model, other, 20)]
    dec = DartDecoder(
        model,
        CharTokenizer(),
        tree="test-batch-oracle",
        references=[prompt + free + [0] * 10, other + free_other + [0] * 10],
    )
    assert eos in dec.eos_token_ids
    batch = dec.generate_batch([prompt, other], max_new_tokens=20)
    assert batch[0].tokens == refs[0] and batch[0].stats.finish_reason == "eos"
    assert batch[1].tokens == refs[1] == dec.generate(other, max_new_tokens=20).tokens
    # a stop string: the tokens through the one completing it (as generate), text cut before it
    text = CharTokenizer().decode(free_other)
    stop = text[5:7]
    single = DartDecoder(model, CharTokenizer(), tree="ar", eos_token_ids=()).generate(
        other, max_new_tokens=20, stop=stop
    )
    assert single.stats.finish_reason == "stop"
    dec.eos_token_ids = ()
    engine = Engine(dec, max_batch=2, budget=3)
    rid = engine.add_request(other, SamplingParams(max_new_tokens=20, stop=[stop]))
    final = [o for o in run(engine)[rid] if o.finished][0]
    assert final.tokens == single.tokens and final.finish_reason == "stop"
    assert final.text == single.text[: single.text.find(stop)]


def test_real_drafter_and_index_batched_greedy(tmp_path):
    pytest.importorskip("dartcore._native")
    from dartcore.drafter import DartDrafter
    from dartcore.index import NgramIndex, build_index
    from dartcore.tokenizers import fingerprint
    from test_decoder_builders import FingerprintedCharTokenizer

    model = tiny_model("llama", layers=6)
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, 4, 24, seed=0, lengths=[3, 40, 11, 5])
    rng = np.random.default_rng(0)
    docs = [np.array(p + r, dtype=np.int64) for p, r in list(zip(prompts, refs))[:2]]
    docs += [rng.integers(0, 64, size=200) for _ in range(20)]
    tok = FingerprintedCharTokenizer()
    build_index(
        docs,
        tmp_path / "tiny.idx",
        vocab_size=64,
        metadata={"tokenizer": {"name": "char", "fingerprint": fingerprint(tok)}},
    )
    drafter = DartDrafter.from_target(model, d=4)
    for tree in ("dart", "dart-chain"):
        dec = DartDecoder(
            model, tok, drafter, NgramIndex(tmp_path / "tiny.idx"), tree=tree, eos_token_ids=()
        )
        for budget in (None, "adaptive", 0):
            batch = dec.generate_batch(prompts, max_new_tokens=24, budget=budget)
            assert [r.tokens for r in batch] == refs, (tree, budget)
        single = [dec.generate(p, max_new_tokens=24) for p in prompts]
        assert [r.tokens for r in single] == refs
        assert max(r.stats.tau for r in single) > 1.2  # the index knows two continuations


def test_stats_per_request_and_per_step():
    model = tiny_model("llama", seed=6)
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, 3, 20, seed=7)
    engine = Engine(oracle_decoder(model, prompts, refs), max_batch=3, budget=5)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=20))
    seen = run(engine)
    for outs in seen.values():
        st = outs[-1].stats
        assert sum(st["accept_hist"]) == st["rounds"] == len(st["budgets"])
        assert st["tau"] == pytest.approx(
            sum((a + 1) * c for a, c in enumerate(st["accept_hist"])) / st["rounds"]
        )
        assert all(0 <= b <= 5 for b in st["budgets"])
        assert 1 + sum((a + 1) * c for a, c in enumerate(st["accept_hist"])) == 20
    steps = list(engine.stats.steps)
    assert steps[0].admitted == 3 and steps[0].sequences == 0  # the first step prefills
    for s in steps[1:]:
        assert s.rows_verified == sum(b + 1 for b in s.budgets) and len(s.budgets) == s.sequences
        assert set(s.seconds) == {"prefill", "controller", "draft", "search", "verify", "accept"}
    assert engine.stats.rows_verified == sum(s.rows_verified for s in steps)
    assert engine.stats.as_dict()["num_steps"] == len(steps)


def test_fixed_budget_zero_is_batched_ar():
    model = tiny_model("qwen3", seed=8)
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, 4, 15, seed=9)
    dec = oracle_decoder(model, prompts, refs)
    batch = dec.generate_batch(prompts, max_new_tokens=15, budget=0)
    assert [r.tokens for r in batch] == refs
    assert all(r.stats.tau == 1.0 and r.stats.budget_hist == [14] for r in batch)


def test_an_adaptive_step_at_budget_zero_drafts_and_searches_nothing(monkeypatch):
    """Where the controller gives every sequence 0 nodes, the step is a plain batched AR step
    (no drafter pass, no search, no second choice) and the outputs stay HF greedy; the
    positions it commits reach the drafter when a sequence drafts again."""
    from dartcore import rounds

    model = tiny_model("llama", seed=12)
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, 3, 12, seed=13)
    dec = oracle_decoder(model, prompts, refs)
    engine = Engine(dec, max_batch=3, max_seq_len=128, budget="adaptive")
    ctrl = engine.controller
    zero_steps = {"n": 0}
    real_draws, real_draft = ctrl.draws, rounds.draft

    def draws(accs, caps):  # every other step at budget 0 for all
        zero_steps["n"] += 1
        return [0] * len(caps) if zero_steps["n"] % 2 else real_draws(accs, caps)

    def draft(parts, seqs, depths):
        assert any(s.budget > 0 for s in seqs), "drafted in a step without nodes"
        return real_draft(parts, seqs, depths)

    monkeypatch.setattr(ctrl, "draws", draws)
    monkeypatch.setattr(rounds, "draft", draft)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=12))
    seen = run(engine)
    assert [seen[r][-1].tokens for r in sorted(seen, key=lambda r: int(r.split("-")[1]))] == refs
    zero = [s for s in engine.stats.steps if s.sequences and not any(s.budgets)]
    assert zero and all(s.seconds["draft"] == s.seconds["search"] == 0.0 for s in zero)


# -- bad input ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_engine():
    model = tiny_model("llama", seed=10)
    dec = DartDecoder(model, CharTokenizer(), tree="ar")
    return dec, Engine(dec, max_batch=2, max_seq_len=64, budget=0)


@pytest.mark.parametrize(
    "prompts,error,match",
    [
        ([], ValueError, "prompts is empty"),
        ("abc", TypeError, "list of prompts"),
        (["abc", [1, 2, 3]], TypeError, "mixes strings and token ids"),
        (
            [[1, 2], [{"role": "user", "content": "x"}]],
            TypeError,
            "mixes chat messages and token ids",
        ),
        ([[1, 2], [1, "x"]], TypeError, r"prompts\[1\]"),
        ([[1, 2], []], ValueError, r"prompts\[1\]: empty prompt"),
    ],
)
def test_generate_batch_bad_prompts(small_engine, prompts, error, match):
    dec, _ = small_engine
    with pytest.raises(error, match=match):
        dec.generate_batch(prompts, max_new_tokens=3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(stop=[""]), "stop"),
        (dict(seed="x"), "seed"),
    ],
)
def test_sampling_params_are_checked(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kwargs)


def test_engine_arguments_and_requests_are_checked(small_engine):
    dec, engine = small_engine
    for kw, match in (
        (dict(max_batch=0), "max_batch"),
        (dict(max_batch=True), "max_batch"),
        (dict(max_seq_len=1), "max_seq_len"),
        (dict(budget="fast"), "budget"),
        (dict(budget=-1), "budget"),
    ):
        with pytest.raises(ValueError, match=match):
            Engine(dec, **kw)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([1, 2], {"max_new_tokens": 3})
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    engine.add_request([1, 2, 3], request_id="same")
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request([1, 2, 3], request_id="same")
    with pytest.raises(UnknownRequestError):
        engine.abort(123)
    # the bad requests left the good one alone
    outs = run(engine)
    assert list(outs) == ["same"] and outs["same"][-1].finished
    assert engine.pool.free == 2


def test_zero_new_tokens_finishes_at_admission(small_engine):
    _, engine = small_engine
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=0))
    (out,) = engine.step()
    assert (
        out.request_id == rid
        and out.finished
        and out.tokens == []
        and out.finish_reason == "length"
    )
    assert not engine.has_unfinished() and engine.pool.free == 2


def test_pool_is_allocated_once():
    model = tiny_model("llama", seed=11)
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, 4, 12, seed=12)
    engine = Engine(oracle_decoder(model, prompts, refs), max_batch=2, max_seq_len=128, budget=4)
    ptr = engine.pool.k.data_ptr()
    slots = set()
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=12))
    while engine.has_unfinished():
        engine.step()
        for r in engine._running:
            assert r.seq.cache.k.data_ptr() == engine.pool.k[r.slot].data_ptr()
            slots.add(r.slot)
    assert engine.pool.k.data_ptr() == ptr and slots == {0, 1}


def test_engine_generate_is_the_batch_api_and_needs_an_idle_engine():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, 3, 12, seed=3, lengths=[4, 40, 9])
    dec = oracle_decoder(model, prompts, refs)
    engine = Engine(dec, max_batch=2, max_seq_len=80, budget=5)  # 3 prompts, 2 slots: one waits
    results = engine.generate(prompts, max_new_tokens=12)
    # the target's own greedy continuations (HF generate)
    assert [r.tokens for r in results] == refs
    assert all(r.stats.new_tokens == 12 and r.stats.finish_reason == "length" for r in results)
    assert not engine.has_unfinished()
    engine.add_request(prompts[0], SamplingParams(max_new_tokens=4))
    with pytest.raises(DartError, match="idle engine"):
        engine.generate(prompts[:1], max_new_tokens=4)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_plain_step_is_a_round_of_root_only_trees(temperature):
    """rounds.plain (the engine's step when no sequence drafts) commits what verify + accept
    with root-only trees commit: the same tokens, stats and cache lengths, the samplers drawing
    in the same order."""
    from dartcore import rounds
    from dartcore.rounds import GenerationStats
    from dartcore.sampling import Sampler
    from dartcore.trees import root_only

    model = tiny_model("llama", seed=21)
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, 3, 10, seed=22, lengths=[5, 17, 9])
    parts = oracle_decoder(model, prompts, refs).parts
    params = SamplingParams(max_new_tokens=10, temperature=temperature)

    def start():
        seqs = [
            rounds.new_sequence(parts, p, 10, Sampler(params, seed=i), (), GenerationStats())
            for i, p in enumerate(prompts)
        ]
        for s in seqs:
            rounds.prefill(parts, s)
        return seqs

    a, b = start(), start()
    for _ in range(9):
        done_a = rounds.plain(parts, a)
        trees = [root_only(s.committed[-1]) for s in b]
        outs = rounds.verify(parts, b, trees)
        lgs = parts.backend.tree_logits_batch(outs, trees)
        done_b = [rounds.accept(parts, s, t, o, lg) for s, t, o, lg in zip(b, trees, outs, lgs)]
        assert done_a == done_b
    for x, y in zip(a, b):
        assert x.generated == y.generated and x.committed == y.committed
        assert x.cache.length == y.cache.length and x.path == y.path == [0]
        assert x.stats.accept_hist == y.stats.accept_hist and x.stats.rounds == y.stats.rounds
    if temperature == 0.0:
        assert [s.generated for s in a] == [r[:10] for r in refs]

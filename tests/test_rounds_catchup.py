"""The drafter's catch-up window (dartcore.rounds.CATCHUP_WINDOW): a sequence that commits
positions without drafting (its prompt, a stretch of plain steps at budget 0) keeps at most its
first CATCHUP_SINK positions and the window and a quarter waiting, and its next draft reads at
most the sink and the window, its drafter state started over from them -- while every output
stays the target's own greedy decoding, single and batched. Tiny random Llama target, a real
untrained drafter and a real index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dartcore import DartDecoder, rounds
from dartcore.engine import Engine, SamplingParams
from test_engine import prompts_and_refs

torch.set_num_threads(1)

WINDOW = 8
SINK = rounds.CATCHUP_SINK
PLAIN = 40  # steps at budget 0 before the controller may draft again


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DARTCORE_CACHE", str(tmp_path))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("dartcore._native")
    from dartcore.drafter import DartDrafter
    from dartcore.index import NgramIndex, build_index
    from dartcore.tokenizers import fingerprint
    from test_decoder_builders import FingerprintedCharTokenizer

    model = tiny_model("llama", layers=6)
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, 3, 60, seed=3, lengths=[50, 5, 23])
    rng = np.random.default_rng(0)
    docs = [np.array(p + r, dtype=np.int64) for p, r in zip(prompts, refs)]
    docs += [rng.integers(0, 64, size=200) for _ in range(20)]
    tok = FingerprintedCharTokenizer()
    path = tmp_path_factory.mktemp("catchup") / "tiny.idx"
    build_index(
        docs,
        path,
        vocab_size=64,
        metadata={"tokenizer": {"name": "char", "fingerprint": fingerprint(tok)}},
    )
    drafter = DartDrafter.from_target(model, d=4)
    dec = DartDecoder(model, tok, drafter, NgramIndex(path), tree="dart", eos_token_ids=())
    dec.parts.catchup_window = WINDOW
    return dec, prompts, refs


def _record_drafts(monkeypatch, dec) -> list[tuple[int, int, int]]:
    """(rows absorbed, rows drafted, drafter state length after) of every sequence's draft."""
    seen: list[tuple[int, int, int]] = []
    absorbed: dict[int, int] = {}
    backend, drafter = dec.parts.backend, dec.parts.drafter
    real_draft, real_absorb = backend.draft_batch, drafter.absorb

    def absorb(states, taps, next_tokens):
        real_absorb(states, taps, next_tokens)
        for s, t in zip(states, taps):
            absorbed[id(s)] = int(t.shape[0])

    def draft_batch(drafter, states, taps, next_tokens, *, rows, return_hidden):
        out = real_draft(drafter, states, taps, next_tokens, rows=rows, return_hidden=return_hidden)
        for t, s in zip(taps, states):
            seen.append((absorbed.pop(id(s), 0), int(t.shape[0]), s.length))
        return out

    monkeypatch.setattr(backend, "draft_batch", draft_batch)
    monkeypatch.setattr(drafter, "absorb", absorb)
    return seen


def test_plain_stretch_keeps_a_bounded_backlog_and_catches_up_on_the_window(setup, monkeypatch):
    dec, prompts, refs = setup
    engine = Engine(dec, max_batch=3, max_seq_len=128, budget="adaptive")
    ctrl = engine.controller
    real_draws = ctrl.draws
    step = {"n": 0}

    def draws(accs, caps):  # a long plain stretch, then the controller decides (and probes)
        step["n"] += 1
        return (
            [0] * len(caps) if step["n"] <= PLAIN else [max(c, 1) for c in real_draws(accs, caps)]
        )

    monkeypatch.setattr(ctrl, "draws", draws)
    drafts = _record_drafts(monkeypatch, dec)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=60)) for p in prompts]
    seen: dict = {}
    backlog = []
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        for req in engine._running:
            seq = req.seq
            assert sum(int(t.shape[0]) for t in seq.new_taps) == len(seq.new_next)
            backlog.append(len(seq.new_next))
    assert [seen[r][-1].tokens for r in ids] == refs
    # (a) the pending positions never exceed the sink, the window and a quarter, over 40 plain steps
    assert SINK + WINDOW < max(backlog) <= SINK + WINDOW + WINDOW // 4
    # (b) a catch-up reads at most the sink and the window, all but its last row absorbed; the
    # first draft after the stretch starts the drafter's state over from them
    d = dec.parts.drafter.d
    assert drafts and all(a + n <= SINK + WINDOW and n <= d for a, n, _ in drafts)
    assert drafts[: len(prompts)] == [(SINK + WINDOW - 1, 1, SINK + WINDOW)] * len(prompts)


@pytest.mark.parametrize("budget", [None, "adaptive"])
def test_windowed_catchup_is_lossless_batched_and_single(setup, budget):
    dec, prompts, refs = setup
    batch = dec.generate_batch(prompts, max_new_tokens=60, budget=budget)
    assert [r.tokens for r in batch] == refs
    single = [dec.generate(p, max_new_tokens=60) for p in prompts]
    assert [r.tokens for r in single] == refs


def test_a_prompt_longer_than_the_window_drafts_from_its_last_positions(setup, monkeypatch):
    dec, prompts, refs = setup
    drafts = _record_drafts(monkeypatch, dec)
    seq = dec.generate(prompts[0], max_new_tokens=8)
    assert seq.tokens == refs[0][:8]
    # the first draft reads the prompt's first SINK and last WINDOW positions into an empty state
    assert drafts[0] == (SINK + WINDOW - 1, 1, SINK + WINDOW)
    assert rounds.CATCHUP_WINDOW >= WINDOW


def test_absorbed_rows_draft_as_drafted_ones(setup):
    """Rows absorbed and then a one-row draft give the draft of all the rows at once."""
    dec = setup[0]
    drafter = dec.parts.drafter
    gen = torch.Generator().manual_seed(0)
    taps = torch.randn(20, 3 * drafter.config.hidden_size, generator=gen)
    nxt = torch.randint(0, 64, (20,), generator=gen)
    whole, split = drafter.new_state(32), drafter.new_state(32)
    want = drafter.draft(whole, taps, nxt)
    drafter.absorb([split], [taps[:-1]], [nxt[:-1]])
    got = drafter.draft(split, taps[-1:], nxt[-1:])
    assert split.length == whole.length == 20
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split.k[:, :20], whole.k[:, :20], rtol=1e-5, atol=1e-5)


def test_stale_cache_storage_is_never_read(setup, monkeypatch):
    """CPU caches are left as allocated, not zeroed: with every slot of the target's cache and
    the drafter's state NaN before the prompt, the outputs are the target's own greedy ones --
    no read reaches a slot that no forward wrote (a draft's scratch rows included)."""
    from dartcore.drafter import DrafterState
    from dartcore.models.cache import KVCache

    dec, prompts, refs = setup

    def poisoned(init):
        def made(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.k.fill_(float("nan"))
            self.v.fill_(float("nan"))

        return made

    monkeypatch.setattr(KVCache, "__init__", poisoned(KVCache.__init__))
    monkeypatch.setattr(DrafterState, "__init__", poisoned(DrafterState.__init__))
    accepted = 0
    for prompt, ref in zip(prompts, refs):
        res = dec.generate(prompt, max_new_tokens=len(ref))
        assert res.tokens == ref
        accepted += sum(res.stats.accept_hist[1:])
    assert accepted > 0, "no round accepted a drafted token: the trees were never read"

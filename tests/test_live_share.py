"""Live layers saved as delta indexes and shared between processes: a saved layer merged into
a base index counts what an index built from all the documents counts (brute force), a layer
reading other layers' deltas searches as the brute-force Eq. (10) over all their documents,
decoders that share stay lossless, and bad delta files are refused with a clear error."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dartcore import DartDecoder, DartError, IndexBuildError, TokenizerMismatchError
from dartcore import tree as T
from dartcore.cli import dart_index
from dartcore.index import NgramIndex, build_index, merge_indexes
from dartcore.live import LiveLayer, SharedLive
from test_decoder_builders import setup  # noqa: F401 - the tiny target, drafter and index
from test_live import MixedCounts, live_docs
from test_tree import Counts, V, brute_eq10, corpus_index, random_rows, tree_dict  # noqa: F401

CONTEXTS = [[], [1], [2, 3], [0, 0], [5, 7], [11], [3, 1]]


def assert_counts(index: NgramIndex, docs) -> None:
    ref = Counts(docs)
    for ctx in CONTEXTS:
        for uni in (True, False) if ctx else (True,):  # the empty context is the unigram
            got = [index.prob(ctx, v, unigram_backoff=uni) for v in range(V)]
            want = [ref.g(ctx, v, unigram_backoff=uni) for v in range(V)]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=f"{ctx} {uni}")


def test_a_saved_layer_merged_into_a_base_counts_the_union(tmp_path, corpus_index):  # noqa: F811
    docs, _ = corpus_index
    tok = {"name": "t", "fingerprint": "abc"}
    base = tmp_path / "base.idx"
    build_index(docs, base, vocab_size=V, metadata={"tokenizer": tok})
    layer = LiveLayer(V, capacity=64)
    ldocs = live_docs(1, n=8)
    for d in ldocs:
        layer.insert(d)
    delta = tmp_path / "live.delta"
    layer.save(delta, tokenizer=tok)
    # what the window holds now: its last 64 symbols, documents split at the separators
    flat: list = []
    for d in ldocs:
        flat += ([None] if flat else []) + d
    flat = flat[-64:]
    held_docs, cur = [], []
    for t in flat:
        if t is None:
            held_docs.append(cur)
            cur = []
        else:
            cur.append(t)
    held_docs.append(cur)
    assert_counts(NgramIndex(delta), held_docs)
    out = tmp_path / "merged.idx"
    rc = dart_index.main(["merge", str(base), str(delta), "-o", str(out)])
    assert rc == 0
    merged = NgramIndex(out)
    assert_counts(merged, [list(map(int, d)) for d in docs] + held_docs)
    assert merged.metadata["tokenizer"] == tok
    assert merged.metadata["merged"] == ["base.idx", "live.delta"]
    merged.verify()


def test_merge_refuses_foreign_corrupt_and_its_own_inputs(tmp_path, corpus_index, capsys):  # noqa: F811
    docs, _ = corpus_index
    base = tmp_path / "base.idx"
    build_index(docs, base, vocab_size=V, metadata={"tokenizer": {"name": "t", "fingerprint": "a"}})
    layer = LiveLayer(V)
    layer.insert([1, 2, 3, 4])
    other = tmp_path / "other.delta"
    layer.save(other, tokenizer={"name": "u", "fingerprint": "b"})
    for force in (False, True):
        with pytest.raises(TokenizerMismatchError, match="different tokenizers never merge"):
            merge_indexes([base, other], tmp_path / "m.idx", force=force)
    bare = tmp_path / "bare.delta"
    layer.save(bare)
    with pytest.raises(TokenizerMismatchError):
        merge_indexes([base, bare], tmp_path / "m.idx")
    merge_indexes([base, bare], tmp_path / "m.idx", force=True)  # the user vouches for it
    wide = LiveLayer(V + 1)
    wide.insert([1, 2])
    wide.save(tmp_path / "wide.delta")
    with pytest.raises(IndexBuildError, match="vocabulary size"):
        merge_indexes([base, tmp_path / "wide.delta"], tmp_path / "m2.idx", force=True)
    pruned = tmp_path / "pruned.idx"
    build_index(docs, pruned, vocab_size=V, min_count=2)
    with pytest.raises(IndexBuildError, match="min_count"):
        merge_indexes([base, pruned], tmp_path / "m3.idx", force=True)
    bytes_ = bare.read_bytes()
    (tmp_path / "cut.delta").write_bytes(bytes_[: len(bytes_) // 2])
    (tmp_path / "junk.delta").write_bytes(b"\0" * 4096)
    for bad in ("cut.delta", "junk.delta"):
        with pytest.raises(DartError):
            merge_indexes([base, tmp_path / bad], tmp_path / "m4.idx", force=True)
        assert dart_index.main(["merge", str(base), str(tmp_path / bad), "-o", "m4"]) == 2
    assert not (tmp_path / "m3.idx").exists() and not (tmp_path / "m4.idx").exists()
    before = base.read_bytes()
    assert dart_index.main(["merge", str(base), str(bare), "-o", str(base), "--force"]) == 2
    assert "input" in capsys.readouterr().err
    assert base.read_bytes() == before


def test_shared_deltas_search_as_one_window_over_all_documents(tmp_path, corpus_index):  # noqa: F811
    docs, index = corpus_index
    a, b = LiveLayer(V), LiveLayer(V)
    share_a = SharedLive(tmp_path, name="a")
    share_b = SharedLive(tmp_path, name="b")
    adocs, bdocs = live_docs(5), live_docs(6)
    for d in adocs:
        a.insert(d)
    for d in bdocs:
        b.insert(d)
    share_a.sync(a, "t1")
    share_b.sync(b, "t1")
    share_a.sync(a, "t1")
    assert a.shared_count == 1 and b.shared_count == 1
    ref = Counts(adocs + bdocs)
    for ctx in CONTEXTS[1:]:
        want = [ref.g(ctx, v, unigram_backoff=False) for v in range(V)]
        for layer in (a, b):
            np.testing.assert_allclose(layer.probs(ctx, range(V)), want, rtol=0, atol=1e-12)
    rng = np.random.default_rng(3)
    for _ in range(6):
        toks, lps = random_rows(rng, int(rng.integers(1, 5)), int(rng.integers(1, 6)))
        context = [int(t) for t in rng.integers(0, V, size=2)]
        weight = float(rng.choice([0.3, 0.7]))
        kw = dict(beam_width=3, max_nodes=int(rng.integers(2, 20)), ngram_weight=1.0)
        want = brute_eq10(MixedCounts(Counts(docs), ref, weight), context, toks, lps, **kw)
        tree = T.beam_search(index, context, toks, lps, live=b, live_weight=weight, **kw)
        got = tree_dict(tree)
        assert set(got) == set(want)
        for p, s in want.items():
            assert got[p] == pytest.approx(s, rel=1e-9, abs=1e-12)
    # another scope sees nothing of t1; forgetting removes a's delta from b's reads
    c = LiveLayer(V)
    SharedLive(tmp_path, name="c").sync(c, "t2")
    assert c.shared_count == 0
    share_a.forget("t1", a)
    share_b.sync(b, "t1")
    assert a.shared_count == 0 and b.shared_count == 0


def test_a_layer_beyond_the_index_format_vocabulary_cannot_be_saved(tmp_path):
    layer = LiveLayer(3_000_000, capacity=16)
    layer.insert([2_999_999, 1, 2])
    with pytest.raises(ValueError, match="vocab_size"):
        layer.save(tmp_path / "x.delta")
    assert not (tmp_path / "x.delta").exists()
    with pytest.raises(DartError, match="tokenizer"):
        layer.save(tmp_path / "y.delta", tokenizer="smollm2")


def test_bad_shared_deltas_are_skipped_and_named(tmp_path):
    a = LiveLayer(V)
    a.insert([1, 2, 3, 4, 5])
    share = SharedLive(tmp_path, name="a")
    d = share.scope_dir("s")
    d.mkdir(parents=True)
    good = LiveLayer(V)
    good.insert([3, 4, 5])
    good.save(d / "good.delta")
    raw = (d / "good.delta").read_bytes()
    (d / "cut.delta").write_bytes(raw[:-17])
    (d / "junk.delta").write_bytes(b"DARTNGRM" + b"\1" * 600)
    other = LiveLayer(V + 3)
    other.insert([1, 2])
    other.save(d / "foreign.delta")
    share.sync(a, "s")
    assert a.shared_count == 1
    assert sorted(p.rsplit("/", 1)[1] for p in share.errors) == [
        "cut.delta",
        "foreign.delta",
        "junk.delta",
    ]
    assert "vocabulary" in share.errors[str(d / "foreign.delta")]
    with pytest.raises(DartError):
        SharedLive(tmp_path, name="../x")
    with pytest.raises(DartError):
        SharedLive(tmp_path / "f", every_s=0)


def test_decoders_sharing_a_directory_learn_from_each_other_losslessly(setup, tmp_path):  # noqa: F811
    model, tok, drafter, index, prompts, refs = setup
    shared = {n: SharedLive(tmp_path, name=n) for n in "ab"}
    decs = {
        n: DartDecoder(
            model, tok, drafter, index, tree="dart+mix", max_nodes=8, eos_token_ids=(), learn=True
        )
        for n in "ab"
    }
    alone = DartDecoder(model, tok, drafter, index, tree="dart+mix", max_nodes=8, eos_token_ids=())
    for prompt, ref in zip(prompts, refs):
        assert decs["a"].generate(prompt, max_new_tokens=24).tokens == ref
    shared["a"].sync(decs["a"].parts.live, "s")
    shared["b"].sync(decs["b"].parts.live, "s")
    assert decs["b"].parts.live.shared_count == 1 and len(decs["b"].parts.live) == 0
    taus = {"shared": [], "alone": []}
    for prompt, ref in zip(prompts, refs):
        res = decs["b"].generate(prompt, max_new_tokens=24)
        assert res.tokens == ref
        taus["shared"].append(res.stats.tau)
        res = alone.generate(prompt, max_new_tokens=24)
        taus["alone"].append(res.stats.tau)
    # b has served nothing of these before, yet drafts what a served
    assert np.mean(taus["shared"]) > np.mean(taus["alone"]), taus
    batch = decs["b"].generate_batch(prompts, max_new_tokens=24)
    assert [r.tokens for r in batch] == refs
    meta = NgramIndex(shared["a"].own_path("s")).metadata
    assert meta["live"]["held"] == len(decs["a"].parts.live)


def test_a_scope_dropped_as_least_recently_used_takes_its_delta(tmp_path):
    from dartcore.serve.scopes import LiveScopes

    share = SharedLive(tmp_path, name="w")
    scopes = LiveScopes(V, max_scopes=1, capacity=64, on_drop=share.forget)
    a = scopes.layer("scope:a")
    a.insert([1, 2, 3])
    share.sync(a, "scope:a")
    assert share.own_path("scope:a").exists()
    scopes.layer("scope:b")
    assert not share.own_path("scope:a").exists() and scopes.scopes() == ["scope:b"]


class _Pipe:
    """The worker's end of the front's pipe, keeping what the worker sends."""

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def test_workers_share_their_layers_through_a_directory(setup, tmp_path):  # noqa: F811
    from dartcore.engine import Engine
    from dartcore.sampling import SamplingParams
    from dartcore.serve.worker import Loaded, WorkerConfig, _Worker

    model, tok, drafter, index, prompts, refs = setup
    config = WorkerConfig(
        learn=True, learn_scope="shared", learn_shared=str(tmp_path), learn_shared_every=3600.0
    )

    def worker(shared: bool):
        dec = DartDecoder(
            model, tok, drafter, index, tree="dart+mix", max_nodes=8, eos_token_ids=()
        )
        loaded = Loaded(
            engine=Engine(dec, max_batch=2, budget=8), tokenizer=tok, context_length=256
        )
        return _Worker(_Pipe(), config if shared else WorkerConfig(learn=True), loaded)

    def serve(w, tag):
        for i, p in enumerate(prompts):
            request = {"kind": "completion", "prompt": p, "max_tokens": 24, "echo": False}
            w.add(f"{tag}{i}", {**request, "params": SamplingParams(), "scope": "anonymous"})
        while w.engine.has_unfinished():
            w.step()
        done = {i["rid"]: i for m in w.conn.sent if m[0] == "step" for i in m[1] if i["finished"]}
        return [done[f"{tag}{i}"] for i in range(len(prompts))]

    a, b, alone = worker(True), worker(True), worker(False)
    try:
        first = serve(a, "a")
        assert [r["completion_tokens"] for r in first] == [24] * len(prompts)
        la = a.scopes.layer("anonymous")
        a.shared.sync(la, "shared", force=True)
        lb = b.scopes.layer("anonymous")
        b.shared.sync(lb, "shared")
        assert lb.shared_count == 1 and lb.inserted == 0
        got, base = serve(b, "b"), serve(alone, "c")
        assert [r["text"] for r in got] == [r["text"] for r in base] == [r["text"] for r in first]
        # b never served these prompts, yet drafts what a served
        tau = {k: np.mean([r["stats"]["tau"] for r in rs]) for k, rs in (("b", got), ("c", base))}
        assert tau["b"] > tau["c"], tau
        a.handle(("clear", 1, None))
        assert not a.shared.own_path("shared").exists()
        b.shared.sync(lb, "shared")
        assert lb.shared_count == 0
    finally:
        for w in (a, b):
            w.shared.stop()


def test_two_servers_share_a_scope_through_a_directory(tmp_path):
    from serve_process import ServerProcess
    from test_live_scopes import MODEL, _args

    shared = tmp_path / "live"
    flags = ("--learn", "--learn-shared", str(shared), "--learn-shared-every", "0.2")
    servers = [
        ServerProcess(_args(*flags), env={"DART_FAKE_STEP_S": "0"}, log_path=tmp_path / f"{i}.log")
        for i in range(2)
    ]

    def stats(srv, scope):
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 9, "dart": {"stats": True}}
        body["dart"]["scope"] = scope
        status, out, _ = srv.post("/v1/completions", body)
        assert status == 200, out
        return out["dart"]["stats"]

    try:
        x, y = servers
        assert stats(x, "a")["live_tokens"] == 0  # x learns a's first request
        assert stats(y, "a")["live_shared"] in (0, 1)  # y's layer of a starts now
        assert stats(y, "b")["live_shared"] == 0
        deadline = time.monotonic() + 30
        while (s := stats(y, "a"))["live_shared"] != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s["live_shared"] == 1, "y reads x's delta of scope a"
        assert stats(y, "b")["live_shared"] == 0  # x has served nothing in scope b
    finally:
        for srv in servers:
            srv.stop()


def test_serve_refuses_sharing_without_learning(tmp_path, capsys):
    from dartcore.cli import dart_serve

    assert dart_serve.main(["--learn-shared", str(tmp_path)]) != 0
    assert "--learn-shared" in capsys.readouterr().err
    assert dart_serve.main(
        ["--learn", "--learn-shared", str(tmp_path), "--learn-shared-every", "0"]
    )
    assert "--learn-shared-every" in capsys.readouterr().err

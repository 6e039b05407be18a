"""Tenant scopes of dart-serve's live layers: parsing, isolation, sharing, the LRU bound, the
engine's per-request layers (greedy identity) and POST /v1/dart/live/clear over HTTP."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from dartcore.decoder import DartDecoder
from dartcore.live import DEFAULT_CAPACITY, LiveLayer
from dartcore.serve.protocol import APIError, parse_chat, parse_clear, parse_completion
from dartcore.serve.scopes import ANONYMOUS, LiveScopes
from serve_process import ServerProcess
from test_decoder_builders import setup  # noqa: F401 - the tiny target, drafter and index

MODEL = "fake-model"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_scope_from_the_body_the_api_key_or_anonymous():
    assert parse_chat(BODY, ("m",)).scope == ANONYMOUS
    named = {**BODY, "dart": {"scope": "team-a/eu.1"}}
    assert parse_chat(named, ("m",)).scope == "scope:team-a/eu.1"
    key = "sk-secret-123"
    a = parse_chat(BODY, ("m",), authorization=f"Bearer {key}").scope
    assert a.startswith("key:") and key not in a
    assert parse_chat(BODY, ("m",), authorization=f"bearer  {key} ").scope == a
    assert parse_chat(BODY, ("m",), authorization="Bearer sk-other").scope != a
    assert parse_chat(BODY, ("m",), authorization="Bearer ").scope == ANONYMOUS
    # a named scope wins over the key; completions read the same fields
    assert parse_chat(named, ("m",), authorization=f"Bearer {key}").scope == "scope:team-a/eu.1"
    comp = {"model": "m", "prompt": "x", "dart": {"scope": "b", "learn": False}}
    req = parse_completion(comp, ("m",))
    assert req.scope == "scope:b" and req.params.learn is False
    assert req.to_worker()["scope"] == "scope:b"
    # the id is a hash of the key, not the key (nor a plain SHA-256 of it)
    assert hashlib.sha256(key.encode()).hexdigest()[:32] != a[4:]


@pytest.mark.parametrize("bad", [7, "", "a b", "x" * 65, "a:b", "caf\u00e9", "tab\t", ["a"]])
def test_bad_scopes_are_a_400(bad):
    body = {**BODY, "dart": {"scope": bad}}
    with pytest.raises(APIError, match="scope") as err:
        parse_chat(body, ("m",))
    assert err.value.status == 400 and err.value.param == "dart.scope"


def test_clear_bodies():
    assert parse_clear(None) is None and parse_clear({}) is None
    assert parse_clear({"scope": "a"}) == "scope:a"
    assert parse_clear({"scope": "scope:a"}) == "scope:a"
    assert parse_clear({"scope": ANONYMOUS}) == ANONYMOUS
    key = parse_chat(BODY, ("m",), authorization="Bearer k").scope
    assert parse_clear({"scope": key}) == key
    for bad in ([], "a", {"scope": 5}, {"scope": "a b"}, {"scope": "key:zz"}, {"all": True}):
        with pytest.raises(APIError) as err:
            parse_clear(bad)
        assert err.value.status == 400


def test_tenant_layers_are_apart_and_shared_is_one():
    scopes = LiveScopes(100, max_scopes=4)
    a, b = scopes.layer("scope:a"), scopes.layer("scope:b")
    assert a is not b and scopes.layer("scope:a") is a
    a.learn([1, 2, 3], [4, 5, 6])
    assert len(a) == 6 and len(b) == 0
    assert b.suffix_match([1, 2, 3], 3).size == 0
    assert a.suffix_match([1, 2, 3], 3).tolist() == [4, 5, 6]
    shared = LiveScopes(100, mode="shared")
    assert shared.layer("scope:a") is shared.layer("key:x") is shared.layer(ANONYMOUS)
    assert shared.scopes() == ["shared"] and shared.capacity == DEFAULT_CAPACITY
    assert scopes.capacity == DEFAULT_CAPACITY // 4
    with pytest.raises(ValueError, match="mode"):
        LiveScopes(100, mode="global")
    with pytest.raises(ValueError, match="max_scopes"):
        LiveScopes(100, max_scopes=0)


def test_least_recently_used_scopes_are_dropped_whole():
    scopes = LiveScopes(100, max_scopes=2, capacity=50)
    a = scopes.layer("a")
    a.insert([1, 2, 3])
    scopes.layer("b").insert([4, 5])
    scopes.layer("a")  # a is now the most recent
    scopes.layer("c")
    assert scopes.scopes() == ["a", "c"] and scopes.evicted == 1
    assert scopes.layer("a") is a and len(a) == 3 and a.capacity == 50
    assert scopes.clear("a") == {"scopes": ["a"], "tokens": 3} and len(a) == 0
    assert scopes.clear("nothing") == {"scopes": [], "tokens": 0}
    scopes.layer("d").insert([7])
    assert scopes.clear() == {"scopes": ["c", "d"], "tokens": 1} and len(scopes) == 0


def test_engine_requests_learn_into_their_own_layer_greedy_unchanged(setup):  # noqa: F811
    from dartcore.engine import Engine
    from dartcore.sampling import SamplingParams

    model, tok, drafter, index, prompts, refs = setup
    dec = DartDecoder(model, tok, drafter, index, tree="suffix", max_nodes=8, eos_token_ids=())
    engine = Engine(dec, max_batch=4, budget=8)
    a, b = LiveLayer(64), LiveLayer(64)

    def run(jobs):
        for rid, prompt, live in jobs:
            engine.add_request(prompt, SamplingParams(max_new_tokens=24), rid, live=live)
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
        return outs

    first = run([(f"a{i}", p, a) for i, p in enumerate(prompts)])
    assert [first[f"a{i}"].tokens for i in range(len(prompts))] == refs
    assert a.inserted == sum(len(p) + 24 for p in prompts) and b.inserted == 0
    again = run([(f"A{i}", p, a) for i, p in enumerate(prompts)])
    other = run([(f"B{i}", p, b) for i, p in enumerate(prompts)])
    assert [again[f"A{i}"].tokens for i in range(len(prompts))] == refs
    assert [other[f"B{i}"].tokens for i in range(len(prompts))] == refs
    # A's served continuations come back as whole chains; B never saw them
    tau_a = [again[f"A{i}"].stats["tau"] for i in range(len(prompts))]
    tau_b = [other[f"B{i}"].stats["tau"] for i in range(len(prompts))]
    assert min(tau_a) > 2.0 and np.mean(tau_a) > np.mean(tau_b)
    assert [first[f"a{i}"].stats["tau"] for i in range(len(prompts))] == tau_b
    assert dec.parts.live is None
    with pytest.raises(TypeError, match="LiveLayer"):
        engine.add_request(prompts[0], live=True)


def _args(*extra: str, workers: int = 1) -> list[str]:
    return [
        "--engine-factory",
        "serve_fake:load",
        "--served-model-name",
        MODEL,
        "--workers",
        str(workers),
        "--max-seq-len",
        "400",
        *extra,
    ]


def _live_tokens(server, prompt: str, *, scope=None, key=None) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 9, "dart": {"stats": True}}
    if scope is not None:
        body["dart"]["scope"] = scope
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    status, out, _ = server.post("/v1/completions", body, headers=headers)
    assert status == 200, out
    return out["dart"]["stats"]["live_tokens"]


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    srv = ServerProcess(
        # requests one at a time all go to worker 0 (the least loaded, lowest index)
        _args("--learn", "--learn-scopes", "3", "--learn-capacity", "5000", workers=2),
        env={"DART_FAKE_STEP_S": "0"},
        log_path=tmp_path_factory.mktemp("serve") / "server.log",
    )
    yield srv
    srv.stop()


def test_http_scopes_do_not_see_each_other_and_clear(tenant_server):
    srv = tenant_server
    assert srv.post("/v1/dart/live/clear")[0] == 200
    assert _live_tokens(srv, "hello", scope="a") == 0
    assert _live_tokens(srv, "hello", scope="a") == 5 + 9  # a's first prompt and output
    assert _live_tokens(srv, "hello", scope="b") == 0
    assert _live_tokens(srv, "hello", key="sk-1") == 0
    assert _live_tokens(srv, "hello", key="sk-1") == 14
    assert _live_tokens(srv, "hello", key="sk-2") == 0  # the fourth scope: a goes (LRU)
    assert _live_tokens(srv, "hello", scope="a") == 0  # and back: b goes
    status, out, _ = srv.post("/v1/dart/live/clear", {"scope": "b"})
    assert status == 200 and out["scopes"] == [] and out["tokens"] == 0
    status, out, _ = srv.post("/v1/dart/live/clear", {"scope": "a"})
    assert status == 200 and out["scopes"] == ["scope:a"] and out["tokens"] == 14
    assert _live_tokens(srv, "hello", scope="a") == 0
    status, out, _ = srv.post("/v1/dart/live/clear")
    assert (
        status == 200 and out["scope"] is None and out["tokens"] == 29 + 14 + 14
    )  # sk-1: two documents and a separator
    assert len(out["scopes"]) == 3 and "scope:a" in out["scopes"]
    assert all(s.startswith("key:") and "sk-" not in s for s in out["scopes"] if s != "scope:a")
    assert [w["worker"] for w in out["workers"]] == [0, 1]  # every worker is reached
    assert out["workers"][1] == {"worker": 1, "scopes": [], "tokens": 0}
    # an opted-out request reads its scope but leaves nothing in it
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "dart": {"learn": False}}
    assert srv.post("/v1/completions", body)[0] == 200
    assert srv.post("/v1/dart/live/clear")[1]["tokens"] == 0


def test_http_clear_refuses_bad_input(tenant_server):
    srv = tenant_server
    status, out, _ = srv.request("GET", "/v1/dart/live/clear")
    assert status == 405 and out["error"]["type"] == "invalid_request_error"
    for body, raw in (({"scope": 5}, None), ([1], None), ({"all": True}, None), (None, b"{x")):
        status, out, _ = srv.post("/v1/dart/live/clear", body, raw=raw)
        assert status == 400 and out["error"]["message"], out
    body = {"model": MODEL, "prompt": "x", "dart": {"scope": "two words"}}
    status, out, _ = srv.post("/v1/completions", body)
    assert status == 400 and out["error"]["param"] == "dart.scope"
    assert srv.get("/health")[0] == 200


def test_http_shared_mode_shares_and_no_learn_has_nothing_to_clear(tmp_path):
    srv = ServerProcess(
        _args("--learn", "--learn-scope", "shared"),
        env={"DART_FAKE_STEP_S": "0"},
        log_path=tmp_path / "shared.log",
    )
    try:
        assert _live_tokens(srv, "hello", scope="a") == 0
        assert _live_tokens(srv, "hello", key="sk-9") == 14
        status, out, _ = srv.post("/v1/dart/live/clear", {"scope": "anything"})
        assert status == 200 and out["scopes"] == ["shared"] and out["tokens"] == 29
    finally:
        srv.stop()
    plain = ServerProcess(_args(), env={"DART_FAKE_STEP_S": "0"}, log_path=tmp_path / "p.log")
    try:
        status, out, _ = plain.post("/v1/dart/live/clear")
        assert status == 400 and out["error"]["code"] == "learn_disabled"
    finally:
        plain.stop()


class _Pipe:
    """The worker's end of the front's pipe, keeping what the worker sends."""

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def test_a_worker_gives_the_real_engine_each_scope_its_layer(setup):  # noqa: F811
    from dartcore.engine import Engine
    from dartcore.sampling import SamplingParams
    from dartcore.serve.worker import Loaded, WorkerConfig, _Worker

    model, tok, drafter, index, prompts, refs = setup
    dec = DartDecoder(model, tok, drafter, index, tree="suffix", max_nodes=8, eos_token_ids=())
    loaded = Loaded(engine=Engine(dec, max_batch=2, budget=8), tokenizer=tok, context_length=256)
    pipe = _Pipe()
    worker = _Worker(pipe, WorkerConfig(learn=True, learn_scopes=2), loaded)
    for rid, scope in (("r0", "scope:a"), ("r1", "key:" + "0" * 32)):
        request = {"kind": "completion", "prompt": prompts[0], "max_tokens": 24, "echo": False}
        worker.add(rid, {**request, "params": SamplingParams(), "scope": scope})
    while worker.engine.has_unfinished():
        worker.step()
    done = {i["rid"]: i for m in pipe.sent if m[0] == "step" for i in m[1] if i["finished"]}
    assert done["r0"]["completion_tokens"] == done["r1"]["completion_tokens"] == 24
    a, k = (worker.scopes.layer(s) for s in ("scope:a", "key:" + "0" * 32))
    assert a is not k and a.inserted == k.inserted == len(prompts[0]) + 24
    assert a.suffix_match(prompts[0], 24).tolist() == refs[0]
    worker.handle(("clear", 7, None))
    assert pipe.sent[-1] == (
        "cleared",
        7,
        {"scopes": ["scope:a", "key:" + "0" * 32], "tokens": 2 * (len(prompts[0]) + 24)},
    )
    assert len(worker.scopes) == 0 and a.inserted == 0

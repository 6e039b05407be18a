"""dart-serve's HTTP and worker layers against a deterministic test engine (tests/serve_fake.py):
the OpenAI wire format (checked with the real openai client), errors, the queue bound,
disconnects, a worker killed with SIGKILL, and SIGTERM draining. The real Engine is tested
end to end in test_serve_smollm2.py."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from serve_fake import chat_prompt, reply_text
from serve_process import ServerProcess, metric

openai = pytest.importorskip("openai")

MODEL = "fake-model"


def _args(**kw) -> list[str]:
    opts = {
        "--engine-factory": "serve_fake:load",
        "--served-model-name": MODEL,
        "--workers": "2",
        "--max-batch": "2",
        "--max-queue": "2",
        "--max-seq-len": "400",
        **kw,
    }
    return [x for k, v in opts.items() for x in (k, v)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        _args(),
        env={"DART_FAKE_STEP_S": "0.01"},
        log_path=tmp_path_factory.mktemp("serve") / "server.log",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_completion_text_usage_and_finish_reason(client):
    resp = client.completions.create(model=MODEL, prompt="Hello there, server", max_tokens=40)
    want = reply_text(_ids("Hello there, server"))[:40]
    assert resp.choices[0].text == want
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len("Hello there, server")
    assert resp.usage.completion_tokens == 40
    assert resp.usage.total_tokens == 40 + len("Hello there, server")
    assert resp.object == "text_completion" and resp.model == MODEL


def test_completion_token_prompt_and_echo(client):
    ids = _ids("abc def")
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, echo=True)
    assert resp.choices[0].text == "abc def" + reply_text(ids)[:10]


def test_chat_uses_the_chat_template_stream_equals_non_stream(client):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    want = reply_text(chat_prompt(messages))[:50]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50)
    assert resp.choices[0].message.content == want
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(chat_prompt(messages))
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=50,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 50
    assert len([c for c in chunks if c.choices]) > 3  # it streamed, several chunks


def test_completion_stream(client):
    chunks = list(
        client.completions.create(model=MODEL, prompt="stream me", max_tokens=25, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == reply_text(_ids("stream me"))[:25]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_end_the_text_before_them(client):
    prompt = "Tell me about foxes"
    full = reply_text(_ids(prompt))
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=200, stop=["lazy", "zzz"]
    )
    assert resp.choices[0].text == full[: full.index("lazy")]
    assert resp.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=200,
            stop="brown",
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    chat_full = reply_text(chat_prompt([{"role": "user", "content": "x"}]))
    assert text == chat_full[: chat_full.index("brown")]


def test_sampling_arguments_reach_the_engine(client):
    resp = client.completions.create(
        model=MODEL, prompt="p", max_tokens=30, temperature=0.7, top_p=0.9, seed=7
    )
    assert resp.choices[0].text == reply_text(_ids("p"), 0.7, 7)[:30]


def test_stats_on_request_by_body_or_header(client, server):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=9,
        extra_body={"dart": {"stats": True}},
    )
    dart = resp.model_extra["dart"]
    assert dart["stats"]["rounds"] == 3 and dart["stats"]["accept_hist"] == [0, 0, 3]
    assert dart["worker"] in (0, 1) and dart["latency_s"] >= dart["ttft_s"] > 0
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=9
    )
    assert "dart" not in (plain.model_extra or {})
    status, body, _ = server.post(
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 6},
        headers={"X-Dart-Stats": "1"},
    )
    assert status == 200 and body["dart"]["stats"]["rounds"] == 2


def test_models_health_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = server.health()
    assert health["status"] == "ok" and len(health["workers"]) == 2
    assert all(w["ready"] and w["pid"] for w in health["workers"])
    client.completions.create(model=MODEL, prompt="count me", max_tokens=12)
    text = server.metrics()
    for family in (
        "dart_requests_total",
        "dart_generation_tokens_total",
        "dart_tau",
        "dart_accepted_tokens",
        "dart_budget_nodes",
        "dart_stage_seconds_total",
        "dart_queue_depth",
        "dart_engine_steps_total",
        "dart_time_to_first_token_seconds",
        "dart_request_seconds",
        "dart_worker_restarts_total",
    ):
        assert f"# TYPE {family} " in text, family
    done = sum(
        metric(text, "dart_requests_total", worker=w, endpoint="completion", status=200)
        for w in (0, 1)
    )
    assert done >= 1
    tokens = sum(metric(text, "dart_generation_tokens_total", worker=w) for w in (0, 1))
    rounds = sum(metric(text, "dart_verify_rounds_total", worker=w) for w in (0, 1))
    assert tokens > 0 and rounds > 0
    # The fake commits 3 tokens a round: tau = 3 except for a request's shorter last round.
    taus = [metric(text, "dart_tau", worker=w) for w in (0, 1)]
    assert all(0 < t <= 3 for t in taus if t)
    buckets = metric(text, "dart_budget_nodes_bucket", worker=0, le=4) + metric(
        text, "dart_budget_nodes_bucket", worker=1, le=4
    )
    assert buckets == rounds  # every round of the fake chose 4 nodes


BAD = [
    (
        "malformed JSON",
        "/v1/completions",
        b'{"model": "fake-model", "prompt": ',
        None,
        "invalid_json",
    ),
    ("not an object", "/v1/completions", b"[1, 2]", None, None),
    (
        "unknown model",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
        "model",
        "model_not_found",
    ),
    ("missing model", "/v1/completions", {"prompt": "x"}, "model", None),
    (
        "max_tokens 0",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 0},
        "max_tokens",
        None,
    ),
    (
        "max_tokens negative",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
        "max_tokens",
        None,
    ),
    (
        "max_tokens not int",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": "ten"},
        "max_tokens",
        None,
    ),
    (
        "max_tokens past the context",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 400},
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "prompt longer than the context",
        "/v1/completions",
        {"model": MODEL, "prompt": "y" * 401, "max_tokens": 1},
        "prompt",
        "context_length_exceeded",
    ),
    (
        "chat prompt longer than the context",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "z" * 500}]},
        "messages",
        "context_length_exceeded",
    ),
    (
        "temperature < 0",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "temperature": -0.5},
        "temperature",
        None,
    ),
    ("top_p 0", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p", None),
    (
        "unknown field",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "frobnicate": 1},
        "frobnicate",
        "unknown_parameter",
    ),
    ("n > 1", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, "n", None),
    (
        "five stop strings",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stop": list("abcde")},
        "stop",
        None,
    ),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, "messages", None),
    (
        "bad role",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role",
        None,
    ),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, "prompt", None),
    ("seed not int", "/v1/completions", {"model": MODEL, "prompt": "x", "seed": 1.5}, "seed", None),
    (
        "stream not bool",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stream": "yes"},
        "stream",
        None,
    ),
    (
        "bad dart extension",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "dart": {"stats": 1}},
        "dart",
        None,
    ),
]


@pytest.mark.parametrize("what,path,body,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_openai_error_and_the_server_keeps_serving(
    server, what, path, body, param, code
):
    raw = body if isinstance(body, bytes) else None
    status, resp, _ = server.post(path, None if raw else body, raw=raw)
    assert status == 400, (what, resp)
    err = resp["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    # streaming requests are refused the same way, before any event
    if isinstance(body, dict) and "stream" not in body:
        status, resp, _ = server.post(path, {**body, "stream": True})
        assert status == 400 and resp["error"]["param"] == param
    ok, resp, _ = server.post(
        "/v1/completions", {"model": MODEL, "prompt": "still there?", "max_tokens": 5}
    )
    assert ok == 200 and resp["choices"][0]["text"] == reply_text(_ids("still there?"))[:5]


def test_a_body_past_8_mib_is_refused_with_413(server):
    import socket

    # Refused on its Content-Length, before the body is read.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(9 << 20).encode() + b"\r\n\r\n" + b'{"model": "x", '
        )
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert (
        server.post("/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2})[0] == 200
    )


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 400 and "nope" in str(info.value)


def test_unknown_route_is_an_openai_404(server):
    status, body, _ = server.post("/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}


def _stream_open(server, body: dict) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({**body, "stream": True}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    resp._test_conn = conn  # keep the connection alive with the response
    return resp


def _read_event(resp) -> dict:
    while True:
        line = resp.fp.readline().decode()
        if line.startswith("data: "):
            return json.loads(line[6:])


def test_disconnect_aborts_the_generation(server):
    before = server.metrics()
    resp = _stream_open(server, {"model": MODEL, "prompt": "long one", "max_tokens": 390})
    first = _read_event(resp)
    assert first["choices"][0]["text"]
    resp._test_conn.sock.close()
    resp.close()
    # The engine drops it: nothing left running or waiting, and it counts as a 499.
    server.wait_healthy(
        lambda h: all(
            w["inflight"] == 0 and w["running"] == 0 and w["waiting"] == 0 for w in h["workers"]
        ),
        timeout=30,
    )
    after = server.metrics()
    aborted = sum(
        metric(after, "dart_requests_total", worker=w, endpoint="completion", status=499)
        - metric(before, "dart_requests_total", worker=w, endpoint="completion", status=499)
        for w in (0, 1)
    )
    assert aborted == 1
    # 390 tokens at 3 a step would take 130 steps: the generation stopped well before.
    generated = sum(
        metric(after, "dart_engine_steps_total", worker=w)
        - metric(before, "dart_engine_steps_total", worker=w)
        for w in (0, 1)
    )
    assert generated < 120


def test_disconnect_aborts_a_non_streaming_generation(server):
    import socket

    before = server.metrics()
    body = json.dumps({"model": MODEL, "prompt": "nobody waits", "max_tokens": 380}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    server.wait_healthy(lambda h: h["inflight"] == 1, timeout=30)
    sock.close()
    server.wait_healthy(
        lambda h: all(w["inflight"] == 0 and w["running"] == 0 for w in h["workers"]), timeout=30
    )
    after = server.metrics()
    aborted = sum(
        metric(after, "dart_requests_total", worker=w, endpoint="completion", status=499)
        - metric(before, "dart_requests_total", worker=w, endpoint="completion", status=499)
        for w in (0, 1)
    )
    assert aborted == 1
    steps = sum(
        metric(after, "dart_engine_steps_total", worker=w)
        - metric(before, "dart_engine_steps_total", worker=w)
        for w in (0, 1)
    )
    assert steps < 120  # 380 tokens would take 127 steps


def test_full_queue_answers_429_with_retry_after(tmp_path):
    # 1 worker, batch 1, queue 1: two requests fit, the third is refused.
    srv = ServerProcess(
        _args(**{"--workers": "1", "--max-batch": "1", "--max-queue": "1"}),
        env={"DART_FAKE_STEP_S": "0.05"},
        log_path=tmp_path / "server.log",
    )
    try:
        held = [
            _stream_open(srv, {"model": MODEL, "prompt": f"hold {i}", "max_tokens": 300})
            for i in range(1)
        ]
        results = {}

        def queued():  # waits behind the first for its batch slot
            results["queued"] = srv.post(
                "/v1/completions", {"model": MODEL, "prompt": "q", "max_tokens": 3}
            )

        t = threading.Thread(target=queued)
        t.start()
        srv.wait_healthy(lambda h: h["inflight"] == 2, timeout=30)
        status, body, headers = srv.post(
            "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3}
        )
        assert status == 429, body
        assert (
            body["error"]["type"] == "rate_limit_error"
            and body["error"]["code"] == "rate_limit_exceeded"
        )
        assert int(headers["Retry-After"]) >= 1
        assert metric(srv.metrics(), "dart_requests_rejected_total") == 1
        for r in held:
            r._test_conn.sock.close()
            r.close()
        t.join(60)
        assert (
            results["queued"][0] == 200
            and results["queued"][1]["choices"][0]["text"] == reply_text(_ids("q"))[:3]
        )
        assert (
            srv.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3})[0] == 200
        )
    finally:
        srv.stop()


def test_kill_9_of_a_worker_fails_its_requests_only_and_it_is_restarted(tmp_path):
    srv = ServerProcess(_args(), env={"DART_FAKE_STEP_S": "0.05"}, log_path=tmp_path / "server.log")
    try:
        pids = srv.worker_pids()
        # Two long streams: least-loaded dispatch puts one on each worker.
        a = _stream_open(srv, {"model": MODEL, "prompt": "on worker 0", "max_tokens": 120})
        b = _stream_open(srv, {"model": MODEL, "prompt": "on worker 1", "max_tokens": 120})
        _read_event(a)
        first_b = _read_event(b)["choices"][0]["text"]
        assert [w["inflight"] for w in srv.health()["workers"]] == [1, 1]
        os.kill(pids[0], signal.SIGKILL)
        # a was on worker 0 (dispatched first, ties go to the lower index): it ends with an error event.
        events = []
        while True:
            line = a.fp.readline().decode()
            if not line:
                break
            if line.startswith("data: "):
                events.append(line[6:].strip())
        assert events[-1] != "[DONE]"
        err = json.loads(events[-1])["error"]
        assert err["code"] == "worker_died" and "restarting" in err["message"]
        # b on the other worker is unaffected and finishes in full.
        text = [first_b]
        while True:
            line = b.fp.readline().decode()
            if line.startswith("data: [DONE]"):
                break
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                text.append(ev["choices"][0]["text"] if ev.get("choices") else "")
        assert "".join(text) == reply_text(_ids("on worker 1"))[:120]
        # While worker 0 restarts, requests go to worker 1.
        status, body, _ = srv.post(
            "/v1/completions", {"model": MODEL, "prompt": "meanwhile", "max_tokens": 4}
        )
        assert status == 200 and body["choices"][0]["text"] == reply_text(_ids("meanwhile"))[:4]
        h = srv.wait_healthy(
            lambda h: all(w["ready"] for w in h["workers"]) and h["workers"][0]["pid"] != pids[0],
            timeout=120,
        )
        assert h["workers"][0]["restarts"] == 1 and h["workers"][1]["pid"] == pids[1]
        assert metric(srv.metrics(), "dart_worker_restarts_total", worker=0) == 1
        # A non-streaming request on the dying worker gets a 503 error body.
        c = _stream_open(srv, {"model": MODEL, "prompt": "long", "max_tokens": 300})
        _read_event(c)
        holder = [w["worker"] for w in srv.health()["workers"] if w["inflight"]][0]
        other = 1 - holder
        results = {}
        t = threading.Thread(
            target=lambda: results.setdefault(
                "r",
                srv.post(
                    "/v1/completions", {"model": MODEL, "prompt": "victim", "max_tokens": 300}
                ),
            )
        )
        t.start()
        srv.wait_healthy(lambda h: h["workers"][other]["inflight"] == 1, timeout=30)
        os.kill(srv.health()["workers"][other]["pid"], signal.SIGKILL)
        t.join(60)
        status, body, _ = results["r"]
        assert (
            status == 503
            and body["error"]["code"] == "worker_died"
            and body["error"]["type"] == "server_error"
        )
        c._test_conn.sock.close()
    finally:
        srv.stop()


def test_sigterm_drains_requests_in_flight_then_exits(tmp_path):
    srv = ServerProcess(_args(), env={"DART_FAKE_STEP_S": "0.05"}, log_path=tmp_path / "server.log")
    pids = srv.worker_pids()
    results = {}

    def long_request():
        results["r"] = srv.post(
            "/v1/completions", {"model": MODEL, "prompt": "drain me", "max_tokens": 60}
        )

    t = threading.Thread(target=long_request)
    t.start()
    srv.wait_healthy(lambda h: h["inflight"] == 1, timeout=30)
    srv.terminate()
    t.join(60)
    status, body, _ = results["r"]
    assert status == 200 and body["choices"][0]["text"] == reply_text(_ids("drain me"))[:60]
    # uvicorn re-raises the SIGTERM it handled once shut down, so the exit status says "terminated".
    assert srv.proc.wait(60) in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log()
    time.sleep(0.5)
    for pid in pids:  # the workers are gone too
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(OSError):
        srv.get("/health")
    srv.stop()


def test_a_worker_that_cannot_load_stops_the_server_with_its_error(tmp_path):
    from serve_process import REPO, TESTS, free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), str(TESTS)]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dartcore.cli.dart_serve",
            "--engine-factory",
            "serve_fake:load_broken",
            "--port",
            str(free_port()),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert (
        "dart-serve: the server did not start (a worker could not start: FileNotFoundError: no drafter at "
        "/nonexistent"
    ) in proc.stderr


def test_bad_paths_are_refused_before_any_worker_starts():
    from serve_process import REPO, free_port

    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dartcore.cli.dart_serve",
            "--index",
            "/nonexistent.idx",
            "--port",
            str(free_port()),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        "dart-serve: error: MissingFileError: --index /nonexistent.idx does not exist"
        in proc.stderr
    )
    proc = subprocess.run(
        [sys.executable, "-m", "dartcore.cli.dart_serve", "--budget", "-1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        proc.returncode == 2 and "--budget must be 'adaptive' or a node count >= 0" in proc.stderr
    )

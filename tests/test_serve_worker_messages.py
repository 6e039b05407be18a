"""What a dart-serve worker sends the front per engine step (dartcore.serve.worker): a
request's first token at once; a streamed request's new text at most every stream_interval
seconds, whose pieces join to exactly its final text; a request that is not streamed nothing
more until it finishes; the counters only when the load changes, a request finishes or
SNAPSHOT_EVERY passes. Run against the fake engine of serve_fake.py (3 tokens a step, no
sleep), on the worker object itself (no processes)."""

from __future__ import annotations

import pytest

from dartcore.sampling import SamplingParams
from dartcore.serve import worker as worker_mod
from dartcore.serve.worker import Loaded, WorkerConfig, _Worker
from serve_fake import TOKENS_PER_STEP, CharTokenizer, FakeEngine, reply_text


class _Pipe:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def _worker(**config) -> tuple[_Worker, _Pipe]:
    loaded = Loaded(engine=FakeEngine(4, 0.0), tokenizer=CharTokenizer(), context_length=512)
    pipe = _Pipe()
    return _Worker(pipe, WorkerConfig(**config), loaded), pipe


def _add(worker: _Worker, rid: str, prompt: str, max_tokens: int, stream: bool) -> None:
    request = {"kind": "completion", "prompt": prompt, "max_tokens": max_tokens, "echo": False}
    worker.add(rid, {**request, "params": SamplingParams(), "stream": stream})


def _run(worker: _Worker) -> int:
    steps = 0
    while worker.engine.has_unfinished():
        worker.step()
        steps += 1
    return steps


def _items(pipe: _Pipe, rid: str) -> list[dict]:
    return [i for m in pipe.sent if m[0] == "step" for i in m[1] if i["rid"] == rid]


def _want(prompt: str, max_tokens: int) -> str:
    return reply_text([ord(c) for c in prompt])[:max_tokens]


def test_a_request_not_streamed_sends_its_first_token_and_its_end_only():
    worker, pipe = _worker()
    _add(worker, "a", "hello", 30, stream=False)
    steps = _run(worker)
    assert steps == 30 // TOKENS_PER_STEP
    items = _items(pipe, "a")
    assert [i["finished"] for i in items] == [False, True]
    assert items[0]["delta"] == "" and items[0]["completion_tokens"] == TOKENS_PER_STEP
    assert items[1]["text"] == _want("hello", 30) and items[1]["completion_tokens"] == 30
    # the steps between sent nothing at all: one message per item
    assert len([m for m in pipe.sent if m[0] == "step"]) == 2


@pytest.mark.parametrize("interval", [0.0, 1e9])
def test_a_streamed_request_s_pieces_join_to_its_text_at_any_interval(interval):
    worker, pipe = _worker(stream_interval=interval)
    _add(worker, "s", "stream me", 31, stream=True)
    steps = _run(worker)
    items = _items(pipe, "s")
    assert "".join(i["delta"] for i in items) == items[-1]["text"] == _want("stream me", 31)
    assert sum(i["new"] for i in items) == 31  # each item's new tokens: since the one before
    assert [i["finished"] for i in items][-1] and not any(i["finished"] for i in items[:-1])
    # interval 0: every step; an interval longer than the run: the first token and the end
    assert len(items) == (steps if interval == 0 else 2)
    assert items[0]["delta"] == _want("stream me", TOKENS_PER_STEP)


def test_the_stream_interval_holds_text_back_until_it_passes(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(worker_mod.time, "monotonic", lambda: clock[0])
    worker, pipe = _worker(stream_interval=0.05)
    _add(worker, "s", "tick", 60, stream=True)
    sent_at = []
    while worker.engine.has_unfinished():
        before = len(_items(pipe, "s"))
        worker.step()
        if len(_items(pipe, "s")) > before:
            sent_at.append(clock[0])
        clock[0] += 0.02  # a step every 20 ms
    # the first step, then every third step (60 ms >= 50 ms), and the last one
    gaps = [round(b - a, 6) for a, b in zip(sent_at, sent_at[1:-1])]
    assert gaps and all(g == 0.06 for g in gaps)
    assert "".join(i["delta"] for i in _items(pipe, "s")) == _want("tick", 60)


def test_counters_go_out_when_the_load_changes_a_request_finishes_or_time_passes(monkeypatch):
    clock = [50.0]
    monkeypatch.setattr(worker_mod.time, "monotonic", lambda: clock[0])
    worker, pipe = _worker(stream_interval=0.0)
    _add(worker, "s", "count", 3 * TOKENS_PER_STEP * 4, stream=True)
    worker.step()  # the load changed (a request runs): counters go out
    assert pipe.sent[-1][2] is not None and pipe.sent[-1][2]["running"] == 1
    worker.step()  # same load, no time passed: text only
    assert pipe.sent[-1][2] is None
    clock[0] += worker_mod.SNAPSHOT_EVERY
    worker.step()
    assert pipe.sent[-1][2]["counters"]["steps"] == 3
    _run(worker)  # its last step finishes it: counters at once
    last = pipe.sent[-1]
    assert last[1][-1]["finished"] and last[2]["counters"]["finished"] == 1
    assert last[2]["running"] == 0


@pytest.mark.parametrize("value", ["-0.1", "11", "nan"])
def test_dart_serve_refuses_a_stream_interval_out_of_range(value):
    from cli_helpers import run_cli

    r = run_cli("dart_serve", "--stream-interval", value, "--engine-factory", "serve_fake:load")
    assert r.returncode == 2 and "--stream-interval must be in [0, 10] seconds" in r.stderr

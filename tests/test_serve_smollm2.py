"""dart-serve end to end with the real Engine on SmolLM2-135M-Instruct (slow): the openai
client against a server with 2 workers on 127.0.0.1; greedy text equals
DartDecoder.generate on the same prompt (chat and completions, streaming and not); both
workers share one resident copy of the index (Pss from /proc/PID/smaps); a worker killed
with SIGKILL during a request is restarted while the other keeps answering."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import shutil
import signal
import threading
from pathlib import Path

import pytest

import dartcore
from serve_process import ServerProcess, metric

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
pytest.importorskip("dartcore.engine")

MAX_NEW = 24
WORKERS = 2


@pytest.fixture(scope="module")
def index_path(smollm2, tmp_path_factory):
    """An index of the target's own responses that ship with dartcore (the first 1,000)."""
    import numpy as np

    from dartcore.index import build_index
    from dartcore.tokenizers import fingerprint

    _, tok = smollm2
    corpus = Path(dartcore.__file__).parent / "assets" / "corpus" / "smollm2_responses.jsonl.gz"
    docs = []
    with gzip.open(corpus, "rt", encoding="utf-8") as fh:
        for line in itertools.islice(fh, 1000):
            text = "".join(
                m["content"] for m in json.loads(line)["messages"] if m["role"] == "assistant"
            )
            if text:
                docs.append(np.asarray(tok(text)["input_ids"] + [tok.eos_token_id], dtype=np.int64))
    out = tmp_path_factory.mktemp("serve-index") / "responses.idx"
    build_index(
        docs,
        out,
        vocab_size=len(tok),
        metadata={"tokenizer": {"name": "smollm2", "fingerprint": fingerprint(tok)}},
    )
    return out


@pytest.fixture(scope="module")
def server(index_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    srv = ServerProcess(
        [
            "--target",
            "smollm2",
            "--drafter",
            "smollm2",
            "--index",
            str(index_path),
            "--workers",
            str(WORKERS),
            "--max-batch",
            "4",
            "--max-seq-len",
            "1024",
            "--threads",
            "1",
        ],
        log_path=log,
        start_timeout=600,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def reference(smollm2, index_path, tmp_path_factory):
    """DartDecoder in this process, on a copy of the index (so this process's mapping does not
    share pages with the workers' and the Pss test sees exactly the workers)."""
    import torch

    from dartcore import DartDecoder
    from dartcore.drafter import DartDrafter
    from dartcore.index import NgramIndex

    torch.set_num_threads(1)
    model, tok = smollm2
    copy = tmp_path_factory.mktemp("serve-index-copy") / "copy.idx"
    shutil.copyfile(index_path, copy)
    drafter = DartDrafter.from_pretrained("smollm2", model, tokenizer=tok)
    return DartDecoder(model, tok, drafter, NgramIndex(copy), tree="dart")


def _index_mapping(pid: int, path) -> dict[str, int]:
    """Rss and Pss (kB) of every mapping of ``path`` in process ``pid``, summed."""
    target = os.path.realpath(path)
    out = {"Rss": 0, "Pss": 0}
    inside = False
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            fields = line.split()
            # a mapping's header: range perms offset dev inode path
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = len(fields) >= 6 and " ".join(fields[5:]) == target
            elif inside and fields and fields[0].rstrip(":") in out:
                out[fields[0].rstrip(":")] += int(fields[1])
    return out


def test_workers_share_one_resident_copy_of_the_index(server, index_path):
    size_kb = os.path.getsize(index_path) / 1024
    pids = server.worker_pids()
    assert len(pids) == WORKERS and len(set(pids)) == WORKERS
    for pid in pids:
        m = _index_mapping(pid, index_path)
        # prefaulted: all of it resident in each worker, each page shared by the two mappings
        assert m["Rss"] >= 0.95 * size_kb, (pid, m, size_kb)
        assert abs(m["Pss"] - size_kb / WORKERS) <= 0.05 * size_kb / WORKERS + 8, (pid, m, size_kb)


PROMPTS = ["Write a Python function that reverses a list.", "What is 17 * 23? Answer briefly."]


def test_chat_greedy_equals_dart_decoder_generate(client, reference):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    want = reference.generate(messages, max_new_tokens=MAX_NEW).text
    resp = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body={"dart": {"stats": True}},
    )
    assert resp.choices[0].message.content == want
    assert resp.usage.completion_tokens <= MAX_NEW
    stats = resp.model_extra["dart"]["stats"]
    assert stats  # the engine's per-request statistics came through
    chunks = list(
        client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=MAX_NEW, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_completion_greedy_equals_dart_decoder_generate(client, reference, server):
    prompt = PROMPTS[1]
    want = reference.generate(prompt, max_new_tokens=MAX_NEW).text
    resp = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=MAX_NEW, temperature=0
    )
    assert resp.choices[0].text == want
    chunks = list(
        client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want
    text = server.metrics()
    assert sum(metric(text, "dart_verify_rounds_total", worker=w) for w in range(WORKERS)) > 0


def test_kill_9_of_a_worker_during_a_request(server, client):
    pids = server.worker_pids()
    results = {}

    def long_request():
        try:
            # A chat request: as a bare completion prompt this one ends at once with EOS.
            client.chat.completions.create(
                model="smollm2",
                max_tokens=400,
                temperature=0,
                messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
            )
            results["victim"] = "finished"
        except openai.APIStatusError as exc:
            results["victim"] = exc

    t = threading.Thread(target=long_request)
    t.start()
    status = server.wait_healthy(lambda h: h["inflight"] == 1, timeout=120)
    victim = [w for w in status["workers"] if w["inflight"]][0]
    os.kill(victim["pid"], signal.SIGKILL)
    t.join(120)
    err = results["victim"]
    assert isinstance(err, openai.APIStatusError) and err.status_code == 503, err
    assert "worker_died" in str(err.body)
    # the other worker answers while the dead one reloads
    resp = client.completions.create(model="smollm2", prompt="Hello", max_tokens=4, temperature=0)
    assert resp.choices[0].text and resp.usage.completion_tokens >= 1
    h = server.wait_healthy(lambda h: all(w["ready"] for w in h["workers"]), timeout=300)
    new = h["workers"][victim["worker"]]
    assert new["pid"] != victim["pid"] and new["restarts"] == 1
    assert [w["pid"] for w in h["workers"] if w["worker"] != victim["worker"]] == [
        p for i, p in enumerate(pids) if i != victim["worker"]
    ]
    resp = client.completions.create(model="smollm2", prompt="Hello", max_tokens=4, temperature=0)
    assert resp.choices[0].text

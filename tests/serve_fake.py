"""A small deterministic engine and tokenizer for the HTTP-layer tests of dart-serve.

Test doubles that follow ENGINE_API.md (``add_request`` / ``step`` / ``abort`` /
``has_unfinished`` / ``num_waiting`` / ``num_running`` / ``stats``), so the
server's routing, streaming, queueing and failure handling are tested in
seconds; the real Engine is tested end to end in test_serve_smollm2.py.

The tokenizer is character level (token id = code point, 0 = EOS). The engine
answers every prompt with ``reply_text(prompt_ids)`` -- an independent formula
the tests recompute -- committing ``TOKENS_PER_STEP`` tokens per running
request per step, after sleeping ``$DART_FAKE_STEP_S`` seconds. A request given a live layer
(``--learn``) is learned into it when it finishes; its stats say how many tokens the layer held
when it came (``live_tokens``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from dartcore.errors import DartError
from dartcore.sampling import SamplingParams
from dartcore.serve.worker import Loaded

TOKENS_PER_STEP = 3
FILLER = "the quick brown fox jumps over the lazy dog; "
EOS = 0


def reply_text(prompt_ids: list[int], temperature: float = 0.0, seed: int | None = None) -> str:
    """What the fake model says: it quotes the prompt's last 12 characters, then the filler forever."""
    head = "You said: " + "".join(chr(t) for t in prompt_ids[-12:]) + ". "
    if temperature > 0 and seed is not None:
        head = f"[seed {seed}] " + head
    return head + FILLER * 64


class CharTokenizer:
    """Character-level stand-in for a Hugging Face tokenizer (only what the worker calls)."""

    eos_token_id = EOS

    def __len__(self) -> int:
        return 0x110000

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(t) for t in ids if not (skip_special_tokens and t == EOS))

    def apply_chat_template(
        self, messages, add_generation_prompt: bool = True, tokenize: bool = True
    ):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return [ord(c) for c in text] if tokenize else text


def chat_prompt(messages) -> list[int]:
    return CharTokenizer().apply_chat_template(messages)


@dataclass
class FakeOutput:
    request_id: str
    new_tokens: list
    tokens: list
    finished: bool
    finish_reason: str | None
    stats: dict
    text: str | None = None  # on the finished output: the text, cut before a stop string


@dataclass
class _Seq:
    rid: str
    reply: list
    params: SamplingParams
    tokens: list = field(default_factory=list)
    rounds: int = 0
    prompt: list = field(default_factory=list)
    live: object = None  # the request's live layer (dart-serve --learn)
    live_tokens: int = 0  # what that layer held when the request came
    live_shared: int = 0  # the other processes' deltas it read then (--learn-shared)


class FakeStats:
    def __init__(self):
        self.steps = 0
        self.rows = 0

    def as_dict(self) -> dict:
        return {
            "num_steps": self.steps,
            "rows_verified": self.rows,
            "seconds": {"verify": 0.001 * self.steps},
        }


class FakeEngine:
    def __init__(self, max_batch: int, step_s: float):
        self.max_batch = max_batch
        self.step_s = step_s
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.stats = FakeStats()
        self._n = 0

    def add_request(self, prompt_ids, params, request_id=None, *, live=None) -> str:
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be the engine's SamplingParams")
        self._n += 1
        rid = request_id or f"req-{self._n}"
        reply = [ord(c) for c in reply_text(list(prompt_ids), params.temperature, params.seed)]
        self.waiting.append(
            _Seq(
                rid=rid,
                reply=reply,
                params=params,
                prompt=list(prompt_ids),
                live=live,
                live_tokens=0 if live is None else len(live),
                live_shared=0 if live is None else live.shared_count,
            )
        )
        return rid

    def abort(self, rid: str) -> None:
        for queue in (self.waiting, self.running):
            for s in queue:
                if s.rid == rid:
                    queue.remove(s)
                    return
        raise DartError(f"unknown request id {rid!r}")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.running)

    def step(self) -> list[FakeOutput]:
        while self.waiting and len(self.running) < self.max_batch:
            self.running.append(self.waiting.pop(0))
        if self.step_s:
            time.sleep(self.step_s)
        outs = []
        for s in list(self.running):
            s.rounds += 1
            base = len(s.tokens)
            s.tokens.extend(s.reply[base : base + TOKENS_PER_STEP])
            reason, final = None, None
            text = "".join(chr(t) for t in s.tokens)
            hits = [(text.find(stop), stop) for stop in s.params.stop if stop in text]
            # like the real engine: the tokens run to the end of the stop string, the text stops before it
            if hits:
                cut, stop = min(hits)
                del s.tokens[cut + len(stop) :]
                reason, final = "stop", text[:cut]
            elif len(s.tokens) >= s.params.max_new_tokens:
                del s.tokens[s.params.max_new_tokens :]
                reason = "length"
                final = "".join(chr(t) for t in s.tokens)
            new = s.tokens[base:]
            accepted = max(0, len(new) - 1)
            outs.append(
                FakeOutput(
                    request_id=s.rid,
                    new_tokens=new,
                    tokens=list(s.tokens),
                    finished=reason is not None,
                    finish_reason=reason,
                    text=final,
                    stats={
                        "tau": TOKENS_PER_STEP * 1.0,
                        "rounds": s.rounds,
                        "accept_hist": [0] * accepted + [s.rounds],
                        "budget_hist": [0] * 4 + [s.rounds],
                        "live_tokens": s.live_tokens,
                        "live_shared": s.live_shared,
                    },
                )
            )
            if reason is not None:
                self.running.remove(s)
                if s.live is not None and s.params.learn:  # as the engine's _finish does
                    s.live.learn(s.prompt, s.tokens)
        self.stats.steps += 1
        self.stats.rows += len(outs)
        return outs


def load(config) -> Loaded:
    """The engine factory dart-serve's --engine-factory names (serve_fake:load)."""
    step_s = float(os.environ.get("DART_FAKE_STEP_S", "0.01"))
    return Loaded(
        engine=FakeEngine(config.max_batch, step_s),
        tokenizer=CharTokenizer(),
        context_length=config.max_seq_len or 512,
    )


def load_broken(config) -> Loaded:
    """An engine factory that fails the way a wrong --drafter path does."""
    raise FileNotFoundError("no drafter at /nonexistent (needs config.json and model.safetensors)")

"""A dart-serve worker process: one model, one batched engine, one mapping of the index.

The front talks to each worker over its own duplex ``multiprocessing`` pipe
(see :mod:`dartcore.serve.pool` for why). Messages, all tuples of plain data:

front -> worker
    ``("add", rid, request)``   a :meth:`GenRequest.to_worker` dict
    ``("abort", rid)``          the client went away: free the slot
    ``("clear", token, scope)``  drop the live layer of scope id ``scope`` (None: all)
    ``("exit",)``               finish nothing more, exit now (the front has drained)

worker -> front
    ``("ready", info)``         model loaded: pid, context length, model name
    ``("fatal", message)``      the model or index could not be loaded (bad configuration)
    ``("step", outputs, snapshot)``  after an engine step that has news: per-request deltas
                                (a streamed request's every step; one that is not streamed
                                only its first and its last) and the worker's load /
                                speculation counters (None between :data:`SNAPSHOT_EVERY`
                                seconds while the load holds and no request finishes)
    ``("error", rid, status, message, param, code)``  a request this worker refuses
    ``("cleared", token, result)``  what a clear dropped: scope ids and tokens

The loop is the engine's: take what the pipe holds, ``engine.step()``, push each request's
new text back. A step's message costs the front a wake-up while the next step runs on the
same cores, so a step sends only what a client reads: a request's first token at once (the
time to first token), a streamed request's new text at most every ``stream_interval``
seconds (:data:`STREAM_INTERVAL`; vLLM's ``stream_interval`` does the same in tokens),
nothing more of a request that is not streamed until it finishes, and the counters at most
every :data:`SNAPSHOT_EVERY` seconds unless the load changes. Tokenising, the chat template
and detokenising happen here, next to the model, so the front never loads a tokenizer.
"""

from __future__ import annotations

import importlib
import os
import signal
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any

from dartcore.errors import DartError
from dartcore.index import DECODE_PREFAULT, NgramIndex
from dartcore.live import SharedLive
from dartcore.prompts import TextStream, chat_ids, check_ids, decode, text_ids
from dartcore.sampling import DEFAULTS
from dartcore.serve.scopes import ANONYMOUS, LiveScopes

__all__ = [
    "SNAPSHOT_EVERY",
    "STREAM_INTERVAL",
    "WorkerConfig",
    "Loaded",
    "load_engine",
    "run_worker",
]

# Seconds a streamed request's new text may wait for the next steps' before it goes out (see
# WorkerConfig.stream_interval): each message wakes the front, whose HTTP write then runs
# beside the worker's next step; 20 ms is below what a reader of the stream notices.
STREAM_INTERVAL = 0.02

# Seconds between two snapshots of the counters while the worker's load (waiting, running)
# holds and no request finishes (a finish or a change of load sends one at once).
SNAPSHOT_EVERY = 0.25


@dataclass
class WorkerConfig:
    target: str = "smollm2"
    drafter: str | None = "smollm2"
    index: str | None = None
    tree: str = "dart"
    budget: str | int = "adaptive"  # the engine's: "adaptive" or a fixed node count (0 = AR)
    max_batch: int = 8
    # per-sequence KV capacity (the context requests are checked against)
    max_seq_len: int | None = 2048
    threads: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    # a GGUF target's weights: blocks or floats, and their numerics (None: load_target's defaults)
    quantized: bool | None = None
    numerics: str | None = None
    # fault the whole index in at start (every worker then maps one resident copy)
    prefault_index: bool = DECODE_PREFAULT
    default_max_tokens: int = DEFAULTS.max_new_tokens  # chat requests without max_tokens
    # a streamed request's text goes out at most every stream_interval seconds (its first
    # token and its end at once; 0: after every step)
    stream_interval: float = STREAM_INTERVAL
    tree_params: dict = field(default_factory=dict)
    # live n-gram layers that finished requests go into (dartcore.live), per worker: one per
    # tenant scope ("tenant", at most learn_scopes, least recently used evicted) or one for all
    # ("shared"), each of learn_capacity tokens (None: dartcore.serve.scopes.default_capacity)
    learn: bool = False
    learn_scope: str = "tenant"
    learn_scopes: int = 64
    learn_capacity: int | None = None
    # a directory through which the workers share their layers (dartcore.live.SharedLive):
    # each writes its delta of a scope every learn_shared_every seconds (sooner after
    # learn_shared_tokens new tokens) and reads the others' of that scope
    learn_shared: str | None = None
    learn_shared_every: float = 10.0
    learn_shared_tokens: int = 1 << 16
    # "module:function" returning a Loaded; the default loads the real model and Engine.
    engine_factory: str = "dartcore.serve.worker:load_engine"


@dataclass
class Loaded:
    engine: Any  # dartcore.engine.Engine (or anything following its contract)
    tokenizer: Any  # a Hugging Face tokenizer: __call__, decode, apply_chat_template
    context_length: int


def load_engine(config: WorkerConfig) -> Loaded:
    """The target, drafter and index as DartDecoder takes them, wrapped in the batched Engine."""
    import torch

    from dartcore.decoder import DartDecoder
    from dartcore.engine import Engine
    from dartcore.index import DECODE_VERIFY, NgramIndex
    from dartcore.models.hub import load_drafter, load_target

    torch.set_num_threads(config.threads)
    model, tok = load_target(
        config.target,
        dtype=getattr(torch, config.dtype),
        device=config.device,
        quantized=config.quantized,
        numerics=config.numerics,
    )
    drafter = None
    if config.drafter is not None and config.tree not in ("ar", "ngram-only"):
        drafter = load_drafter(config.drafter, model, tok)
    index = None
    if config.index is not None:
        index = NgramIndex(config.index, verify=DECODE_VERIFY, prefault=config.prefault_index)
    decoder = DartDecoder(
        model,
        tok,
        drafter,
        index,
        tree=config.tree,
        device=config.device,
        **config.tree_params,
    )
    engine = Engine(
        decoder, max_batch=config.max_batch, max_seq_len=config.max_seq_len, budget=config.budget
    )
    context = decoder.context_length
    if config.max_seq_len is not None:
        context = min(context, config.max_seq_len)
    return Loaded(engine=engine, tokenizer=tok, context_length=int(context))


def _factory(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class _RequestError(Exception):
    def __init__(
        self, message: str, param: str | None = None, code: str | None = None, status: int = 400
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


@dataclass
class _Live:
    prompt_tokens: int
    echo: str  # echo: the prompt text, which the response text starts with
    prefix_text: str = ""  # what of it is still to be streamed (before the first token)
    text: Any = None  # the request's TextStream (dartcore.prompts)
    stream: bool = True  # deltas every step; else only the first output and the last
    reported: bool = False  # the first output went to the front
    sent_at: float = 0.0  # time.monotonic() of its last output to the front
    sent_tokens: int = 0  # its tokens when that output went


class _Worker:
    def __init__(self, conn, config: WorkerConfig, loaded: Loaded):
        self.conn = conn
        self.config = config
        self.engine = loaded.engine
        self.tok = loaded.tokenizer
        self.context = loaded.context_length
        self.vocab = len(self.tok)
        self.live: dict[str, _Live] = {}
        # the live layers by scope: the worker's, handed to the engine request by request
        self.scopes: LiveScopes | None = None
        if config.learn:
            parts = getattr(self.engine, "parts", None)
            target_vocab = getattr(getattr(parts, "target", None), "vocab_size", 0)
            self.scopes = LiveScopes(
                max(self.vocab, int(target_vocab or 0)),
                mode=config.learn_scope,
                max_scopes=config.learn_scopes,
                capacity=config.learn_capacity,
            )
        self.shared: SharedLive | None = None
        if self.scopes is not None and config.learn_shared:
            self.shared = SharedLive(
                config.learn_shared,
                every_s=config.learn_shared_every,
                every_tokens=config.learn_shared_tokens,
                tokenizer=_index_tokenizer(config.index),
            )
            scopes = self.scopes
            scopes.on_drop = self.shared.forget
            self.shared.start(lambda: list(scopes.items()))
        self.draining = False
        # Counters the front turns into /metrics (cumulative since this process started).
        self.counters: dict[str, Any] = {"steps": 0, "step_s": 0.0, "finished": 0, "aborted": 0}
        self._load_sent: tuple[int, int] | None = None  # (waiting, running) of the last snapshot
        self._snapshot_at = 0.0  # time.monotonic() of the last snapshot

    # -- requests -----------------------------------------------------------------------

    def _prompt_ids(self, req: dict) -> tuple[list[int], str]:
        """The request's prompt as ids (dartcore.prompts, as the decoder and engine read
        prompts) and the echo text."""
        prompt = req["prompt"]
        what = "messages" if req["kind"] == "chat" else "prompt"
        if req["kind"] == "chat":
            try:
                ids = chat_ids(self.tok, prompt)
            except Exception as exc:  # noqa: BLE001 - a template that refuses these messages (jinja raise_exception)
                raise _RequestError(
                    f"messages: the model's chat template refused them: {exc}",
                    "messages",
                    "invalid_value",
                ) from exc
            echo = ""
        elif isinstance(prompt, str):
            ids, echo = text_ids(self.tok, prompt), prompt if req.get("echo") else ""
        else:
            ids, echo = (
                list(prompt),
                decode(self.tok, prompt, skip_special=False) if req.get("echo") else "",
            )
        try:
            return check_ids(ids, self.vocab, what), echo
        except ValueError as exc:
            raise _RequestError(
                str(exc).replace("empty prompt: ", ""), what, "invalid_value"
            ) from None

    def add(self, rid: str, req: dict) -> None:
        if self.draining:
            raise _RequestError(
                "the server is shutting down; retry on another instance", None, "shutting_down", 503
            )
        ids, prefix = self._prompt_ids(req)
        what = "messages" if req["kind"] == "chat" else "prompt"
        if len(ids) >= self.context:
            raise _RequestError(
                f"This model's maximum context length is {self.context} tokens. However, your "
                f"{what} is {len(ids)} tokens, which leaves no room for the completion. Please "
                f"reduce the length of the {what}.",
                what,
                "context_length_exceeded",
            )
        params = req["params"]
        max_tokens = req["max_tokens"]
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, self.context - len(ids))
        if len(ids) + max_tokens > self.context:
            raise _RequestError(
                f"This model's maximum context length is {self.context} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the {what}, {max_tokens} "
                f"in the completion). Please reduce the length of the {what} or the completion "
                "(max_tokens).",
                "max_tokens",
                "context_length_exceeded",
            )
        if params.max_new_tokens != max_tokens:
            params = replace(params, max_new_tokens=max_tokens)
        if self.scopes is None:
            self.engine.add_request(ids, params, request_id=rid)
        else:
            live = self.scopes.layer(req.get("scope", ANONYMOUS))
            self.engine.add_request(ids, params, request_id=rid, live=live)
        self.live[rid] = _Live(
            prompt_tokens=len(ids),
            echo=prefix,
            prefix_text=prefix,
            text=TextStream(self.tok, params.stop),
            stream=bool(req.get("stream", True)),
        )

    def abort(self, rid: str) -> None:
        if self.live.pop(rid, None) is None:
            return  # finished already (its last step crossed the abort in the pipe)
        self.counters["aborted"] += 1
        try:
            self.engine.abort(rid)
        except DartError:  # the engine finished it in the same step: nothing to free
            pass

    # -- the loop -----------------------------------------------------------------------

    def handle(self, msg) -> bool:
        """One message from the front; False on exit."""
        kind = msg[0]
        if kind == "add":
            rid = msg[1]
            try:
                self.add(rid, msg[2])
            except _RequestError as exc:
                self.conn.send(("error", rid, exc.status, exc.message, exc.param, exc.code))
            # the engine's own checks (e.g. ContextLengthError)
            except (DartError, ValueError, TypeError) as exc:
                self.conn.send(("error", rid, 400, str(exc), None, "invalid_value"))
            except Exception as exc:  # noqa: BLE001 - one request must not take the worker down
                self.conn.send(
                    ("error", rid, 500, f"{type(exc).__name__}: {exc}", None, "engine_error")
                )
        elif kind == "abort":
            self.abort(msg[1])
        elif kind == "clear":
            result = {"scopes": [], "tokens": 0}
            if self.scopes is not None:
                layers = dict(self.scopes.items())
                result = self.scopes.clear(msg[2])
                if self.shared is not None:
                    for sid in result["scopes"]:
                        self.shared.forget(sid, layers.get(sid))
            self.conn.send(("cleared", msg[1], result))
        elif kind == "exit":
            return False
        return True

    def step(self) -> None:
        t0 = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t0
        self.counters["steps"] += 1
        self.counters["step_s"] += dt
        sent = []
        finished = False
        now = time.monotonic()
        for out in outs:
            live = self.live.get(out.request_id)
            if live is None:
                continue  # aborted while it ran
            if not out.finished and live.reported:
                if not live.stream or now - live.sent_at < self.config.stream_interval:
                    continue  # its new text waits for a later step (not streamed: its end)
            live.reported, live.sent_at = True, now
            if not out.finished and not live.stream:
                delta = ""
            elif out.finished:
                # The engine's final text ends before a stop string (its tokens may run into it).
                text = getattr(out, "text", None)
                if text is None:
                    text = decode(self.tok, out.tokens)
                delta = live.text.finish(text)
            else:
                # held back: a partial character, a stop string's start
                delta = live.text.update(out.tokens)
            if live.prefix_text and live.stream:
                delta, live.prefix_text = live.prefix_text + delta, ""
            item = {
                "rid": out.request_id,
                "delta": delta,
                "new": len(out.tokens) - live.sent_tokens,  # since its last output
                "finished": bool(out.finished),
                "finish_reason": out.finish_reason,
                "prompt_tokens": live.prompt_tokens,
                "completion_tokens": len(out.tokens),
            }
            live.sent_tokens = len(out.tokens)
            if out.finished:
                item["text"] = live.echo + text
                item["stats"] = _plain(getattr(out, "stats", {}) or {})
                self.live.pop(out.request_id, None)
                self.counters["finished"] += 1
                finished = True
            sent.append(item)
        snap = self._due_snapshot(force=finished)
        if sent or snap is not None:
            self.conn.send(("step", sent, snap))

    def _due_snapshot(self, force: bool = False) -> dict | None:
        """The counters when a request finished (``force``), the load changed or
        :data:`SNAPSHOT_EVERY` seconds passed since the last ones went out; else None."""
        load = (int(self.engine.num_waiting()), int(self.engine.num_running()))
        now = time.monotonic()
        if not force and load == self._load_sent and now - self._snapshot_at < SNAPSHOT_EVERY:
            return None
        self._load_sent, self._snapshot_at = load, now
        return self.snapshot(load)

    def snapshot(self, load: tuple[int, int] | None = None) -> dict:
        """The worker's load (``load``: (waiting, running) when the caller read it already)
        and counters."""
        waiting, running = load or (int(self.engine.num_waiting()), int(self.engine.num_running()))
        return {
            "waiting": waiting,
            "running": running,
            "counters": _plain(self.counters),
            "engine": _engine_totals(self.engine),
        }

    def run(self) -> None:
        conn = self.conn
        while True:
            busy = self.engine.has_unfinished()
            if self.draining and not busy and not self.live:
                return
            try:
                # Idle: block on the pipe (1 s, to notice a SIGTERM). Busy: take what is there.
                if busy or conn.poll(1.0):
                    while conn.poll(0):
                        if not self.handle(conn.recv()):
                            return
            except (EOFError, OSError):
                return  # the front is gone
            if self.engine.has_unfinished():
                self.step()
            elif not busy:
                conn.send(("step", [], self.snapshot()))


def _index_tokenizer(path: str | None) -> dict | None:
    """The tokenizer block of the index's metadata, recorded in the shared deltas."""
    if not path:
        return None
    try:
        return NgramIndex(path).metadata.get("tokenizer")
    except (DartError, OSError, ValueError):
        return None


def _engine_totals(engine) -> dict:
    """Cumulative numbers the engine's stats object exposes (numbers and dicts of numbers only)."""
    stats = getattr(engine, "stats", None)
    if stats is None:
        return {}
    data = stats.as_dict() if hasattr(stats, "as_dict") else getattr(stats, "__dict__", {})
    out = {}
    for k, v in dict(data).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
        elif isinstance(v, dict) and all(isinstance(x, (int, float)) for x in v.values()):
            out[k] = dict(v)
    return out


def _plain(value):
    """JSON-safe copy (numpy scalars and arrays, tuples, dataclasses)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return _plain(asdict(value))
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def run_worker(conn, config: WorkerConfig, worker_id: int) -> None:
    """Process entry point (multiprocessing, spawn)."""
    # Ctrl-C reaches the whole group: the front decides
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    worker: _Worker | None = None

    def _drain(signum, frame):  # SIGTERM sent to a worker itself: finish its requests, then exit
        if worker is not None:
            worker.draining = True

    signal.signal(signal.SIGTERM, _drain)
    try:
        loaded = _factory(config.engine_factory)(config)
    except Exception as exc:  # noqa: BLE001 - reported to the front, which refuses to start
        conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    worker = _Worker(conn, config, loaded)
    conn.send(
        (
            "ready",
            {"pid": os.getpid(), "worker": worker_id, "context_length": loaded.context_length},
        )
    )
    try:
        worker.run()
    except (EOFError, OSError, BrokenPipeError):
        return
    except Exception as exc:  # noqa: BLE001 - an engine failure: fail its requests, exit, get restarted
        message = f"worker {worker_id} failed: {type(exc).__name__}: {exc}"
        traceback.print_exc()
        for rid in list(worker.live):
            try:
                conn.send(("error", rid, 500, message, None, "engine_error"))
            except OSError:
                break
        raise SystemExit(1) from exc

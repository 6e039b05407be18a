"""The OpenAI wire format: request validation and response bodies.

Requests are checked by hand rather than by a pydantic model so that every
rejection is an OpenAI-style body (``{"error": {"message", "type", "param",
"code"}}``, status 400) naming the offending field, the way the OpenAI API
words it ("Unrecognized request argument supplied: foo"). Fields the OpenAI
API defines but this server does not implement (``n`` > 1, ``logprobs``,
tools, penalties, ...) are accepted at their neutral value and rejected with a
400 otherwise, never silently ignored.

Speculative-decoding statistics per request: ``"dart": {"stats": true}`` in the
body (``extra_body=`` in the openai client) or the header ``X-Dart-Stats: 1``;
the response then carries a ``"dart"`` object (tau, acceptance histogram,
budgets, rounds, worker), in the last chunk when streaming. ``"dart": {"learn":
false}`` keeps the request out of the worker's live n-gram layer (where it has one);
``"dart": {"scope": "<name>"}`` names the layer's tenant scope (else the API key's, else the
anonymous one: :mod:`dartcore.serve.scopes`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from dartcore.sampling import SamplingParams
from dartcore.serve.scopes import ANONYMOUS, clear_target, request_scope

__all__ = [
    "APIError",
    "GenRequest",
    "parse_chat",
    "parse_completion",
    "parse_clear",
    "error_body",
    "MAX_STOP",
    "completion_body",
    "chunk_body",
]

MAX_STOP = 4  # the OpenAI API's limit on stop sequences
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """A request the server refuses; ``body()`` is the OpenAI error object."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message,
            status,
            type,
            param,
            code,
        )
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class GenRequest:
    """One validated generation request, as the front hands it to a worker."""

    kind: str  # "chat" | "completion"
    model: str
    prompt: Any  # chat: list of {"role", "content": str}; completion: str or list[int]
    # None: as many as the context allows (chat), capped by the server default
    max_tokens: int | None
    # max_new_tokens = max_tokens once known
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    want_stats: bool = False
    echo: bool = False
    scope: str = ANONYMOUS  # the live layer's scope id (dartcore.serve.scopes)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def to_worker(self) -> dict:
        return {
            "kind": self.kind,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "params": self.params,
            "echo": self.echo,
            "scope": self.scope,
            "stream": self.stream,
        }


# Fields of the OpenAI API this server implements, and those it accepts only at a neutral value
# (name -> predicate that the value is neutral).
_NEUTRAL_COMMON = {
    "n": lambda v: v is None or v == 1,
    "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "logit_bias": lambda v: v is None or v == {},
    "user": lambda v: v is None or isinstance(v, str),
    "service_tier": lambda v: v is None or v in ("auto", "default"),
    "metadata": lambda v: v is None or isinstance(v, dict),
    "store": lambda v: v is None or v is False,
}
_NEUTRAL_CHAT = {
    **_NEUTRAL_COMMON,
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None or v == 0,
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
    "modalities": lambda v: v is None or v == ["text"],
    "reasoning_effort": lambda v: v is None,
    "prediction": lambda v: v is None,
    "audio": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}
_NEUTRAL_COMPLETION = {
    **_NEUTRAL_COMMON,
    "logprobs": lambda v: v is None or v == 0,
    "best_of": lambda v: v is None or v == 1,
    "suffix": lambda v: v is None or v == "",
}
_COMMON = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "dart",
)
_CHAT_FIELDS = frozenset(_COMMON) | {"messages", "max_completion_tokens"} | set(_NEUTRAL_CHAT)
_COMPLETION_FIELDS = frozenset(_COMMON) | {"prompt", "echo"} | set(_NEUTRAL_COMPLETION)


def _invalid(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(message, param=param, code=code)


def _check_fields(body: Any, allowed: frozenset[str], neutral: dict) -> None:
    if not isinstance(body, dict):
        raise _invalid(
            f"the request body must be a JSON object, got a JSON {type(body).__name__}", None
        )
    for key in body:
        if key not in allowed:
            raise _invalid(
                f"Unrecognized request argument supplied: {key}", key, "unknown_parameter"
            )
    for key, ok in neutral.items():
        if key in body and not ok(body[key]):
            raise _invalid(
                f"{key} = {body[key]!r} is not supported by this server (dart-serve generates one "
                f"plain-text choice per request); leave {key} out",
                key,
                "unsupported_parameter",
            )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _sampling(
    body: dict, req: dict, default_temperature: float, authorization: str | None = None
) -> None:
    """The body's sampling fields as the one :class:`~dartcore.sampling.SamplingParams`, which
    checks them; here only what the OpenAI API adds: temperature at most 2, at most MAX_STOP
    stop strings, signed 64-bit seeds. Also the ``"dart"`` object and the live layer's scope
    (``authorization``: the request's Authorization header)."""
    t = body.get("temperature")
    if t is None:
        t = default_temperature
    if _is_number(t) and t > 2:
        raise _invalid(
            f"temperature must be a number in [0, 2] (0 = greedy), got {t!r}",
            "temperature",
            "invalid_value",
        )
    p = body.get("top_p")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP:
        raise _invalid(
            f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings, "
            f"got {stop!r}",
            "stop",
            "invalid_value",
        )
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
        raise _invalid(f"seed must be an integer, got {seed!r}", "seed", "invalid_value")
    if seed is not None and seed < 0:
        # the OpenAI API takes signed 64-bit seeds; the sampler's generator reads unsigned
        seed %= 2**64
    try:
        params = SamplingParams(temperature=t, top_p=1.0 if p is None else p, seed=seed, stop=stops)
    except (TypeError, ValueError) as exc:
        name = str(exc).split(" ", 1)[0]
        raise _invalid(
            str(exc),
            name if name in ("temperature", "top_p", "stop", "seed") else None,
            "invalid_value",
        ) from None
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid(f"stream must be a boolean, got {stream!r}", "stream", "invalid_type")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
            raise _invalid(
                f"stream_options must be an object with include_usage, got {opts!r}",
                "stream_options",
                "invalid_value",
            )
        if not stream:
            raise _invalid(
                "stream_options is only allowed when stream is true",
                "stream_options",
                "invalid_value",
            )
        include_usage = bool(opts.get("include_usage", False))
    dart = body.get("dart")
    if dart is not None and (
        not isinstance(dart, dict)
        or set(dart) - {"stats", "learn", "scope"}
        or not all(isinstance(dart.get(k, False), bool) for k in ("stats", "learn"))
    ):
        raise _invalid(
            f'dart must be an object {{"stats": true|false, "learn": true|false, "scope": '
            f'"<name>"}}, got {dart!r}',
            "dart",
            "invalid_value",
        )
    try:
        scope = request_scope((dart or {}).get("scope"), authorization)
    except ValueError as exc:
        raise _invalid(f"dart.{exc}", "dart.scope", "invalid_value") from None
    if dart is not None and dart.get("learn") is False:
        params = replace(params, learn=False)
    req.update(
        params=params,
        stream=bool(stream),
        include_usage=include_usage,
        want_stats=bool((dart or {}).get("stats", False)),
        scope=scope,
    )


def _max_tokens(body: dict, names: tuple[str, ...]) -> int | None:
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v) or v < 1:
            raise _invalid(f"{name} must be an integer >= 1, got {v!r}", name, "invalid_value")
        return v
    return None


def _model(body: dict, models: tuple[str, ...]) -> str:
    m = body.get("model")
    if not isinstance(m, str) or not m:
        raise _invalid(
            "you must provide a model parameter (GET /v1/models lists them)",
            "model",
            "missing_required_parameter",
        )
    if m not in models:
        raise _invalid(
            f"The model {m!r} does not exist: this server serves {list(models)}",
            "model",
            "model_not_found",
        )
    return m


def _content(content: Any, i: int) -> str:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _invalid(
                    f"{param}[{j}] must be a text part {{'type': 'text', 'text': ...}} (this server takes "
                    "text only)",
                    f"{param}[{j}]",
                    "invalid_value",
                )
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise _invalid(
        f"{param} must be a string or a list of text parts, got {type(content).__name__}",
        param,
        "invalid_type",
    )


def parse_chat(
    body: Any,
    models: tuple[str, ...],
    *,
    header_stats: bool = False,
    authorization: str | None = None,
) -> GenRequest:
    _check_fields(body, _CHAT_FIELDS, _NEUTRAL_CHAT)
    model = _model(body, models)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid(
            "messages must be a non-empty list of {'role', 'content'} objects",
            "messages",
            "missing_required_parameter" if messages is None else "invalid_value",
        )
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _invalid(
                f"messages[{i}] must be an object with role and content",
                f"messages[{i}]",
                "invalid_type",
            )
        role = m.get("role")
        if role not in ROLES:
            raise _invalid(
                f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}",
                f"messages[{i}].role",
                "invalid_value",
            )
        extra = set(m) - {"role", "content", "name"}
        if extra:
            key = sorted(extra)[0]
            raise _invalid(
                f"Unrecognized argument in messages[{i}]: {key}",
                f"messages[{i}].{key}",
                "unknown_parameter",
            )
        rendered.append({"role": role, "content": _content(m.get("content"), i)})
    req: dict = {}
    _sampling(body, req, 1.0, authorization)
    req["want_stats"] = req["want_stats"] or header_stats
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    if max_tokens is not None:
        req["params"] = replace(req["params"], max_new_tokens=max_tokens)
    return GenRequest(kind="chat", model=model, prompt=rendered, max_tokens=max_tokens, **req)


def parse_completion(
    body: Any,
    models: tuple[str, ...],
    *,
    header_stats: bool = False,
    authorization: str | None = None,
) -> GenRequest:
    _check_fields(body, _COMPLETION_FIELDS, _NEUTRAL_COMPLETION)
    model = _model(body, models)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 for t in prompt):
            raise _invalid("prompt token ids must be >= 0", "prompt", "invalid_value")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise _invalid(
            "prompt: a batch of several prompts is not supported by this server; send one request per "
            "prompt",
            "prompt",
            "unsupported_parameter",
        )
    elif not isinstance(prompt, str) or not prompt:
        raise _invalid(
            "prompt must be a non-empty string or a list of token ids",
            "prompt",
            "missing_required_parameter" if prompt is None else "invalid_value",
        )
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise _invalid(f"echo must be a boolean, got {echo!r}", "echo", "invalid_type")
    req: dict = {}
    _sampling(body, req, 1.0, authorization)
    req["want_stats"] = req["want_stats"] or header_stats
    max_tokens = _max_tokens(body, ("max_tokens",))
    max_tokens = 16 if max_tokens is None else max_tokens  # the OpenAI completions API's default
    req["params"] = replace(req["params"], max_new_tokens=max_tokens)
    return GenRequest(
        kind="completion", model=model, prompt=prompt, max_tokens=max_tokens, echo=bool(echo), **req
    )


def parse_clear(body: Any) -> str | None:
    """The scope id ``POST /v1/dart/live/clear`` names (``{"scope": ...}``), None for all."""
    if body is None:
        return None
    if not isinstance(body, dict) or set(body) - {"scope"}:
        raise _invalid(
            f'the body must be empty or {{"scope": "<name or scope id>"}}, got {body!r}',
            None,
            "invalid_value",
        )
    try:
        return clear_target(body.get("scope"))
    except ValueError as exc:
        raise _invalid(str(exc), "scope", "invalid_value") from None


# -- response bodies -----------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    req: GenRequest,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    dart: dict | None,
) -> dict:
    if req.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        out = {"id": f"chatcmpl-{req.id}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        out = {"id": f"cmpl-{req.id}", "object": "text_completion"}
    out.update(
        created=req.created,
        model=req.model,
        choices=[choice],
        usage=_usage(prompt_tokens, completion_tokens),
    )
    if dart is not None:
        out["dart"] = dart
    return out


def chunk_body(
    req: GenRequest,
    text: str | None,
    finish_reason: str | None,
    *,
    first: bool = False,
    usage: tuple[int, int] | None = None,
    dart: dict | None = None,
    no_choice: bool = False,
) -> dict:
    """One SSE chunk; ``no_choice`` makes the trailing usage-only chunk of stream_options.include_usage."""
    if req.kind == "chat":
        out = {"id": f"chatcmpl-{req.id}", "object": "chat.completion.chunk"}
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        out = {"id": f"cmpl-{req.id}", "object": "text_completion"}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    out.update(created=req.created, model=req.model, choices=[] if no_choice else [choice])
    if req.include_usage:
        out["usage"] = _usage(*usage) if usage is not None else None
    if dart is not None:
        out["dart"] = dart
    return out
